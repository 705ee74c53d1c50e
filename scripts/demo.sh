#!/usr/bin/env bash
# Set up (see scripts/setup.sh), then run the short benchmark: plain decoding vs.
# each speculative method on the default model, printed as a table.
# Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
PY="$ROOT/.venv/bin/python"
# vLLM's CPU build logs this from every process it starts, before its logging
# level applies; the demo drops that one line (scripts/drop_line.py)
# and passes the rest of standard error, progress bar included, as it comes.
TRITON_LINE="Triton is installed, but doesn't include CPU backend. Disabling Triton."
{ "$PY" -m vllm_plugins.bench methods --quick "$@" 2>&1 1>&3 3>&- \
    | "$PY" scripts/drop_line.py "$TRITON_LINE" 1>&2 3>&-; } 3>&1
