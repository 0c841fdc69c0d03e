"""Benchmark suites: one module per suite, each with a module-level ``SUITE``
(:class:`fastarch.bench.core.Suite`), discovered by :func:`fastarch.bench.runner.discover_suites`.

Extra directories of suite modules can be added with the environment variable
``FASTARCH_BENCH_SUITES_PATH`` (``os.pathsep``-separated); their modules are then importable as
``fastarch.bench.suites.<name>``, in the benchmark process and in its memory-measuring subprocesses alike.
"""

from __future__ import annotations

import os

ENV_PATH = "FASTARCH_BENCH_SUITES_PATH"


def extend_path() -> list[str]:
    """Add the directories named in ``FASTARCH_BENCH_SUITES_PATH`` to this package's search path."""
    for d in os.environ.get(ENV_PATH, "").split(os.pathsep):
        if d and os.path.isdir(d) and d not in __path__:
            __path__.append(d)
    return list(__path__)


extend_path()
