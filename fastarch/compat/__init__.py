"""Peer-compatible entry points: the signatures of flash-attn, mamba-ssm and causal-conv1d on fastarch.ops."""
