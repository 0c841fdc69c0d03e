"""The backend selector: which implementation runs a call of an op, and why.

Every op in :mod:`fastarch.ops` registers one :class:`Implementation` per backend (``triton``, ``cuda``,
``cpp``, ``aten``: PyTorch's native kernels, ``torch``: PyTorch compositions). An implementation declares
its capabilities as data (devices, dtypes, max head dim, feature limits, dropout, bias gradient, varlen,
determinism); its reasons for refusing a call derive from them, plus :meth:`Implementation.check` for the
rest. The selector is the only place that decides which one runs:

1. an explicit ``backend=`` keyword on the op;
2. the innermost :func:`use_backend` context;
3. the ``FASTARCH_BACKEND`` environment variable (``torch``, or ``attention=triton,selective_scan=cpp``);
4. otherwise the automatic order for the op and device, fastest first as measured (:func:`set_order`).

A forced backend that cannot take the call raises :class:`BackendUnavailableError` listing every
backend's reasons. In automatic mode a backend whose build or import fails is skipped with one warning
per process. Ops resolve the implementation once per call and pin it (see ``fastarch.ops._dispatch``), so
a backward runs the implementation its forward ran.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

BACKENDS: tuple[str, ...] = ("triton", "cuda", "cpp", "aten", "torch")
AUTO = "auto"

# Fastest first; per-op measured orders replace these through :func:`set_order`. Triton is absent on CPU:
# it runs there only in interpreter mode, for tests. ``torch`` comes last: it is the composition that runs
# where no kernel takes the call.
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "cuda": ("cuda", "triton", "aten", "torch"),
    "cpu": ("cpp", "aten", "torch"),
}

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


class BackendUnavailableError(RuntimeError):
    """A forced backend cannot run the call; the message gives every backend's reasons."""


class ExtensionBuildError(RuntimeError):
    """A compiled extension failed to build or import."""


