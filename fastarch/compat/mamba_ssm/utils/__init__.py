"""``mamba_ssm.utils``: ``generation`` (``decode``, ``GenerationMixin``, ``InferenceParams``) and ``hf``
(``load_config_hf``, ``load_state_dict_hf``, local directories only)."""

from .._package import package_getattr
from . import generation, hf  # noqa: F401

__getattr__ = package_getattr(__name__, "mamba_ssm.utils")
