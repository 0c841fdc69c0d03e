"""The benchmark interface every suite is written against (frozen: fields may be added, never removed).

A suite module ``fastarch/bench/suites/<name>.py`` defines a module-level ``SUITE``::

    from fastarch.bench.core import Suite, Case, Provider, Skip, BenchConfig

    def cases(cfg: BenchConfig) -> list[Case]:
        ...
        return [Case(name="L=1024", params={"L": 1024}, flops=4.0 * b * h * l * l * d,
                     providers=[Provider("fastarch-cpp", "fastarch", setup_cpp),
                                Provider("reference", "reference", setup_ref)])]

    SUITE = Suite(name="attention", description="...", cases=cases)

``Provider.setup()`` builds the inputs (outside the timed region) and returns a zero-argument callable
that runs ONE timed iteration. It raises :class:`Skip` with a reason ("not installed", "no CUDA device",
"sequence too long for this backend") when the provider cannot run this case; any other exception is
recorded as an error for that provider and the run goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

__all__ = ["BenchConfig", "Case", "MemoryBound", "Provider", "Ratio", "Skip", "Suite", "PROVIDER_KINDS"]

PROVIDER_KINDS: tuple[str, ...] = ("fastarch", "reference", "torch", "peer")


class Skip(Exception):
    """Raised by ``Provider.setup`` (or by a suite's ``cases``) when it cannot run here; the message is the
    reason shown in the table ("not installed", "no CUDA device", ...)."""


@dataclass
class BenchConfig:
    """What a suite's ``cases(cfg)`` is told about the run.

    ``quick``: the default small sweep (all suites together under 3 minutes on a 2-core CPU);
    ``device``/``dtype``: where and in what precision inputs are built;
    ``toy``: shrink every size to the smallest meaningful one (used by the bench's own tests; suites may
    ignore it, the runner also caps work via ``max_seconds_per_provider``);
    ``seed``: for input generation.
    """

    quick: bool = True
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    dtype: torch.dtype = torch.float32
    toy: bool = False
    seed: int = 0

    @property
    def is_cuda(self) -> bool:
        return torch.device(self.device).type == "cuda"


@dataclass
class Provider:
    """One way to run a case.

    ``name``: unique within the case, e.g. "fastarch-cpp", "fastarch-triton", "reference", "sdpa",
    "flex_attention", "flash-attn"; ``kind``: one of ``PROVIDER_KINDS`` — "fastarch" (a fastarch backend),
    "reference" (the PyTorch reference / seed-guide implementation), "torch" (in-torch peers: SDPA,
    flex_attention), "peer" (another library); ``setup``: builds inputs, returns the timed callable, or
    raises :class:`Skip`. ``peer_package``: the importable package a peer needs (reported "not installed"
    when it is absent, without calling ``setup``). ``scale``: the timed call does ``1/scale`` of the case's
    work (e.g. 20 of 8000 merges of a reference too slow to run whole); its times are multiplied by
    ``scale`` and the table marks them as extrapolated.
    """

    name: str
    kind: str
    setup: Callable[[], Callable[[], Any]]
    peer_package: str | None = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in PROVIDER_KINDS:
            raise ValueError(
                f"Provider {self.name!r}: argument 'kind' must be one of {PROVIDER_KINDS}, got {self.kind!r}"
            )


@dataclass(frozen=True)
class Ratio:
    """A comparison a case is there to make: ``time(slower) / time(faster)``, how many times faster the
    provider ``faster`` is than ``slower``. ``target``: the bar, a lower bound (``at_most=False``) or an
    upper bound (``at_most=True``, e.g. causal within 2x of non-causal); the report says met or missed."""

    faster: str
    slower: str
    target: float | None = None
    at_most: bool = False

    def met(self, value: float) -> bool | None:
        if self.target is None:
            return None
        return value <= self.target if self.at_most else value >= self.target


@dataclass(frozen=True)
class MemoryBound:
    """An upper bound on the peak memory of provider ``provider`` in one case, in MB (the report says met
    or missed; measured where the case measures memory)."""

    provider: str
    limit_mb: float

    def met(self, mb: float) -> bool:
        return mb <= self.limit_mb


@dataclass
class Case:
    """One problem size of a suite, run by every provider.

    ``params``: the sizes (used for the table, the CSV and the plots' x axis); ``flops``: floating point
    operations of ONE call (FlashAttention's conventions, see :mod:`fastarch.bench.flops`), or None;
    ``reference``: the provider name speedups are measured against. Optional: ``bytes`` (memory traffic of
    one call, for GB/s), ``group`` (cases with the same group share a plot line family, e.g. "fwd" vs
    "fwd+bwd"; default: the case name up to the first size), ``x`` (the params key on the plot's x axis;
    default: the first of L, seq_len, seqlen, N, rows, n found), ``measure_memory`` (measure peak memory
    in --quick mode too; --full measures every case), ``ratios`` (the comparisons reported for this case),
    ``memory_bounds`` (peak-memory bounds checked for this case; they imply ``measure_memory``).
    """

    name: str
    params: dict[str, Any]
    flops: float | None
    providers: list[Provider]
    reference: str = "reference"
    bytes: float | None = None
    group: str | None = None
    x: str | None = None
    measure_memory: bool = False
    ratios: tuple[Ratio, ...] = ()
    memory_bounds: tuple[MemoryBound, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_bounds:
            self.measure_memory = True
        names = [p.name for p in self.providers]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"Case {self.name!r}: duplicate provider names {dup}")
        for arg, named in (("ratios", {n for r in self.ratios for n in (r.faster, r.slower)}),
                           ("memory_bounds", {m.provider for m in self.memory_bounds})):
            unknown = sorted(named - set(names))
            if unknown:
                raise ValueError(f"Case {self.name!r}: argument '{arg}' names providers {unknown}, expected some "
                                 f"of {names}")

    def only(self, *names: str) -> Case:
        """This case with just the providers ``names`` (in that order), keeping the ratios between them."""
        by = {p.name: p for p in self.providers}
        missing = [n for n in names if n not in by]
        if missing:
            raise ValueError(f"Case {self.name!r}: no providers {missing} (has {list(by)})")
        ratios = tuple(r for r in self.ratios if r.faster in names and r.slower in names)
        bounds = tuple(m for m in self.memory_bounds if m.provider in names)
        ref = self.reference if self.reference in names else names[0]
        return replace(self, providers=[by[n] for n in names], ratios=ratios, memory_bounds=bounds, reference=ref)


@dataclass
class Suite:
    """A named set of cases. ``cases`` is a function ``(BenchConfig) -> list[Case]`` (the sweep that
    ``fastarch bench --suite NAME`` runs); ``case_sets`` maps a name (``lsh-headline``) to another such
    function, run by ``fastarch bench --case NAME``."""

    name: str
    description: str
    cases: Callable[[BenchConfig], list[Case]]
    case_sets: dict[str, Callable[[BenchConfig], list[Case]]] = field(default_factory=dict)

    def cases_for(self, cfg: BenchConfig, case_set: str | None = None) -> list[Case]:
        """The suite's cases, or those of its case set ``case_set``."""
        if case_set is None:
            return self.cases(cfg)
        if case_set not in self.case_sets:
            raise ValueError(f"suite {self.name!r}: argument 'case_set' must be one of {sorted(self.case_sets)}, "
                             f"got {case_set!r}")
        return self.case_sets[case_set](cfg)