@dataclass
class Call:
    """What an implementation needs to know to accept or refuse a call.

    ``device`` and ``dtype`` are always set; ``features`` carries op-specific facts. The ones the declared
    capabilities read are ``head_dim``, ``dropout``, ``bias_grad`` and ``varlen``; the others (``causal``,
    ``window``, ``dstate``, ...) are for an implementation's :meth:`Implementation.check`.
    """

    device: torch.device
    dtype: torch.dtype
    features: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.features[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.features.get(key, default)


# os.environ.get encodes the key and decodes the value on every call (about a microsecond); the selector reads
# two variables per call, so it reads os.environ's own storage, which every assignment through os.environ
# (monkeypatch.setenv included) updates. Elsewhere it falls back to os.environ.get.
_ENV_STORE = getattr(os.environ, "_data", None)
_ENV_KEYS: dict[str, object] = {}


def _env(name: str) -> str:
    """``os.environ.get(name, "")``, without the per-call encoding."""
    if _ENV_STORE is None:
        return os.environ.get(name, "")
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.environ.encodekey(name)
    value = _ENV_STORE.get(key)
    return "" if value is None else (value.decode() if isinstance(value, bytes) else value)


def triton_interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _dtype_name(d: torch.dtype) -> str:
    return str(d).replace("torch.", "")


class Implementation:
    """One backend's implementation of one op.

    Subclasses set ``op`` and ``backend``, declare their capabilities as class attributes, and add the
    op's functions (``forward``, ``backward``, ...) as methods. :meth:`not_supported_reasons` derives
    from the declared capabilities; :meth:`check` adds what they cannot say.

    Capabilities:

    - ``devices``, ``dtypes``: device types and dtypes of the call's main tensor;
    - ``max_head_dim``: the largest ``head_dim`` feature (None: any);
    - ``limits``: the largest value of other integer features, e.g. ``{"dstate": 256}``;
    - ``supports_dropout``, ``supports_bias_grad``, ``supports_varlen``: True or False for ops with that
      feature, None (the default) for ops without it; a call whose ``dropout``, ``bias_grad`` or ``varlen``
      feature is true is refused unless it is True;
    - ``deterministic``: False refuses every call while ``torch.use_deterministic_algorithms(True)``;
    - ``cache_rows``: an attention implementation with a ``cache_forward`` (a decode kernel over KV-cache
      rows) serves inference calls of up to this many query rows with it (0: none).

    Loading is declared too: ``kernel_module`` names a module of :mod:`fastarch.kernels` (Triton), and
    subclasses for compiled extensions override :meth:`load` once per backend kind, not per op.
    """

    op: str = ""
    backend: str = ""
    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    max_head_dim: int | None = None
    limits: Mapping[str, int] = {}
    supports_dropout: bool | None = None
    supports_bias_grad: bool | None = None
    supports_varlen: bool | None = None
    deterministic: bool = True
    cache_rows: int = 0
    kernel_module: str | None = None
    description: str = ""

    def __init__(self) -> None:
        self._lib: Any = None
        self._load_error: str | None = None
        self._loaded = False
        self._lock = threading.Lock()

    # -- loading ---------------------------------------------------------------------------------
    def load(self) -> Any:
        """Import or build what this implementation needs and return it (an extension, a module).

        Raise an exception with a readable message when it cannot be had.
        """
        if self.kernel_module is not None:
            return importlib.import_module(f"{__package__}.kernels.{self.kernel_module}")
        return None

    def static_reasons(self) -> list[str]:
        """Reasons that hold for any call on this machine (missing package, no CUDA torch)."""
        return []

    def ensure_loaded(self) -> str | None:
        """Load once; return the failure message, or None when loaded."""
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    try:
                        self._lib = self.load()
                    except Exception as exc:  # a failed build is a reason, never a crash
                        msg = str(exc).strip().splitlines()
                        self._load_error = f"failed to load: {msg[-1] if msg else type(exc).__name__}"
                    self._loaded = True
        return self._load_error

    @property
    def lib(self) -> Any:
        err = self.ensure_loaded()
        if err is not None:
            raise ExtensionBuildError(f"{self.op}/{self.backend}: {err}")
        return self._lib

    # -- support -----------------------------------------------------------------------------------
    @classmethod
    def capabilities(cls) -> dict[str, Any]:
        """The declared capabilities, for reports (``fastarch info``)."""
        caps: dict[str, Any] = {
            "devices": cls.devices,
            "dtypes": tuple(_dtype_name(d) for d in cls.dtypes),
            "max_head_dim": cls.max_head_dim,
            "dropout": cls.supports_dropout,
            "bias_grad": cls.supports_bias_grad,
            "varlen": cls.supports_varlen,
            "deterministic": cls.deterministic,
        }
        caps.update({f"max_{k}": v for k, v in cls.limits.items()})
        return caps

    def check(self, call: Call) -> list[str]:
        """Reasons beyond the declared capabilities why this implementation refuses ``call``."""
        return []

    def declared_reasons(self, call: Call) -> list[str]:
        """The reasons that follow from the declared capabilities alone."""
        reasons = []
        dev = call.device.type
        if dev not in self.devices:
            reasons.append(f"device {dev} not supported (supports {', '.join(self.devices)})")
        if call.dtype not in self.dtypes:
            names = ", ".join(_dtype_name(d) for d in self.dtypes)
            reasons.append(f"dtype {_dtype_name(call.dtype)} not supported (supports {names})")
        limits = dict(self.limits)
        if self.max_head_dim is not None:
            limits["head_dim"] = self.max_head_dim
        for name, most in limits.items():
            value = call.get(name)
            if value is not None and value > most:
                reasons.append(f"{name.replace('_', ' ')} {value} > {most}")
        for name, supported in (("dropout", self.supports_dropout), ("bias_grad", self.supports_bias_grad),
                                ("varlen", self.supports_varlen)):
            if call.get(name) and not supported:
                reasons.append(f"no {name.replace('_', ' ')} support")
        if not self.deterministic and torch.are_deterministic_algorithms_enabled():
            reasons.append("not deterministic (torch.use_deterministic_algorithms is on)")
        return reasons

    def not_supported_reasons(self, call: Call, *, load: bool = True) -> list[str]:
        """Every reason, in words, why this implementation cannot take ``call``."""
        reasons = list(self.static_reasons())
        if self.backend == "cuda" and torch.version.cuda is None:
            reasons.append("torch is a CPU build (no CUDA)")
        reasons.extend(self.declared_reasons(call))
        if self.backend == "triton" and call.device.type == "cpu" and "cpu" in self.devices \
                and not triton_interpret_mode():
            reasons.append("triton runs on CPU tensors only with TRITON_INTERPRET=1")
        reasons.extend(self.check(call))
        if not reasons and load:
            err = self.ensure_loaded()
            if err is not None:
                reasons.append(err)
        return reasons


class TritonImplementation(Implementation):
    """Base for Triton implementations: unavailable when the triton package cannot be imported; ``load``
    imports ``fastarch.kernels.<kernel_module>``."""

    backend = "triton"

    def static_reasons(self) -> list[str]:
        try:
            import triton  # noqa: F401
        except ImportError:
            return ["triton is not installed"]
        return []


# -- registry ------------------------------------------------------------------------------------------
_REGISTRY: dict[str, dict[str, Implementation]] = {}
_ORDER: dict[str, dict[str, tuple[str, ...]]] = {}
_WARNED: set[tuple[str, str]] = set()
_FORCED: contextvars.ContextVar[tuple[dict[str, str], str | None] | None] = contextvars.ContextVar(
    "fastarch_forced_backend", default=None
)


def register(impl: Implementation | type[Implementation]) -> Implementation:
    """Register an implementation (an instance or a class, which is instantiated). Usable as a decorator."""
    inst = impl() if isinstance(impl, type) else impl
    if inst.backend not in BACKENDS:
        raise ValueError(f"unknown backend {inst.backend!r}; expected one of {BACKENDS}")
    if not inst.op:
        raise ValueError("an Implementation must name its op")
    _REGISTRY.setdefault(inst.op, {})[inst.backend] = inst
    clear_decisions()
    return inst


def set_order(op: str, device_type: str, order: Sequence[str]) -> None:
    """Set the automatic order for ``op`` on ``device_type``, fastest first, as measured."""
    for b in order:
        if b not in BACKENDS:
            raise ValueError(f"unknown backend {b!r}")
    _ORDER.setdefault(op, {})[device_type] = tuple(order)
    clear_decisions()


def ops() -> list[str]:
    return sorted(_REGISTRY)


def implementations(op: str) -> dict[str, Implementation]:
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; registered ops: {', '.join(ops())}")
    return dict(_REGISTRY[op])


def get_implementation(op: str, backend: str) -> Implementation:
    impls = implementations(op)
    if backend not in impls:
        raise BackendUnavailableError(
            f"op {op!r} has no {backend!r} implementation (it has: {', '.join(impls)})"
        )
    return impls[backend]


def auto_order(op: str, device_type: str) -> tuple[str, ...]:
    order = _ORDER.get(op, {}).get(device_type, DEFAULT_ORDER.get(device_type, ("torch",)))
    return tuple(b for b in order if b in _REGISTRY.get(op, {}))


# -- overrides ------------------------------------------------------------------------------------------
def parse_backend_spec(spec: str) -> tuple[dict[str, str], str | None]:
    """Parse ``"torch"`` or ``"attention=triton,selective_scan=cpp"`` into (per-op, global)."""
    per_op: dict[str, str] = {}
    glob: str | None = None
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        if "=" in part:
            op, _, b = (s.strip() for s in part.partition("="))
            _check_backend_name(b, source=spec)
            per_op[op] = b
        else:
            _check_backend_name(part, source=spec)
            glob = part
    return per_op, glob


@functools.lru_cache(maxsize=16)
def _parsed_environment(spec: str) -> tuple[dict[str, str], str | None]:
    # FASTARCH_BACKEND is read on every call; its parse is kept per value (a changed value is parsed anew).
    return parse_backend_spec(spec.strip())


def _check_backend_name(name: str, source: str) -> None:
    if name not in BACKENDS and name != AUTO:
        raise ValueError(f"unknown backend {name!r} in {source!r}; expected one of {', '.join(BACKENDS)}")


@contextlib.contextmanager
def use_backend(spec: str | None = None, **per_op: str) -> Iterator[None]:
    """Force backends inside a ``with`` block.

    ``use_backend("torch")`` forces every op; ``use_backend(attention="triton")`` or
    ``use_backend("attention=triton,selective_scan=cpp")`` forces single ops. Contexts nest: an inner
    one overrides what it names and inherits the rest.
    """
    outer = _FORCED.get()
    merged, glob = (dict(outer[0]), outer[1]) if outer else ({}, None)
    if spec:
        p, g = parse_backend_spec(spec)
        if g is not None:
            merged, glob = {}, g
        merged.update(p)
    for op, b in per_op.items():
        _check_backend_name(b, source=f"{op}={b}")
        merged[op] = b
    token = _FORCED.set((merged, glob))
    try:
        yield
    finally:
        _FORCED.reset(token)


def requested_backend(op: str, backend: str | None = None) -> str:
    """The backend asked for this call: explicit keyword, then context, then environment, else 'auto'."""
    if backend is not None and backend != AUTO:
        _check_backend_name(backend, source=f"backend={backend!r}")
        return backend
    forced = _FORCED.get()
    if forced is not None:
        per_op, glob = forced
        if op in per_op:
            return per_op[op]
        if glob is not None:
            return glob
    env = _env("FASTARCH_BACKEND")
    if env:
        per_op, glob = _parsed_environment(env)
        if op in per_op:
            return per_op[op]
        if glob is not None:
            return glob
    return AUTO


def _cap_text(v: Any) -> str:
    return "/".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _reasons_table(op: str, call: Call, with_capabilities: bool = False) -> str:
    lines = []
    for name in BACKENDS:
        impl = _REGISTRY.get(op, {}).get(name)
        if impl is None:
            lines.append(f"  {name}: no implementation of {op}")
            continue
        reasons = impl.not_supported_reasons(call)
        lines.append(f"  {name}: " + ("available" if not reasons else "; ".join(reasons)))
        if with_capabilities:
            caps = ", ".join(f"{k}={_cap_text(v)}" for k, v in impl.capabilities().items() if v is not None)
            lines.append(f"    declares: {caps}")
    return "\n".join(lines)


# -- decisions ------------------------------------------------------------------------------------------
# (op, device, dtype, features, wanted backend, global switches) -> the implementation chosen. Every input of
# a decision is in the key: the call's own facts (what an implementation's capabilities and check() read),
# the backend asked for (so a changed override, context or FASTARCH_BACKEND makes another key), and the
# process-wide switches the reasons read (deterministic algorithms, the Triton interpreter). What changes the
# candidates (register, set_order) clears it. Calls whose features are not hashable are decided uncached.
_DECISIONS: dict[tuple, Implementation] = {}
_DECISIONS_MAX = 4096
_STATS = {"hits": 0, "misses": 0}
_LOG = logging.getLogger("fastarch.backend")
_LOG_DECISIONS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fastarch_decision_log",
                                                                             default=None)


