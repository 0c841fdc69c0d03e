"""Optimizers with the seed guide 003's update rules, as real ``torch.optim.Optimizer`` subclasses.

Each keeps the guide's constructor (``Adam(params, lr, beta1, beta2, eps)``) and state names (``velocity``,
``sum_sq_grad``, ``sq_avg``, ``acc_delta``, ``m``, ``v``), and gains param groups, ``state_dict`` /
``load_state_dict`` and compatibility with ``torch.optim.lr_scheduler``. Every optimizer has a per-tensor
loop and a ``foreach`` path that updates all tensors of a group with PyTorch's multi-tensor kernels
(default: ``foreach=None`` picks it when every tensor of the group is on one device and dense). Adam and
AdamW also have a ``fused`` path, a C++ kernel for CPU tensors (``csrc/cpu/adam.cpp``), their default on CPU.

Where the guide's rule is a ``torch.optim`` optimizer, trajectories match it: SGD, Momentum
(= SGD momentum, no dampening), NesterovMomentum (= SGD nesterov), Adagrad, RMSprop, Adam, AdamW. The
guide's Adadelta adds ``eps`` to the square roots (``(sqrt(u)+eps)/(sqrt(v)+eps)``) where torch adds it
inside them; we keep the guide's rule.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["SGD", "Momentum", "NesterovMomentum", "Adagrad", "RMSprop", "Adadelta", "Adam", "AdamW"]


class _GuideOptimizer(torch.optim.Optimizer):
    """Shared machinery: grouping tensors with gradients, lazy state, and the foreach switch."""

    state_names: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], foreach: bool | None) -> None:
        for k, v in defaults.items():
            if isinstance(v, float) and v < 0:
                raise ValueError(f"{type(self).__name__}: invalid {k}={v} (must be >= 0)")
        defaults["foreach"] = foreach
        super().__init__(params, defaults)

    def _gather(self, group: dict[str, Any]) -> tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]:
        ps, gs, sts = [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            if p.grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            st = self.state[p]
            if not st:
                st["step"] = torch.zeros((), dtype=torch.float32)
                for name in self.state_names:
                    st[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
            ps.append(p)
            gs.append(p.grad)
            sts.append(st)
        return ps, gs, sts

    @staticmethod
    def _use_foreach(group: dict[str, Any], ps: list[Tensor]) -> bool:
        if group["foreach"] is not None:
            return bool(group["foreach"])
        return len(ps) > 1 and len({p.device for p in ps}) == 1

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            ps, gs, sts = self._gather(group)
            if ps:
                self._step_group(group, ps, gs, sts)
        return loss

    def _step_group(self, group: dict[str, Any], ps: list[Tensor], gs: list[Tensor], sts: list[dict[str, Any]]) -> None:
        for st in sts:
            st["step"] += 1
        if self._use_foreach(group, ps):
            self._update_foreach(group, ps, gs, sts)
        else:
            for p, g, st in zip(ps, gs, sts):
                self._update_one(group, p, g, st)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict``, except that ``foreach`` (and ``fused``) stay as this optimizer was built:
        they choose how the update runs here, not what it computes, so a checkpoint written with one path
        resumes on another (e.g. fused on a CPU box, foreach elsewhere)."""
        keep = [{k: g[k] for k in ("foreach", "fused") if k in g} for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, kept in zip(self.param_groups, keep):
            g.update(kept)

    def _update_one(self, group, p, g, st) -> None:
        raise NotImplementedError

    def _update_foreach(self, group, ps, gs, sts) -> None:
        raise NotImplementedError


class SGD(_GuideOptimizer):
    """``p -= lr * g``."""

    def __init__(self, params, lr: float = 1e-3, *, foreach: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr), foreach)

    def _update_one(self, group, p, g, st):
        p.add_(g, alpha=-group["lr"])

    def _update_foreach(self, group, ps, gs, sts):
        torch._foreach_add_(ps, gs, alpha=-group["lr"])


