"""``mamba_ssm.models``: ``config_mamba`` (``MambaConfig``) and ``mixer_seq_simple`` (``MambaLMHeadModel``)."""

from ..._missing import missing_attribute

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.models")