def clear_decisions() -> None:
    """Forget every cached decision (done by :func:`register` and :func:`set_order`; call it after changing
    what an implementation's reasons read in a way the decision key does not see, e.g. in tests)."""
    _DECISIONS.clear()


def decision_stats() -> dict[str, int]:
    """Counts of cached-decision hits and misses, and the number of cached decisions."""
    return {**_STATS, "cached": len(_DECISIONS)}


def _key(op: str, call: Call, want: str) -> tuple:
    return (op, call.device, call.dtype, tuple(call.features.items()), want,
            torch.are_deterministic_algorithms_enabled(), _env("TRITON_INTERPRET"))


def _decision_key(op: str, call: Call, want: str) -> tuple | None:
    key = _key(op, call, want)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _decide(op: str, call: Call, want: str) -> Implementation:
    impls = _REGISTRY.get(op)
    if not impls:
        raise KeyError(f"unknown op {op!r}")
    if want != AUTO:
        impl = impls.get(want)
        if impl is not None and not impl.not_supported_reasons(call):
            return impl
        raise BackendUnavailableError(
            f"{op}: backend {want!r} cannot run this call "
            f"(device={call.device.type}, dtype={_dtype_name(call.dtype)}).\n"
            f"Backends and their reasons:\n{_reasons_table(op, call)}"
        )
    for name in auto_order(op, call.device.type):
        impl = impls[name]
        reasons = impl.not_supported_reasons(call, load=False)
        if reasons:
            continue
        err = impl.ensure_loaded()
        if err is not None:
            if (op, name) not in _WARNED:
                _WARNED.add((op, name))
                warnings.warn(
                    f"fastarch: {op} backend {name!r} is unavailable ({err}); falling back",
                    RuntimeWarning,
                    stacklevel=4,
                )
            continue
        return impl
    raise BackendUnavailableError(
        f"{op}: no backend can run this call "
        f"(device={call.device.type}, dtype={_dtype_name(call.dtype)}).\n"
        f"Backends and their reasons:\n{_reasons_table(op, call)}"
    )


