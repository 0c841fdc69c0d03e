"""Compile the Triton LSH attention kernels for a GPU target without a GPU (codegen check;
tests/kernels/test_triton_compile.py runs its ``--quick`` form).

The interpreter that CI uses runs the kernels' logic but not Triton's code generator. This script runs
``triton.compile`` down to a cubin for ``sm_<ARCH>`` with the block sizes the launchers pick
(``kernels.lsh_attention._blocks``) for head dims 32-256 and bucket sizes 32-256, prints each kernel's shared
memory, and fails if any exceeds the architecture's per-block limit, which would make the launch fail on
the GPU.

Usage: ``python tests/kernels/compile_triton_lsh.py [fp16|bf16|fp32 ...] [--arch 90] [--quick]``
(``--quick``: head dim 64 and 128 at bucket size 64 only; with ``--max-head-dim 64``, head dim 64 alone).
Takes minutes on a small CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from fastarch.kernels import lsh_attention as K  # noqa: E402
from tests.kernels.compile_triton_attention import SHARED_LIMIT, SharedMemoryError, compile_one  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtypes", nargs="*", default=["fp16", "fp32"], choices=sorted(DTYPES))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-head-dim", type=int, default=256)
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    limit = SHARED_LIMIT.get(args.arch, 99 * 1024)
    shapes = [(64, 64), (64, 128)] if args.quick else [(64, 32), (64, 64), (64, 128), (128, 128), (256, 256)]
    shapes = [(bs, d) for bs, d in shapes if d <= args.max_head_dim]
    worst = 0
    for name in args.dtypes:
        dt = DTYPES[name]
        ptrs = {n: f"*{name}" for n in ("Q", "V", "G")}
        ptrs.update({n: "*fp32" for n in ("O_S", "LSE_S", "LSE", "DELTA", "DQ_S", "DK_S", "DV_S")})
        ptrs.update(PERM="*i64", KPM="*i8")
        for bs, d in shapes:
            bm, bn, bd = K._blocks(bs, d, dt)
            prec = K._prec(dt)
            print(f"-- {name} bucket_size={bs} head_dim={d}: BLOCK_M={bm} BLOCK_N={bn} BLOCK_D={bd}", flush=True)
            for kern, block_n in ((K._lsh_fwd_kernel, bn), (K._lsh_bwd_dq_kernel, bn),
                                  (K._lsh_bwd_dkv_kernel, min(bn, K._pow2(bs)))):
                consts = dict(HAS_KPM=True, CAUSAL=True, PREC=prec, BLOCK_M=bm, BLOCK_N=block_n, BLOCK_D=bd)
                try:
                    shared = compile_one(kern, ptrs, consts, target, {}, 4, 2, floats=("scale", "eps"))
                except SharedMemoryError as exc:
                    print(f"   {exc}", flush=True)
                    return 1
                worst = max(worst, shared)
    print(f"all kernels fit: largest shared memory {worst} B of sm_{args.arch}'s {limit} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
