"""Compile the Triton SSD scan kernels for a GPU target without a GPU (codegen check;
tests/kernels/test_triton_compile.py runs its ``--quick`` form).

The interpreter runs the kernels' logic but not Triton's code generator. This script runs ``triton.compile``
down to a cubin for ``sm_<ARCH>`` with the block sizes the launchers pick (``kernels.ssd_scan.blocks``),
with and without ``seq_idx``, prints each kernel's shared memory and fails if one exceeds the architecture's
per-block limit.

Usage: ``python tests/kernels/compile_triton_ssd_scan.py [fp16|bf16|fp32 ...] [--arch 90] [--quick]``
(``--quick``: chunk size 256, head dim 64, state size 128 only).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from triton.backends.compiler import GPUTarget  # noqa: E402

from fastarch.kernels import ssd_scan as K  # noqa: E402
from tests.kernels.compile_triton_attention import SHARED_LIMIT, SharedMemoryError, _jit, compile_one  # noqa: E402

PRECISION = {"fp16": "tf32", "bf16": "tf32", "fp32": "ieee"}


def kernels(bk: dict[str, int], prec: str, has_seq: bool) -> list[tuple]:
    """(kernel, constexprs, warps) for every kernel the launchers run at block sizes ``bk``; the outer-product
    kernel's ``U`` is ``x`` without ``ENTERING`` and the fp32 ``dy`` with it."""
    common = dict(HAS_SEQ=has_seq, PREC=prec, BLOCK_T=bk["T"], BLOCK_P=bk["P"], BLOCK_N=bk["N"])
    cums = dict(BLOCK_Q=bk["Q"], BLOCK_H=bk["H"])
    return [
        (K._ssd_cumsum_kernel, cums, 4),
        (K._ssd_dcum_kernel, cums, 4),
        *((K._ssd_outer_kernel, dict(ENTERING=e, HAS_SEQ=has_seq, PREC=prec, BLOCK_T=bk["T"],
                                     BLOCK_P=bk["outer_P"], BLOCK_N=bk["outer_N"]), 4) for e in (False, True)),
        *((K._ssd_pass_kernel, dict(HAS_INIT=True, REVERSE=r, HAS_SEQ=has_seq, BLOCK=bk["state"]), 4)
          for r in (False, True)),
        (K._ssd_output_kernel, dict(common, BLOCK_P=bk["out_P"]), bk["warps"]),
        (K._ssd_bwd_col_kernel, common, bk["warps"]),
        (K._ssd_bwd_row_kernel, common, bk["warps"]),
    ]


def specialisations(dtypes: list[str], quick: bool):
    """(kernel, pointer types, constexprs, warps) for each dtype, shape and with/without seq_idx."""
    # (chunk size, head dim, state size)
    shapes = [(256, 64, 128)] if quick else [(256, 64, 128), (64, 64, 64), (128, 128, 128), (256, 64, 256)]
    for name in dtypes:
        ptrs = {n: "*fp32" for kern, _, _ in kernels(K.blocks(64, 64, 64), "ieee", True)
                for n in _jit(kern).arg_names if n.endswith("_ptr")}
        ptrs.update({n: f"*{name}" for n in ("x_ptr", "B_ptr", "C_ptr", "V_ptr")}, seq_ptr="*i32")
        for cs, p, n in shapes:
            bk = K.blocks(cs, p, n)
            print(f"-- {name} chunk_size={cs} headdim={p} dstate={n}: {bk}", flush=True)
            for kern, consts, warps in (k for has_seq in (False, True) for k in kernels(bk, PRECISION[name], has_seq)):
                yield kern, dict(ptrs, U_ptr="*fp32" if consts.get("ENTERING") else f"*{name}"), consts, warps


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("dtypes", nargs="*", default=["fp16", "fp32"], choices=sorted(PRECISION))
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    target = GPUTarget("cuda", args.arch, 32)
    try:
        worst = max(compile_one(kern, ptrs, consts, target, {}, warps, 2)
                    for kern, ptrs, consts, warps in specialisations(args.dtypes, args.quick))
    except SharedMemoryError as exc:
        print(f"   {exc}", flush=True)
        return 1
    print(f"all kernels fit: largest shared memory {worst} B of sm_{args.arch}'s "
          f"{SHARED_LIMIT.get(args.arch, 99 * 1024)} B")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
