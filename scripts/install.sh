#!/usr/bin/env bash
# One-step set-up: torch first (keeping any torch already installed, e.g. a CUDA build), then fastarch
# with its C++ extensions built ahead of time against that torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if "$PY" -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 4) else 1)" 2>/dev/null; then
  echo "install: keeping torch $("$PY" -c 'import torch; print(torch.__version__)')"
else
  # Pinned on purpose: an unpinned or ranged requirement on a machine without torch resolves to the newest
  # CUDA build (several GB). Set FASTARCH_TORCH_SPEC to choose another build.
  "$PY" -m pip install -q "${FASTARCH_TORCH_SPEC:-torch==2.13.0}"
fi

# Build requirements are not fetched under --no-build-isolation, so install them here.
"$PY" -m pip install -q "setuptools>=70.1" wheel ninja
# --no-build-isolation: the build must see the torch above rather than fetch another into an isolated env.
# FASTARCH_EXTRAS: the optional extras to install (hf: the transformers integration and the bench's hf suite).
EXTRAS=${FASTARCH_EXTRAS:-test,bench,hf}
"$PY" -m pip install -q --no-build-isolation -e ".[${EXTRAS}]"
# The optional integrations are upgraded to their newest release within the extra's range: pip keeps an
# installed version that satisfies the range, and a fresh machine would get the newest, so this one must too.
if [[ ",${EXTRAS}," == *",hf,"* ]]; then
  mapfile -t HF_REQS < <("$PY" scripts/extra_requirements.py hf)
  "$PY" -m pip install -q --upgrade "${HF_REQS[@]}"
fi
"$PY" -m fastarch build --kind cpu >/dev/null || echo "install: some extensions did not build; see 'python -m fastarch info'"
