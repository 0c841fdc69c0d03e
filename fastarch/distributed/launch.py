"""``fastarch train``: train a registered model on a deterministic synthetic task, alone or with
DDP / FSDP / ZeRO across processes started by ``torch.distributed.run`` (gloo on CPU, nccl on GPU).
The options are in :mod:`fastarch.distributed.options`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from .options import PARALLEL, build_parser, validate
from .worker import run

__all__ = ["PARALLEL", "build_parser", "main", "validate"]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        validate(args)
    except ValueError as exc:
        print(f"fastarch train: error: {exc}", file=sys.stderr)
        return 2
    if args.parallel == "none":
        run(args)
        return 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           "-m", "fastarch.distributed.worker"]
    # The worker's options travel in the environment: torch.distributed.run would parse look-alikes itself.
    raw = list(argv) if argv is not None else sys.argv[2:]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               FASTARCH_TRAIN_ARGS=json.dumps(raw))
    return subprocess.call(cmd, env=env)
