"""``mamba_ssm.ops.triton``: ``selective_state_update`` (runs on every fastarch backend, CPU included)."""
