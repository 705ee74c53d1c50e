"""A test hook, not a user option: STAND handing vLLM dishonest probability
rows on purpose, so the exactness tests can show they catch a biased proposer.

Set ``VLLM_PLUGINS_STAND_DEBUG_PROBS`` in the environment of the process that
builds the engine (the proposer reads it once, when it is built) to one of:

* ``exact`` (unset): the rows the drafts were drawn from, as always;
* ``uniform``: a uniform row over the drafted distribution's support
  instead of the distribution the token was drawn from: biases sampled output;
* ``drawn``: the row drawn from even where vLLM's verification depends on
  the drawn token (structured outputs, stand.py's rule 3): biases those
  requests;
* ``argmax``: drafts the distribution's most probable token but hands the
  distribution as if it had been drawn from it: output leans to the mode;
* ``per_request``: exact, except for requests whose
  ``SamplingParams.extra_args`` holds ``{"stand_debug_probs": <a mode>}``, so
  one engine serves both sides of a test.
"""

from __future__ import annotations

import os

ENV = "VLLM_PLUGINS_STAND_DEBUG_PROBS"
MODES = ("exact", "uniform", "drawn", "argmax", "per_request")
REQUEST_KEY = "stand_debug_probs"


def engine_mode() -> str:
    """The hook's mode for a proposer built now; a bad value names the variable."""
    mode = os.environ.get(ENV, "") or "exact"
    if mode not in MODES:
        raise ValueError(f"{ENV} must be one of {list(MODES)}, got {mode!r}")
    return mode


def request_mode(engine: str, sampling_params) -> str:
    """What a request gets under the engine's mode."""
    if engine != "per_request":
        return engine
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(REQUEST_KEY, "exact")
