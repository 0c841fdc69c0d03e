"""Print the requirements of one of fastarch's extras (as installed), one per line: ``python
scripts/extra_requirements.py hf`` -> ``transformers<6,>=5.21``. With ``--oldest``, each requirement pinned to
the lowest version its ``>=`` bound allows (``transformers==5.21``)."""

from __future__ import annotations

import re
import sys
from importlib.metadata import requires


def extra_requirements(extra: str) -> list[str]:
    out = []
    for req in requires("fastarch") or []:
        spec, _, marker = req.partition(";")
        if re.search(rf"extra\s*==\s*['\"]{re.escape(extra)}['\"]", marker):
            out.append(spec.strip())
    if not out:
        raise SystemExit(f"extra_requirements: fastarch has no extra {extra!r} (is fastarch installed?)")
    return out


def oldest(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.\-\[\]]+", requirement).group(0)
    low = re.search(r">=\s*([0-9][0-9.]*)", requirement)
    if low is None:
        raise SystemExit(f"extra_requirements: {requirement!r} states no lower bound")
    return f"{name}=={low.group(1)}"


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--oldest"]
    if len(args) != 1:
        raise SystemExit("usage: python scripts/extra_requirements.py EXTRA [--oldest]")
    reqs = extra_requirements(args[0])
    print("\n".join(oldest(r) if "--oldest" in sys.argv else r for r in reqs))
