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
PYTEST=("$VPY" -m pytest -q -ra --durations=15 --timeout=1800)
if [ "$#" -gt 0 ]; then
    exec "${PYTEST[@]}" "$@"
fi

# The whole suite as two streams, one per core: the end-to-end tests (marked
# slow; their vLLM engines bind to core 0) and the rest beside them. Each
# prints its own summary; the run fails if either does.
fast_log="$(mktemp)"
trap 'rm -f "$fast_log"' EXIT
"${PYTEST[@]}" -m "not slow" >"$fast_log" 2>&1 &
fast=$!
slow_rc=0
"${PYTEST[@]}" -m slow || slow_rc=$?
fast_rc=0
wait "$fast" || fast_rc=$?
echo "== tests without an engine (beside the end-to-end tests above)"
cat "$fast_log"
[ "$slow_rc" -eq 0 ] && [ "$fast_rc" -eq 0 ]
