#!/usr/bin/env bash
# Set up (see scripts/setup.sh), then run the short benchmark: plain decoding vs.
# each speculative method on the default model, printed as a table.
# Extra arguments go to the benchmark.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
exec "$ROOT/.venv/bin/python" -m vllm_plugins.bench methods --quick "$@"
