"""Compile the Triton attention kernels for a GPU target without a GPU (codegen check; tests/kernels/
test_triton_compile.py runs its ``--quick`` form).

The interpreter (what CI runs) does not exercise Triton's compiler: constexpr specialisation, type rules of
the real code generator, layouts, shared memory. This script runs ``triton.compile`` down to a cubin for
``sm_<ARCH>`` for a spread of configs and feature flags, prints each kernel's shared-memory use and fails
when one exceeds the architecture's per-block limit (the launch would fail on the GPU).

Usage: ``python tests/kernels/compile_triton_attention.py [fp16|bf16|fp32] [--arch 90] [--ones] [--d256]
[--quick]`` (``--ones`` makes size-like arguments the constant 1, as Triton specialises them for e.g. G=1
or Lq=1; ``--d256`` compiles every pruned autotune config at head dim 256; ``--quick`` compiles the forward
and both backward kernels once, head dim 64 with bias, padding mask, dropout, softcap and ALiBi). Takes
minutes on a small CPU, seconds with ``--quick``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from fastarch.kernels import attention as A  # noqa: E402

FLOATS = ("qk_scale", "sm_scale", "drop_scale", "softcap2")
# opt-in shared memory per block (bytes): A100 163 KiB, H100 227 KiB
SHARED_LIMIT = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}


class SharedMemoryError(RuntimeError):
    """A kernel specialisation needs more shared memory than the target gives one block."""


def _jit(kernel) -> JITFunction:
    fn = kernel
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def compile_one(kernel, ptrs: dict, consts: dict, target: GPUTarget, ones: dict, warps=4, stages=3,
                floats=FLOATS):
    """Compile one specialisation to a cubin; returns its shared memory in bytes, raising
    :class:`SharedMemoryError` past the target's per-block limit. Arguments not in ``ptrs``, ``consts`` or
    ``floats`` are i32."""
    fn = _jit(kernel)
    consts = dict(consts, **{k: v for k, v in ones.items() if k in fn.arg_names})
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in fn.arg_names}
    t = time.time()
    k = triton.compile(triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts), target=target,
                       options={"num_warps": warps, "num_stages": stages})
    shown = {n: v for n, v in consts.items() if n.startswith("BLOCK") or n.startswith("HAS") or n == "SPLIT"}
    shared = k.metadata.shared
    print(f"{fn.__name__:24s} {shown} ok {time.time() - t:.1f}s shared={shared}", flush=True)
    limit = SHARED_LIMIT.get(target.arch, 99 * 1024)
    if shared > limit:
        raise SharedMemoryError(f"{fn.__name__} {shown}: shared memory {shared} B > sm_{target.arch}'s {limit} B")
    return shared


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtype", nargs="?", default="fp16", choices=("fp16", "bf16", "fp32"))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--ones", action="store_true")
    ap.add_argument("--d256", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    dt, target = args.dtype, GPUTarget("cuda", args.arch, 32)
    ones = dict(G=1, Lq=1, H=1, Hk=1, split_len=1, left=1, right=1, stride_ls=1) if args.ones else {}
    prec = "ieee" if dt == "fp32" else "tf32"
    ptrs = {"Q": f"*{dt}", "K": f"*{dt}", "V": f"*{dt}", "O": f"*{dt}", "LSE": "*fp32", "BIAS": "*fp32",
            "KPM": "*u8", "DO": f"*{dt}", "DELTA": "*fp32", "DK": f"*{dt}", "DV": f"*{dt}", "DQ": f"*{dt}",
            "DBIAS": "*fp32", "ALIBI": "*fp32"}
    if args.d256:
        flags = dict(BLOCK_D=256, EVEN_D=True, HAS_BIAS=False, HAS_KPM=False, HAS_DROPOUT=False, HAS_SOFTCAP=False,
                     HAS_ALIBI=False, PREC=prec)
        for kern, cfgs, extra in ((A._attn_fwd_kernel, A._FWD_CONFIGS, dict(SPLIT=False)),
                                  (A._attn_bwd_kv_kernel, A._BWD_KV_CONFIGS, {}),
                                  (A._attn_bwd_q_kernel, A._BWD_Q_CONFIGS, dict(NEED_DBIAS=False))):
            for c in (c for c in cfgs if A._fits(c, 256)):
                compile_one(kern, ptrs, dict(flags, **extra, **c.kwargs), target, ones, c.num_warps, c.num_stages)
        return 0
    # (BLOCK_M, BLOCK_N, BLOCK_D, dropout, bias, padding, softcap, ALiBi, split, even D)
    configs = [(128, 64, 64, False, False, False, False, False, False, True),
               (64, 64, 128, True, True, True, False, False, False, False),
               (128, 64, 128, False, False, False, True, True, False, True),
               (16, 128, 128, False, False, False, True, True, True, True)]
    if args.quick:
        configs = [(64, 64, 64, True, True, True, True, True, False, True)]
    for bm, bn, bd, drop, bias, kpm, cap, alibi, split, even in configs:
        flags = dict(BLOCK_D=bd, EVEN_D=even, HAS_BIAS=bias, HAS_KPM=kpm, HAS_DROPOUT=drop, HAS_SOFTCAP=cap,
                     HAS_ALIBI=alibi, PREC=prec)
        compile_one(A._attn_fwd_kernel, dict(ptrs, O="*fp32" if split else f"*{dt}"),
                    dict(flags, SPLIT=split, BLOCK_M=bm, BLOCK_N=bn), target, ones)
        compile_one(A._attn_bwd_kv_kernel, ptrs, dict(flags, BLOCK_M=32, BLOCK_N=64), target, ones)
        compile_one(A._attn_bwd_q_kernel, ptrs, dict(flags, NEED_DBIAS=bias, BLOCK_M=64, BLOCK_N=32), target, ones)
    if not args.quick:
        compile_one(A._bwd_preprocess_kernel, ptrs, dict(BLOCK_M=64, BLOCK_D=64, EVEN_D=True), target, ones)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except SharedMemoryError as exc:
        print(exc, flush=True)
        raise SystemExit(1) from None