class Momentum(_GuideOptimizer):
    """``v = momentum * v + g; p -= lr * v`` (torch's SGD with momentum and no dampening)."""

    state_names = ("velocity",)

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.9, *, foreach: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum), foreach)

    @staticmethod
    def _velocity(group, g, st):
        return st["velocity"].mul_(group["momentum"]).add_(g)

    @staticmethod
    def _velocities(group, gs, sts):
        vs = [st["velocity"] for st in sts]
        torch._foreach_mul_(vs, group["momentum"])
        torch._foreach_add_(vs, gs)
        return vs

    def _update_one(self, group, p, g, st):
        p.add_(self._velocity(group, g, st), alpha=-group["lr"])

    def _update_foreach(self, group, ps, gs, sts):
        torch._foreach_add_(ps, self._velocities(group, gs, sts), alpha=-group["lr"])


class NesterovMomentum(Momentum):
    """``v = momentum * v + g; p -= lr * (momentum * v + g)`` (torch's SGD with ``nesterov=True``)."""

    def _update_one(self, group, p, g, st):
        v = self._velocity(group, g, st)
        p.add_(g.add(v, alpha=group["momentum"]), alpha=-group["lr"])

    def _update_foreach(self, group, ps, gs, sts):
        upd = torch._foreach_add(gs, self._velocities(group, gs, sts), alpha=group["momentum"])
        torch._foreach_add_(ps, upd, alpha=-group["lr"])


class Adagrad(_GuideOptimizer):
    """``G += g^2; p -= lr * g / (sqrt(G) + eps)``."""

    state_names = ("sum_sq_grad",)

    def __init__(self, params, lr: float = 1e-2, eps: float = 1e-8, *, foreach: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr, eps=eps), foreach)

    def _update_one(self, group, p, g, st):
        s = st["sum_sq_grad"].addcmul_(g, g)
        p.addcdiv_(g, s.sqrt().add_(group["eps"]), value=-group["lr"])

    def _update_foreach(self, group, ps, gs, sts):
        ss = [st["sum_sq_grad"] for st in sts]
        torch._foreach_addcmul_(ss, gs, gs)
        den = torch._foreach_sqrt(ss)
        torch._foreach_add_(den, group["eps"])
        torch._foreach_addcdiv_(ps, gs, den, value=-group["lr"])


class RMSprop(_GuideOptimizer):
    """``v = alpha * v + (1 - alpha) * g^2; p -= lr * g / (sqrt(v) + eps)``."""

    state_names = ("sq_avg",)

    def __init__(self, params, lr: float = 1e-3, alpha: float = 0.99, eps: float = 1e-8, *,
                 foreach: bool | None = None) -> None:
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps), foreach)

    def _update_one(self, group, p, g, st):
        v = st["sq_avg"].mul_(group["alpha"]).addcmul_(g, g, value=1 - group["alpha"])
        p.addcdiv_(g, v.sqrt().add_(group["eps"]), value=-group["lr"])

    def _update_foreach(self, group, ps, gs, sts):
        vs = [st["sq_avg"] for st in sts]
        torch._foreach_mul_(vs, group["alpha"])
        torch._foreach_addcmul_(vs, gs, gs, value=1 - group["alpha"])
        den = torch._foreach_sqrt(vs)
        torch._foreach_add_(den, group["eps"])
        torch._foreach_addcdiv_(ps, gs, den, value=-group["lr"])


class Adadelta(_GuideOptimizer):
    """The guide's Adadelta: ``v = rho v + (1-rho) g^2; d = (sqrt(u) + eps) / (sqrt(v) + eps) * g;
    p -= lr * d; u = rho u + (1-rho) d^2``. ``lr`` defaults to 1 (the guide has none)."""

    state_names = ("sq_avg", "acc_delta")

    def __init__(self, params, rho: float = 0.9, eps: float = 1e-6, lr: float = 1.0, *,
                 foreach: bool | None = None) -> None:
        super().__init__(params, dict(rho=rho, eps=eps, lr=lr), foreach)

    def _update_one(self, group, p, g, st):
        rho, eps = group["rho"], group["eps"]
        v = st["sq_avg"].mul_(rho).addcmul_(g, g, value=1 - rho)
        u = st["acc_delta"]
        d = u.sqrt().add_(eps).div_(v.sqrt().add_(eps)).mul_(g)
        p.add_(d, alpha=-group["lr"])
        u.mul_(rho).addcmul_(d, d, value=1 - rho)

    def _update_foreach(self, group, ps, gs, sts):
        rho, eps = group["rho"], group["eps"]
        vs = [st["sq_avg"] for st in sts]
        us = [st["acc_delta"] for st in sts]
        torch._foreach_mul_(vs, rho)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - rho)
        num = torch._foreach_sqrt(us)
        torch._foreach_add_(num, eps)
        den = torch._foreach_sqrt(vs)
        torch._foreach_add_(den, eps)
        torch._foreach_div_(num, den)
        torch._foreach_mul_(num, gs)
        torch._foreach_add_(ps, num, alpha=-group["lr"])
        torch._foreach_mul_(us, rho)
        torch._foreach_addcmul_(us, num, num, value=1 - rho)


