"""Issue 6 headline: CPU causal linear attention at B=1, H=8, L=4096, m=256, D=64.

Prints median times and the ratios the issue asks for:
  - fastarch causal (C++ chunked kernel) vs performer-pytorch's non-CUDA causal path, same features;
  - whole FAVOR+ causal attention: fastarch features + op vs performer_pytorch.FastAttention(causal=True);
  - fastarch causal vs fastarch non-causal (target: within 2x);
  - forward+backward of the same.

Usage: python bench/linear_attention_headline.py [--L 4096] [--repeat 5] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastarch.nn.performer import favor_plus_features, orthogonal_random_features  # noqa: E402
from fastarch.ops import linear_attention  # noqa: E402


def median_time(fn, repeat: int) -> float:
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    B, H, L, m, D = a.B, a.H, a.L, a.m, a.D
    print(f"B={B} H={H} L={L} m={m} D={D}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    qf = (torch.randn(B, H, L, m).abs() * 0.5)
    kf = (torch.randn(B, H, L, m).abs() * 0.5)
    v = torch.randn(B, H, L, D)
    q, k = torch.randn(B, H, L, D) * 0.5, torch.randn(B, H, L, D) * 0.5
    res: dict[str, float] = {}
    with torch.no_grad():
        res["fastarch causal (cpp)"] = median_time(lambda: linear_attention(qf, kf, v, causal=True, backend="cpp"),
                                                   a.repeat)
        res["fastarch causal (torch chunked)"] = median_time(
            lambda: linear_attention(qf, kf, v, causal=True, backend="torch"), a.repeat)
        res["fastarch non-causal"] = median_time(lambda: linear_attention(qf, kf, v), a.repeat)
        w = orthogonal_random_features(m, D)

        def ours_favor():
            return linear_attention(favor_plus_features(q, w, is_query=True),
                                    favor_plus_features(k, w, is_query=False, causal=True), v, causal=True)
        res["fastarch FAVOR+ causal (features + op)"] = median_time(ours_favor, a.repeat)
        try:
            import performer_pytorch.performer_pytorch as pp

            res["performer-pytorch causal_linear_attention_noncuda"] = median_time(
                lambda: pp.causal_linear_attention_noncuda(qf, kf, v), a.repeat)
            fa = pp.FastAttention(dim_heads=D, nb_features=m, causal=True)
            res["performer-pytorch FastAttention(causal=True)"] = median_time(lambda: fa(q, k, v), a.repeat)
        except ImportError:
            print("performer-pytorch not installed: pip install performer-pytorch for the peer numbers")
    qg, kg, vg = (t.clone().requires_grad_() for t in (qf, kf, v))
    dy = torch.randn(B, H, L, D)

    def fb(causal, backend=None):
        return lambda: torch.autograd.grad(linear_attention(qg, kg, vg, causal=causal, backend=backend),
                                           [qg, kg, vg], dy)
    res["fastarch causal fwd+bwd (cpp)"] = median_time(fb(True, "cpp"), a.repeat)
    res["fastarch non-causal fwd+bwd"] = median_time(fb(False), a.repeat)
    if "performer-pytorch causal_linear_attention_noncuda" in res:
        import performer_pytorch.performer_pytorch as pp

        res["performer-pytorch noncuda fwd+bwd"] = median_time(
            lambda: torch.autograd.grad(pp.causal_linear_attention_noncuda(qg, kg, vg), [qg, kg, vg], dy),
            max(2, a.repeat // 2))
    for name, t in res.items():
        print(f"  {name:55s} {t * 1e3:9.1f} ms")
    print("ratios:")
    c = res["fastarch causal (cpp)"]
    print(f"  causal / non-causal (fastarch):                      {c / res['fastarch non-causal']:.2f}x "
          "(target <= 2)")
    print(f"  causal fwd+bwd / non-causal fwd+bwd:                 "
          f"{res['fastarch causal fwd+bwd (cpp)'] / res['fastarch non-causal fwd+bwd']:.2f}x")
    if "performer-pytorch FastAttention(causal=True)" in res:
        print(f"  performer noncuda / fastarch cpp (same features):    "
              f"{res['performer-pytorch causal_linear_attention_noncuda'] / c:.1f}x faster (target >= 6)")
        print(f"  FastAttention(causal) / fastarch FAVOR+ end to end:  "
              f"{res['performer-pytorch FastAttention(causal=True)'] / res['fastarch FAVOR+ causal (features + op)']:.1f}x faster")
        print(f"  performer fwd+bwd / fastarch cpp fwd+bwd:            "
              f"{res['performer-pytorch noncuda fwd+bwd'] / res['fastarch causal fwd+bwd (cpp)']:.1f}x faster")


if __name__ == "__main__":
    main()
