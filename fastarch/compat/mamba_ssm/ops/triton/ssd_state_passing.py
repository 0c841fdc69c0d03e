"""``mamba_ssm.ops.triton.ssd_state_passing``: ``state_passing(states, dA_chunk_cumsum, initial_states=None)``
and ``state_passing_ref`` on :mod:`fastarch.ops.ssd_scan`. The kernels' private helpers (``_state_passing_fwd``,
``_state_passing_bwd``) are not provided: importing one raises an ImportError naming it."""

from fastarch.compat._missing import missing_attribute
from fastarch.ops.ssd_scan import state_passing, state_passing_ref

__all__ = ["state_passing", "state_passing_ref"]

__getattr__ = missing_attribute("mamba_ssm", "mamba_ssm.ops.triton.ssd_state_passing",
                                internal=("_state_passing_fwd", "_state_passing_bwd"))
