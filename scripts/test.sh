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
# instead of the whole run (first vLLM start on CPU compiles for minutes);
# --tb=short: a long traceback prints each argument, and printing a vllm.LLM
# asks its engine, a call that never returns once the engine's client is dead.
PYTEST=("$VPY" -m pytest -q -ra --durations=15 --timeout=1800 --tb=short)
if [ "$#" -gt 0 ]; then
    exec "${PYTEST[@]}" "$@"
fi

# The whole suite, one pytest-xdist worker per core (tests/conftest.py binds
# each worker's vLLM engines to its core), at most one per 10 GiB of memory (a
# worker holds up to three CPU engines of about 3 GB). Whole modules go to a
# worker, the end-to-end ones first, so a module's shared engine is built once.
workers="$("$VPY" -c 'import os
mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
print(max(1, min(len(os.sched_getaffinity(0)), int(mem // 10))))')"
exec "${PYTEST[@]}" -n "$workers" --dist loadfile --no-loadscope-reorder
