"""``mamba_ssm.models``: ``config_mamba`` (``MambaConfig``) and ``mixer_seq_simple`` (``MambaLMHeadModel``)."""

from ..._missing import missing_attribute
from . import config_mamba, mixer_seq_simple  # noqa: F401

# submodules are imported above: the module __getattr__ answers only for names it lacks
__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.models")
