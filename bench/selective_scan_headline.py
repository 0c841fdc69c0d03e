"""Headline CPU comparison for the selective scan (issue 5): fastarch's C++ backend against the reference.

Run from the repo root: ``python bench/selective_scan_headline.py [--quick] [--fb-ref-L 256]
[--sections fwd,fb,mem,block,decode]``. In one run it prints times and ratios for

1. the forward at B=2, D=1536, L=2048, N=16 (fp32; variable B/C, D, z, delta_bias, softplus): cpp against
   the reference loop (:func:`fastarch.ops.selective_scan_ref`, mamba-ssm's ``selective_scan_ref``);
2. forward+backward: cpp at the headline size, and cpp against the reference's autograd at ``--fb-ref-L``
   (default 256; the reference's autograd at L=2048 holds several B*D*L*N tensors and takes minutes on a
   loaded 2-core machine; pass ``--fb-ref-L 2048`` to run it at the headline size);
3. peak memory (RSS high-water mark over the baseline, in a child process with glibc's mmap threshold at
   64 KiB so freed buffers leave RSS) of the cpp forward+backward at N=16 and N=64 for the same B*D*L, in
   units of B*D*L*4 bytes, and of the reference at a small size for contrast;
4. a MambaBlock (d_model=768, L=2048, batch 1) forward+backward against the seed guide's MambaBlock (its
   class is copied below as the reference), same weights;
5. one decode step of a Mamba layer's two decode ops (selective_state_update, causal_conv1d_update), cpp
   against torch (the CPU auto order puts cpp first).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fastarch.bench.suites.selective_scan import GuideMambaBlock  # noqa: E402  (the guide's block, the reference)
from fastarch.ops.selective_scan import CHUNK, selective_scan, selective_scan_ref  # noqa: E402


def bench(fn, reps: int = 3, warmup: int = 1) -> float:
    """Best wall time of ``reps`` calls after ``warmup`` (best-of: the machine is shared and loaded)."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def scan_inputs(b: int, d: int, L: int, n: int, grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(b, d, L, generator=g), torch.randn(b, d, L, generator=g) * 0.5,
          -torch.rand(d, n, generator=g) - 0.5, torch.randn(b, n, L, generator=g), torch.randn(b, n, L, generator=g),
          torch.randn(d, generator=g), torch.randn(b, d, L, generator=g), torch.randn(d, generator=g) * 0.1]
    return [t.requires_grad_(grad) for t in ts]


def fwd_bwd(fn, ins):
    def run():
        for t in ins:
            t.grad = None
        fn(*ins, delta_softplus=True).sum().backward()
    return run


def cpp_scan(*a, **k):
    return selective_scan(*a, **k, backend="cpp")


# -- peak memory, measured in a child process ----------------------------------------------------------------
def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def memory_child(which: str, b: int, d: int, L: int, n: int) -> None:
    """Print the peak RSS (bytes) of one forward+backward over the RSS before it (inputs already built)."""
    fn = cpp_scan if which == "cpp" else selective_scan_ref
    ins = scan_inputs(b, d, L, n, grad=True)
    run = fwd_bwd(fn, ins)
    run()  # warm-up: builds/loads the extension, allocates grads
    for t in ins:
        t.grad = None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _rss_kb("VmRSS")
    run()
    print(json.dumps({"peak_bytes": (_rss_kb("VmHWM") - base) * 1024}))


