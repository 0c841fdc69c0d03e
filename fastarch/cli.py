"""The ``fastarch`` command: ``info``, ``build``, ``bench`` and ``train``."""

from __future__ import annotations

import argparse
import sys


def _info(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastarch info", description="versions, devices, builds and op x backend table")
    p.add_argument("--no-build", action="store_true", help="do not build missing extensions, only report them")
    a = p.parse_args(argv)
    from .info import report

    print(report(build=not a.no_build))
    return 0


def _build(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fastarch build", description="prebuild every compiled extension")
    p.add_argument("--kind", choices=["cpu", "cuda", "all"], default="all")
    a = p.parse_args(argv)
    from .extensions import build_all

    kinds = ("cpu", "cuda") if a.kind == "all" else (a.kind,)
    results = build_all(kinds)
    failed = 0
    for mod, kind, st in results:
        print(f"{mod:<32} {kind:<5} {st}")
        failed += st != "ok" and not st.startswith(("torch is a CPU build", "no CUDA device"))
    return 1 if failed else 0


def _bench(argv: list[str]) -> int:
    from .bench.cli import main

    return int(main(argv) or 0)


def _train(argv: list[str]) -> int:
    from .distributed.launch import main

    return int(main(argv) or 0)


COMMANDS = {"info": _info, "build": _build, "bench": _bench, "train": _train}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print("usage: fastarch {info,build,bench,train} [options]\n\n"
              "  info    versions, devices, extension builds, and an op x backend table\n"
              "  build   prebuild the C++/CUDA extensions\n"
              "  bench   benchmark every op and model against the reference and the peers\n"
              "  train   train a registered model, optionally with DDP/FSDP/ZeRO")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nfastarch: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
