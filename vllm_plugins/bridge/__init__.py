"""The only code that touches vLLM's private internals.

``install`` applies ``patches.PATCHES`` (idempotent): each is a
named ``Patch`` over one vLLM attribute, with its reason and the pin test in
tests/test_bridge_pins.py that fails loudly when vLLM's shape changes.

Shared by both model runners, at this level:

- ``patches``: every vLLM internal we replace, add or read, in one list;
- ``config``: start-up (our method names, option validation, refusals);
- ``state``: the one typed object we keep on a runner;
- ``groups``: which requests sample one prompt;
- ``ranks``: tensor-parallel ranks that draft alike;
- ``worker_rpc``, ``live_state``: what ``collective_rpc`` reads of our state;
- ``counters``, ``stat_logger``: our counters from a runner's state to
  vLLM's Prometheus ``/metrics``, through vLLM's own stats;
- ``grammar_front``, ``grammar_hold``, ``grammar_weights``: grammar
  requests in the front end, the scheduler and the workers;
- ``cpu_fixes``: corrections to vLLM's CPU build.

One subpackage per runner:

- ``v1``: the V1 model runner's step, for our proposers only (its
  ``StepContext``, tree steps, self-drafting, processors per verified row);
- ``v2``: Model Runner V2's drafter, taps and runner gate.
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
