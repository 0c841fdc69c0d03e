"""``mamba_ssm.distributed``: ``distributed_utils`` (collectives with autograd) and ``tensor_parallel`` (the
column/row-parallel linear layers and parallel embeddings), on ``torch.distributed``; a ``process_group`` of
None means one process."""

from .._package import package_getattr
from . import distributed_utils, tensor_parallel  # noqa: F401

__getattr__ = package_getattr(__name__, "mamba_ssm.distributed")