def measure_memory(which: str, b: int, d: int, L: int, n: int) -> int | None:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--memory-child", which, str(b), str(d), str(L), str(n)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if res.returncode != 0:
        print(f"  memory child failed: {res.stderr.strip().splitlines()[-1:]}")
        return None
    return json.loads(res.stdout.strip().splitlines()[-1])["peak_bytes"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="L=512 and a smaller block, for a fast check")
    ap.add_argument("--fb-ref-L", type=int, default=256, help="L at which the reference autograd is timed")
    ap.add_argument("--sections", default="fwd,fb,mem,block,decode",
                    help="comma list of fwd, fb, mem, block, decode (default: all)")
    ap.add_argument("--memory-child", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        which, *sizes = args.memory_child
        memory_child(which, *map(int, sizes))
        return
    sections = args.sections.split(",")
    L = 512 if args.quick else 2048
    print(f"selective_scan B=2 D=1536 L={L} N=16 fp32, threads={torch.get_num_threads()}, "
          f"load average {os.getloadavg()[0]:.1f}")
    run = {"fwd": lambda: fwd_section(2, 1536, L, 16), "fb": lambda: fb_section(2, 1536, L, 16, args.fb_ref_L),
           "mem": lambda: mem_section(2, 1536, L), "block": lambda: block_section(args.quick), "decode": decode_steps}
    for name in sections:
        run[name]()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


def fwd_section(b: int, d: int, L: int, n: int) -> None:
    """1. forward: cpp against the reference loop."""
    ins = scan_inputs(b, d, L, n)
    with torch.no_grad():
        t_cpp = bench(lambda: selective_scan(*ins, delta_softplus=True, backend="cpp"), reps=5)
        t_ref = bench(lambda: selective_scan_ref(*ins, delta_softplus=True), reps=1, warmup=0)
    print(f"forward       L={L}: reference {t_ref * 1e3:9.1f} ms   cpp {t_cpp * 1e3:8.1f} ms   "
          f"speedup {t_ref / t_cpp:6.1f}x")


def fb_section(b: int, d: int, L: int, n: int, ref_L: int) -> None:
    """2. forward + backward: cpp at L; cpp against the reference's autograd at ref_L."""
    gi = scan_inputs(b, d, L, n, grad=True)
    t_cpp_fb = bench(fwd_bwd(cpp_scan, gi), reps=3)
    print(f"fwd+bwd       L={L}: cpp {t_cpp_fb * 1e3:8.1f} ms")
    Lr = min(ref_L, L)
    gr = scan_inputs(b, d, Lr, n, grad=True)
    t_cpp_fb_r = bench(fwd_bwd(cpp_scan, gr), reps=3)
    t_ref_fb_r = bench(fwd_bwd(selective_scan_ref, gr), reps=1, warmup=0)
    print(f"fwd+bwd       L={Lr}: reference autograd {t_ref_fb_r * 1e3:9.1f} ms   cpp {t_cpp_fb_r * 1e3:8.1f} ms   "
          f"speedup {t_ref_fb_r / t_cpp_fb_r:6.1f}x")


def mem_section(b: int, d: int, L: int) -> None:
    """3. peak memory of forward+backward, in units of B*D*L fp32."""
    bdl = b * d * L * 4
    for n in (16, 64):
        pk = measure_memory("cpp", b, d, L, n)
        if pk is not None:
            ck = b * d * ((L + CHUNK - 1) // CHUNK) * n * 4
            print(f"peak memory   cpp fwd+bwd B={b} D={d} L={L} N={n}: {pk / 2**20:7.1f} MiB = "
                  f"{pk / bdl:5.2f} x B*D*L*4 bytes (of which checkpoints {ck / bdl:4.2f} = N/{CHUNK})")
    bs, ds, Ls = 1, 256, 512
    for which in ("cpp", "reference"):
        pk = measure_memory(which, bs, ds, Ls, 16)
        if pk is not None:
            print(f"peak memory   {which:9s} fwd+bwd B={bs} D={ds} L={Ls} N=16: {pk / 2**20:7.1f} MiB = "
                  f"{pk / (bs * ds * Ls * 4):6.2f} x B*D*L*4 bytes")


def block_section(quick: bool) -> None:
    """4. MambaBlock forward+backward against the guide's, same weights."""
    from fastarch.nn.mamba import MambaBlock

    torch.manual_seed(0)
    dm, Lb = (256, 512) if quick else (768, 2048)
    guide = GuideMambaBlock(dm).eval()
    fast = MambaBlock(dm).eval()
    fast.load_state_dict(guide.state_dict())
    x = torch.randn(1, Lb, dm, requires_grad=True)

    def step(m):
        def run():
            x.grad = None
            m.zero_grad(set_to_none=True)
            m(x).sum().backward()
        return run

    t_f = bench(step(fast), reps=3)
    t_g = bench(step(guide), reps=1, warmup=0)
    print(f"MambaBlock fwd+bwd d_model={dm} L={Lb} B=1: guide {t_g * 1e3:9.1f} ms   fastarch {t_f * 1e3:8.1f} ms"
          f"   speedup {t_g / t_f:6.1f}x")


def decode_steps() -> None:
    from fastarch.ops.causal_conv1d import causal_conv1d_update
    from fastarch.ops.selective_state_update import selective_state_update

    g = torch.Generator().manual_seed(0)
    b, d, n = 1, 1536, 16
    st, x, dt = torch.randn(b, d, n, generator=g), torch.randn(b, d, generator=g), torch.randn(b, d, generator=g)
    A, B, C = -torch.rand(d, n, generator=g), torch.randn(b, n, generator=g), torch.randn(b, n, generator=g)
    D, z, bias = torch.randn(d, generator=g), torch.randn(b, d, generator=g), torch.randn(d, generator=g)
    cs, w = torch.randn(b, d, 3, generator=g), torch.randn(d, 4, generator=g)

    def loop(fn, k=100):
        def run():
            for _ in range(k):
                fn()
        return run

    t = {be: bench(loop(lambda be=be: selective_state_update(st, x, dt, A, B, C, D, z, bias, True, backend=be)),
                   reps=5) / 100 for be in ("torch", "cpp")}
    print(f"decode        selective_state_update B=1 D={d} N={n}: torch {t['torch'] * 1e6:8.1f} us   "
          f"cpp {t['cpp'] * 1e6:8.1f} us   speedup {t['torch'] / t['cpp']:5.1f}x")
    t = {be: bench(loop(lambda be=be: causal_conv1d_update(x, cs, w, bias, "silu", backend=be)), reps=5) / 100
         for be in ("torch", "cpp")}
    print(f"decode        causal_conv1d_update   B=1 D={d} W=4:  torch {t['torch'] * 1e6:8.1f} us   "
          f"cpp {t['cpp'] * 1e6:8.1f} us   speedup {t['torch'] / t['cpp']:5.1f}x")


if __name__ == "__main__":
    main()
