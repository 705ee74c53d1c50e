"""Which requests a tree may serve, and which sample greedily.

A tree step reproduces vLLM's sampler only for the sampling features its
acceptance rules implement (``acceptance.py``); proposers ask ``tree_allowed``
before building a tree, and the bridge cuts any other request's tree to a
chain, which vLLM verifies itself. The greedy threshold is vLLM's own
(``vllm.sampling_params._SAMPLING_EPS``, pinned by tests/test_bridge_pins.py):
every part of the package that must agree with vLLM on "greedy" reads it here.
"""

from __future__ import annotations

# vLLM samples greedily below this temperature (SamplingParams.sampling_type).
SAMPLING_EPS = 1e-5
# extra_args keys no logits processor reads: the request's own say over
# speculation (vllm_plugins.proposers.sources.request), which leaves
# sampling as it is, so a tree may still serve the request.
SPECULATION_ONLY_KEYS = frozenset({"speculation"})


def is_greedy(params) -> bool:
    """Whether vLLM samples this request greedily. ``params``: its
    SamplingParams, or anything else with its ``temperature`` (a
    ``RequestStep``); None counts as greedy."""
    return float(getattr(params, "temperature", 0.0) or 0.0) < SAMPLING_EPS


def tree_allowed(sampling_params) -> bool:
    """Whether a request may be verified as a tree: no feature whose
    sampler path the tree acceptance does not reproduce (logprobs,
    penalties, bad words, structured outputs, logits processors and biases,
    min_tokens, min_p, allowed tokens; extra_args, which custom logits
    processors read, but for ``speculation``). Proposers call it before building a
    tree; the bridge enforces it by cutting other requests' trees to a chain.
    """
    p = sampling_params
    if p is None:
        return True
    return not (
        getattr(p, "logprobs", None) is not None
        or getattr(p, "prompt_logprobs", None) is not None
        or getattr(p, "presence_penalty", 0.0) != 0.0
        or getattr(p, "frequency_penalty", 0.0) != 0.0
        or getattr(p, "repetition_penalty", 1.0) != 1.0
        or getattr(p, "bad_words", None)
        or getattr(p, "structured_outputs", None) is not None
        or getattr(p, "logit_bias", None)
        or getattr(p, "allowed_token_ids", None)
        or getattr(p, "min_tokens", 0)
        or getattr(p, "min_p", 0.0) > 0.0
        or set(getattr(p, "extra_args", None) or ()) - SPECULATION_ONLY_KEYS
        or getattr(p, "thinking_token_budget", None) is not None
    )
