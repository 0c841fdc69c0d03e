"""Benchmarks of fastarch ops and models against the PyTorch reference and peer libraries.

Run them with ``fastarch bench`` (see :mod:`fastarch.bench.cli`), or one headline comparison with
``fastarch bench --case NAME``; suites live in ``fastarch/bench/suites/<name>.py`` and are written
against :mod:`fastarch.bench.core`.
"""

from __future__ import annotations

from .core import BenchConfig, Case, Provider, Ratio, Skip, Suite

__all__ = ["BenchConfig", "Case", "Provider", "Ratio", "Skip", "Suite"]
