"""Benchmark suites: one module per suite, each with a module-level ``SUITE``
(:class:`fastarch.bench.core.Suite`). Discovered by :func:`fastarch.bench.runner.discover_suites`."""
