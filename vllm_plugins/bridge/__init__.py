"""The only code that touches vLLM's private internals.

``install`` applies ``patches.PATCHES`` (idempotent): each is a
named ``Patch`` over one vLLM attribute, with its reason and the pin test in
tests/test_bridge_pins.py that fails loudly when vLLM's shape changes.

- ``patches``: every vLLM internal we replace, add or read, in one list;
- ``config``: start-up (our method names, option validation, refusals);
- ``runner``: the V1 model runner's step, for our proposers only;
- ``v2``: Model Runner V2's drafter, taps and runner gate;
- ``step``: the StepContext built from the runner's arrays (no patching);
- ``target_layers``: the target's partial forwards for self-drafting proposers;
- ``state``: the one typed object we keep on a runner;
- ``counters``, ``stat_logger``: our counters from a runner's state to
  vLLM's Prometheus ``/metrics``, through vLLM's own stats;
- ``cpu_fixes``: a correction to vLLM's CPU build.
"""

from __future__ import annotations


def install() -> list[str]:
    """Applies every patch not yet applied; returns their names."""
    from vllm_plugins.bridge.patching import apply
    from vllm_plugins.bridge.patches import PATCHES

    return apply(PATCHES)


def install_refusal() -> list[str]:
    """On a vLLM the bridge was not checked against: only the patch that
    refuses our method names (``patches.UNSUPPORTED_VLLM_PATCHES``), and
    not even that where this vLLM lacks its target. Never raises."""
    import logging

    try:
        from vllm_plugins.bridge.patching import apply
        from vllm_plugins.bridge.patches import UNSUPPORTED_VLLM_PATCHES

        return apply(UNSUPPORTED_VLLM_PATCHES)
    except Exception as e:  # noqa: BLE001 - vLLM must run whatever this vLLM is
        logging.getLogger("vllm_plugins").warning(
            "vllm-plugins could not install the refusal of its method names on this "
            "vLLM (%s: %s); a config naming one reaches vLLM as it is", type(e).__name__, e)
        return []