def choose(op: str, call: Call, want: str = AUTO) -> Implementation:
    """The implementation that runs ``call`` when ``want`` (a backend name, or 'auto') is asked for.

    No override is read here: 'auto' is the automatic order alone, so the same call always gets the same
    implementation. A named backend that cannot take the call raises with every backend's reasons. The
    decision is cached (see :func:`clear_decisions`); a refused call is decided anew each time.
    """
    key: tuple | None = _key(op, call, want)
    try:  # one hash: the lookup itself tells whether the features are hashable
        impl = _DECISIONS.get(key)
    except TypeError:
        key, impl = None, None
    hit = impl is not None
    if hit:
        _STATS["hits"] += 1
    else:
        _STATS["misses"] += 1
        impl = _decide(op, call, want)
        if key is not None:
            if len(_DECISIONS) >= _DECISIONS_MAX:
                _DECISIONS.clear()
            _DECISIONS[key] = impl
    log = _LOG_DECISIONS.get()
    if log is not None or _LOG_ALL:
        if log is not None:
            log.append((op, call, want, impl.backend, hit))
        _LOG.info("fastarch: %s -> %s (%s; %s, %s, %s)", op, impl.backend, "cached" if hit else "decided",
                  call.device, _dtype_name(call.dtype), call.features)
    return impl


