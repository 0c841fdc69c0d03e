"""One PNG per suite: time and peak memory against the case's size (log-log), one line per provider,
one row of panels per case group. Uses matplotlib's Agg backend; without matplotlib, plotting is skipped
with a message."""

from __future__ import annotations

import os
from pathlib import Path

from .runner import ProviderResult, RunResult

__all__ = ["plot_suites"]


def plot_suites(run: RunResult, out_dir: str | os.PathLike, title_suffix: str = "") -> tuple[list[Path], str]:
    """Write ``<out_dir>/<suite>.png`` for every suite with timed results; returns (paths, message)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "plots skipped: matplotlib is not installed"
    by_suite: dict[str, list[ProviderResult]] = {}
    for r in run.results:
        if r.status == "ok" and r.timing is not None and r.x is not None:
            by_suite.setdefault(r.suite, []).append(r)
    paths = []
    for suite, rs in by_suite.items():
        groups: dict[str, list[ProviderResult]] = {}
        for r in rs:
            groups.setdefault(r.group or suite, []).append(r)
        has_mem = any(r.mem_bytes is not None for r in rs)
        ncols = 2 if has_mem else 1
        fig, axes = plt.subplots(len(groups), ncols, figsize=(6.0 * ncols, 3.6 * len(groups)), squeeze=False)
        for row, (gname, grs) in enumerate(groups.items()):
            xname = grs[0].x_name or "size"
            provs = list(dict.fromkeys(r.provider for r in grs))
            for p in provs:
                # Cases of one group may share an x (e.g. several models at one size): order by x alone.
                pts = sorted(((r.x, r) for r in grs if r.provider == p), key=lambda t: t[0])
                style = dict(marker="o", linestyle="--" if pts[0][1].kind != "fastarch" else "-", label=p)
                if pts[0][1].reference:
                    style.update(color="black")
                axes[row][0].plot([x for x, _ in pts], [r.timing.median_ms for _, r in pts], **style)
                if has_mem:
                    mp = [(x, r.mem_bytes / 2**20) for x, r in pts if r.mem_bytes is not None]
                    if mp:
                        axes[row][1].plot([x for x, _ in mp], [max(m, 1e-3) for _, m in mp], **style)
            if has_mem and not any(r.mem_bytes is not None for r in grs):
                axes[row][1].text(0.5, 0.5, "memory not measured for these cases\n(--full or --memory all)",
                                  ha="center", va="center", transform=axes[row][1].transAxes, fontsize=8)
            panels = [("time (ms, median)", axes[row][0])]
            if has_mem:
                panels.append(("peak memory over inputs (MB)", axes[row][1]))
            for ylabel, ax in panels:
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xlabel(xname)
                ax.set_ylabel(ylabel)
                ax.set_title(f"{suite}: {gname}", fontsize=10)
                ax.grid(True, which="both", alpha=0.3)
            axes[row][0].legend(fontsize=7)
        if title_suffix:
            fig.suptitle(title_suffix, fontsize=9)
        fig.tight_layout()
        path = Path(out_dir) / f"{suite}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths, f"{len(paths)} plot(s) written"
