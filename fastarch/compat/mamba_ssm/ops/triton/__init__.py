"""``mamba_ssm.ops.triton``: ``selective_state_update``, ``ssd_combined`` and ``layernorm_gated`` (on every
fastarch backend, CPU included)."""
