"""Triton kernels and their launchers, one file per op family.

Kernel modules are imported lazily by the ops' Triton implementations, never by ``import fastarch``,
so that TRITON_INTERPRET can be set before they load and a missing Triton costs nothing.
"""
