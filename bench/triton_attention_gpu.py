"""GPU headline for the Triton attention kernels (issue 3): kernels/attention.py vs SDPA's flash backend.

Targets from the issue (H100, fp16/bf16, L >= 2048, D 64 and 128): forward >= 1.0x SDPA flash, backward
>= 0.8x, and sliding-window time proportional to w. Prints one line per case with milliseconds and the
ratio SDPA time / Triton time (> 1 means Triton is faster), and writes a CSV when --csv is given.

Run on a machine with CUDA: ``python bench/triton_attention_gpu.py [--dtype bf16] [--quick] [--csv out.csv]``
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def bench_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event milliseconds of ``fn`` after warm-up (autotuning happens in the warm-up)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=reps * 5, return_mode="median"))


def _sdpa_flash(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _full_case(B: int, H: int, L: int, D: int, causal: bool, dtype: torch.dtype) -> dict:
    from fastarch.kernels.attention import attention_bwd, attention_fwd

    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
    kw = dict(window_left=-1, window_right=0 if causal else -1, key_padding_mask=None, attn_bias=None,
              dropout_p=0.0, seed=0, scale=D ** -0.5)
    o, lse = attention_fwd(q, k, v, **kw)
    do = torch.randn_like(o)
    t_fwd = bench_ms(lambda: attention_fwd(q, k, v, **kw))
    t_bwd = bench_ms(lambda: attention_bwd(do, q, k, v, o, lse, need_dbias=False, **kw))
    qs, ks, vs = (x.detach().requires_grad_() for x in (q, k, v))
    s_fwd = bench_ms(lambda: _sdpa_flash(q, k, v, causal))
    out = _sdpa_flash(qs, ks, vs, causal)
    s_bwd = bench_ms(lambda: torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True))
    return dict(kind="causal" if causal else "full", B=B, H=H, L=L, D=D, w="",
                triton_fwd_ms=t_fwd, sdpa_fwd_ms=s_fwd, fwd_ratio=s_fwd / t_fwd,
                triton_bwd_ms=t_bwd, sdpa_bwd_ms=s_bwd, bwd_ratio=s_bwd / t_bwd)


def _window_case(L: int, D: int, w: int, dtype: torch.dtype) -> dict:
    from fastarch.kernels.attention import attention_bwd, attention_fwd

    q, k, v = (torch.randn(1, 16, L, D, device="cuda", dtype=dtype) for _ in range(3))
    kw = dict(window_left=w, window_right=w, key_padding_mask=None, attn_bias=None, dropout_p=0.0, seed=0,
              scale=D ** -0.5)
    o, lse = attention_fwd(q, k, v, **kw)
    do = torch.randn_like(o)
    t_fwd = bench_ms(lambda: attention_fwd(q, k, v, **kw))
    t_bwd = bench_ms(lambda: attention_bwd(do, q, k, v, o, lse, need_dbias=False, **kw))
    return dict(kind="window", B=1, H=16, L=L, D=D, w=w, triton_fwd_ms=t_fwd, triton_bwd_ms=t_bwd)


def run(dtype: torch.dtype, quick: bool) -> list[dict]:
    rows = []
    B, H = (2, 16) if quick else (4, 16)
    lengths = [2048, 4096] if quick else [2048, 4096, 8192]
    for D in (64, 128):
        for L in lengths:
            for causal in (False, True):
                r = _full_case(B, H, L, D, causal, dtype)
                rows.append(r)
                print(f"{r['kind']:7s} L={L:5d} D={D:3d}  fwd {r['triton_fwd_ms']:7.3f} ms "
                      f"(sdpa {r['sdpa_fwd_ms']:7.3f}, x{r['fwd_ratio']:.2f})  bwd {r['triton_bwd_ms']:7.3f} ms "
                      f"(sdpa {r['sdpa_bwd_ms']:7.3f}, x{r['bwd_ratio']:.2f})", flush=True)
    # Sliding window: time should scale with w, not L.
    L, D = (8192, 64) if quick else (16384, 64)
    for w in (128, 256, 512, 1024, 2048):
        r = _window_case(L, D, w, dtype)
        rows.append(r)
        print(f"window  L={L:5d} D={D:3d} w={w:5d}  fwd {r['triton_fwd_ms']:7.3f} ms  "
              f"bwd {r['triton_bwd_ms']:7.3f} ms  fwd us per key of band {r['triton_fwd_ms'] / (2 * w + 1) * 1e3:.3f}",
              flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: this benchmark needs a GPU (the Triton interpreter is for tests only)")
        return 0
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    rows = run(torch.float16 if args.dtype == "fp16" else torch.bfloat16, args.quick)
    if args.csv:
        keys = sorted({k for r in rows for k in r})
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=keys)
            wr.writeheader()
            wr.writerows(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
