#!/usr/bin/env bash
# Set up (see scripts/setup.sh), install the test dependencies, run the whole suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `-k stand`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh

VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
hash="$(cat pyproject.toml scripts/setup.sh scripts/test.sh | sha256sum | cut -c1-16)"
stamp="$VENV/.vllm-plugins-test-$hash"
if [ ! -f "$stamp" ]; then
    echo "test: installing test dependencies" >&2
    # Only the test extra: re-resolving [cpu] would bring back torchvision & co.
    "$VPY" -m pip install -e ".[test]"
    rm -f "$VENV"/.vllm-plugins-test-*
    touch "$stamp"
fi

# -ra: say why anything was skipped or xfailed; a hung engine fails its test
# instead of the whole run (first vLLM start on CPU compiles for minutes).
exec "$VPY" -m pytest -q -ra --durations=15 --timeout=1800 "$@"
