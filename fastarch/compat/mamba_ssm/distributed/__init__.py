"""``mamba_ssm.distributed``: ``distributed_utils`` (collectives with autograd) and ``tensor_parallel`` (the
column/row-parallel linear layers and parallel embeddings), on ``torch.distributed``; a ``process_group`` of
None means one process."""

from ..._missing import missing_attribute
from . import distributed_utils, tensor_parallel  # noqa: F401

# submodules are imported above: the module __getattr__ answers only for names it lacks
__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.distributed")
