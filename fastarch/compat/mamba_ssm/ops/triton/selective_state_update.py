"""``mamba_ssm.ops.triton.selective_state_update``: ``selective_state_update(state, x, dt, A, B, C, D=None,
z=None, dt_bias=None, dt_softplus=False, state_batch_indices=None)`` and ``selective_state_update_ref``.

Every form mamba-ssm accepts (3-D or 4-D state, grouped B/C, stride-0 expanded A/dt/D/dt_bias,
``state_batch_indices``); see :mod:`fastarch.ops.selective_state_update`.
"""

from .....ops.selective_state_update import selective_state_update, selective_state_update_ref

__all__ = ["selective_state_update", "selective_state_update_ref"]
