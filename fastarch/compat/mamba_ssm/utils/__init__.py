"""``mamba_ssm.utils``: ``generation`` (``decode``, ``GenerationMixin``, ``InferenceParams``) and ``hf``
(``load_config_hf``, ``load_state_dict_hf``, local directories only)."""

from ..._missing import missing_attribute
from . import generation, hf  # noqa: F401

# submodules are imported above: the module __getattr__ answers only for names it lacks
__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.utils")
