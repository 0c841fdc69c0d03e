#!/usr/bin/env bash
# The transformers integration's tests on the oldest transformers the hf extra allows, in a small venv that
# sees the installed torch and fastarch (--system-site-packages) and holds only that transformers and what it
# needs. Run after scripts/install.sh (or scripts/test.sh); .ci/run runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${FASTARCH_OLDEST_VENV:-build/venv-hf-oldest}
mapfile -t OLDEST < <("$PY" scripts/extra_requirements.py hf --oldest)
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV"
"$VENV/bin/python" -m pip install -q "${OLDEST[@]}"
echo "test_hf_oldest: $("$VENV/bin/python" -c 'import transformers; print("transformers", transformers.__version__)')"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/integrations "$@"