@contextlib.contextmanager
def log_decisions() -> Iterator[list[tuple[str, Call, str, str, bool]]]:
    """Record every decision made inside the block: yields a list that fills with ``(op, call, requested,
    backend, cached)`` tuples, each also logged at INFO on the ``fastarch.backend`` logger. Setting
    ``FASTARCH_LOG_DECISIONS=1`` logs every decision of the process the same way."""
    log: list = []
    token = _LOG_DECISIONS.set(log)
    try:
        yield log
    finally:
        _LOG_DECISIONS.reset(token)


_LOG_ALL = os.environ.get("FASTARCH_LOG_DECISIONS", "") not in ("", "0")
if _LOG_ALL and not _LOG.handlers:
    _LOG.addHandler(logging.StreamHandler())
    _LOG.setLevel(logging.INFO)


def select(op: str, call: Call, backend: str | None = None) -> Implementation:
    """Return the implementation that runs ``call``, honouring overrides; raise if a forced one can't."""
    return choose(op, call, requested_backend(op, backend))


def explain(op: str, call: Call, backend: str | None = None) -> str:
    """A human-readable account of which backend runs ``call`` and why the others do not, and whether the
    decision was already cached."""
    key = _decision_key(op, call, requested_backend(op, backend))
    cached = key is not None and key in _DECISIONS
    try:
        chosen = select(op, call, backend)
    except BackendUnavailableError as exc:
        return str(exc)
    head = f"{op}: runs on {chosen.backend!r} (requested: {requested_backend(op, backend)})"
    if chosen.description:
        head += f": {chosen.description}"
    state = ("cached decision (hit)" if cached else "decided now and cached" if key is not None
             else "decided now (features not hashable: not cached)")
    order = " > ".join(auto_order(op, call.device.type))
    return (f"{head}\ndecision: {state}; features: {call.features}\n"
            f"automatic order on {call.device.type}: {order}\n" + _reasons_table(op, call, True))


def explain_call(fn: Any, *args: Any, **kwargs: Any) -> str:
    """Run ``fn(*args, **kwargs)`` (a public op with its own arguments) without autograd and explain every
    decision the call made: which backend ran each op it reached, whether the decision was cached, and why
    the other backends do not take it."""
    with log_decisions() as log, torch.no_grad():
        fn(*args, **kwargs)
    if not log:
        return f"{getattr(fn, '__name__', fn)}: the call reached no fastarch op (empty input or a reference path)"
    parts = []
    for op, call, want, chosen, hit in log:
        order = " > ".join(auto_order(op, call.device.type))
        parts.append(f"{op}: runs on {chosen!r} (requested: {want}; {'cached decision' if hit else 'decided now'})"
                     f"\nfeatures: {call.features}\nautomatic order on {call.device.type}: {order}\n"
                     + _reasons_table(op, call, True))
    return "\n\n".join(parts)


def availability(op: str, device_type: str, dtype: torch.dtype = torch.float32) -> Mapping[str, list[str]]:
    """Per backend, the reasons ``op`` is unavailable for a plain call on ``device_type`` (empty = ok)."""
    call = Call(torch.device(device_type), dtype, {})
    out: dict[str, list[str]] = {}
    for name in BACKENDS:
        impl = _REGISTRY.get(op, {}).get(name)
        out[name] = ["not implemented"] if impl is None else impl.not_supported_reasons(call)
    return out


def _reset_warnings_for_tests() -> None:
    _WARNED.clear()
    clear_decisions()