# fused=None picks the C++ kernel automatically only when this is True; see docs/optim.md for the measurements.
AUTO_FUSED = True
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# The kernel reads raw storage: tensor subclasses (DTensor under FSDP2, ...) go the foreach way.
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_fused_ext: Any = None
_fused_error: str | None = None


def _load_fused() -> Any:
    """The ``adam`` CPU extension (built on first use), or raise RuntimeError saying why it cannot be had."""
    global _fused_ext, _fused_error
    if _fused_ext is not None:
        return _fused_ext
    if _fused_error is None:
        from ..backend import ExtensionBuildError
        from ..extensions import load_extension

        try:
            _fused_ext = load_extension("adam", "cpu")
            return _fused_ext
        except ExtensionBuildError as exc:
            _fused_error = str(exc)
    raise RuntimeError(f"fused Adam/AdamW needs the C++ extension csrc/cpu/adam.cpp, which is unavailable: "
                       f"{_fused_error}")


def fused_available() -> bool:
    """Whether the fused CPU Adam/AdamW kernel can be used here (builds it on first call)."""
    try:
        _load_fused()
        return True
    except RuntimeError:
        return False


class Adam(_GuideOptimizer):
    """``m, v`` EWMAs with bias correction; ``p -= lr * m_hat / (sqrt(v_hat) + eps)``.

    The guide's ``beta1``/``beta2`` are accepted, and ``betas=(b1, b2)`` as in torch. ``weight_decay`` is L2
    (added to the gradient), as in ``torch.optim.Adam``.

    Three ways to run a step, all computing the same rule:

    - ``foreach=False``: one tensor at a time;
    - ``foreach=True``: PyTorch's multi-tensor ``_foreach_*`` ops, seven passes over memory per step;
    - ``fused=True``: the C++ kernel ``csrc/cpu/adam.cpp`` (CPU tensors only; float32/float64, and
      float16/bfloat16 params computed in fp32): one pass per element, the parallel loop spanning all tensors
      of the group, step counters bumped in the kernel. Agrees with the foreach path to rounding (torch's CPU
      ``sqrt`` is within one ulp, ours is correctly rounded; m and v are bit-identical in fp32).

    Default (``foreach=None, fused=None``): the fused kernel when every param of the group is a plain CPU
    tensor of a supported dtype and the extension builds (first use compiles it; a failed build warns once and
    falls back), otherwise foreach. It is the default because it is the fastest CPU step measured by
    ``fastarch bench --case optim-headline`` (figures in docs/optim.md). ``foreach=True`` or ``fused=False``
    opt out.
    """

    state_names = ("m", "v")
    decoupled_wd = False

    def __init__(self, params, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 0.0, *, betas: tuple[float, float] | None = None,
                 foreach: bool | None = None, fused: bool | None = None) -> None:
        name = type(self).__name__
        if betas is not None:
            beta1, beta2 = betas
        for arg, b in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"{name}: invalid {arg}={b} (must be in [0, 1))")
        if fused is not None and not isinstance(fused, bool):
            raise TypeError(f"{name}: argument 'fused' must be a bool or None, got {type(fused).__name__}")
        if fused and foreach:
            raise ValueError(f"{name}: fused=True and foreach=True are exclusive; pass one of them")
        # add_param_group (called by the base constructor) checks every group that asks for the fused kernel.
        super().__init__(params, dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                      fused=fused), foreach)

    def _check_fused(self, group: dict[str, Any]) -> None:
        """Raise a clear error if the fused kernel cannot take this group (before any state is touched)."""
        name = type(self).__name__
        for i, p in enumerate(group["params"]):
            if p.device.type != "cpu":
                raise RuntimeError(f"{name}(fused=True): the fused kernel runs on CPU tensors only; "
                                   f"param {i} of its group is on {p.device}")
            if type(p) not in _PLAIN:
                raise TypeError(f"{name}(fused=True): param {i} of its group is a {type(p).__name__}; the fused "
                                f"kernel takes plain tensors (use foreach for tensor subclasses)")
            if p.dtype not in _FUSED_DTYPES:
                raise TypeError(f"{name}(fused=True): param {i} of its group has dtype {p.dtype}; the fused "
                                f"kernel takes {', '.join(str(d) for d in _FUSED_DTYPES)}")
        try:
            _load_fused()
        except RuntimeError as exc:
            raise RuntimeError(f"{name}(fused=True): {exc}") from None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        if self.param_groups[-1].get("fused"):
            self._check_fused(self.param_groups[-1])

    def _use_fused(self, group: dict[str, Any], ps: list[Tensor]) -> bool:
        fused = group.get("fused")
        if fused is not None:
            return bool(fused)
        if not AUTO_FUSED or group["foreach"] is not None:
            return False
        if not all(p.is_cpu and type(p) in _PLAIN and p.dtype in _FUSED_DTYPES for p in ps):
            return False
        if _fused_ext is None and _fused_error is None and not fused_available():
            warnings.warn(f"fastarch.optim: fused Adam/AdamW kernel unavailable, using foreach: {_fused_error}",
                          stacklevel=4)
        return _fused_ext is not None

    def _step_group(self, group, ps, gs, sts):
        if not self._use_fused(group, ps):
            super()._step_group(group, ps, gs, sts)
            return
        # The kernel validates every tensor (CPU, dtypes, shapes) before it writes anything, then bumps the
        # step counters itself; no per-tensor Python work here beyond building the lists.
        _load_fused().adam_step(ps, gs, [st["m"] for st in sts], [st["v"] for st in sts],
                                [st["step"] for st in sts], float(group["lr"]), group["beta1"], group["beta2"],
                                group["eps"], group["weight_decay"], self.decoupled_wd)

    def _coeffs(self, group, st) -> tuple[float, float]:
        t = float(st["step"])
        bc1 = 1 - group["beta1"] ** t
        bc2 = 1 - group["beta2"] ** t
        return group["lr"] / bc1, bc2**0.5

    def _update_one(self, group, p, g, st):
        b1, b2, lr, wd = group["beta1"], group["beta2"], group["lr"], group["weight_decay"]
        if wd:
            if self.decoupled_wd:
                p.mul_(1 - lr * wd)
            else:
                g = g.add(p, alpha=wd)
        m = st["m"].mul_(b1).add_(g, alpha=1 - b1)
        v = st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
        step_size, bc2_sqrt = self._coeffs(group, st)
        p.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(group["eps"]), value=-step_size)

    def _update_foreach(self, group, ps, gs, sts):
        b1, b2, lr, wd = group["beta1"], group["beta2"], group["lr"], group["weight_decay"]
        if wd:
            if self.decoupled_wd:
                torch._foreach_mul_(ps, 1 - lr * wd)
            else:
                gs = torch._foreach_add(gs, ps, alpha=wd)
        ms = [st["m"] for st in sts]
        vs = [st["v"] for st in sts]
        torch._foreach_lerp_(ms, gs, 1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        # Tensors of a group may sit at different step counts (a parameter without grad some steps).
        coeffs = [self._coeffs(group, st) for st in sts]
        den = torch._foreach_sqrt(vs)
        torch._foreach_div_(den, [c[1] for c in coeffs])
        torch._foreach_add_(den, group["eps"])
        torch._foreach_addcdiv_(ps, ms, den, [-c[0] for c in coeffs])


class AdamW(Adam):
    """Adam with decoupled weight decay applied first: ``p *= 1 - lr * weight_decay`` (guide default 1e-2).

    Same ``foreach`` / ``fused`` paths as :class:`Adam`.
    """

    decoupled_wd = True

    def __init__(self, params, lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, betas: tuple[float, float] | None = None,
                 foreach: bool | None = None, fused: bool | None = None) -> None:
        super().__init__(params, lr, beta1, beta2, eps, weight_decay, betas=betas, foreach=foreach, fused=fused)
