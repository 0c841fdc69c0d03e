"""``mamba_ssm.models``: ``config_mamba`` (``MambaConfig``) and ``mixer_seq_simple`` (``MambaLMHeadModel``)."""

from .._package import package_getattr
from . import config_mamba, mixer_seq_simple  # noqa: F401

__getattr__ = package_getattr(__name__, "mamba_ssm.models")
