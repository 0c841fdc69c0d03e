#!/usr/bin/env bash
# The README's test command: set up, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
FASTARCH_EXTRAS=${FASTARCH_EXTRAS:-test,bench,hf} bash scripts/install.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
