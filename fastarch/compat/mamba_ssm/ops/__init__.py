"""``mamba_ssm.ops``: ``selective_scan_interface`` and ``triton.selective_state_update``."""
