"""A request's own say over speculation: ``extra_args["speculation"]``.

    SamplingParams(extra_args={"speculation": {"max_draft": 2,
                                               "sources": ["suffix"]}})

``max_draft``: at most this many drafted tokens (tree nodes) per step for
this request, 0 to turn speculation off for it; at most the engine's
``num_speculative_tokens``. ``sources`` (hybrid only): a non-empty subset
of the engine's sources. Both narrow what the engine would do, never widen
it, and neither changes output: every draft is verified. Anything else is
refused with a ValueError naming the key. Through the OpenAI server the
value is JSON text: ``"vllm_xargs": {"speculation": "{\\"max_draft\\": 0}"}``
(vLLM's ``vllm_xargs`` take strings and numbers only).

``parse_speculation`` reads the value into a ``SpeculationRequest``: the one
parser, called once per request. ``admit`` checks a request at admission
against the engine that serves it (the bridge calls it from that engine's
own request validator, so a bad request fails alone, with HTTP 400 in the
server, and an engine that does not draft with our methods refuses the key
by name). In the worker the bridge parses each request once
(``RequestStep.speculation``); a request the front end should have refused
drafts nothing there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KEY = "speculation"
KNOWN = ("max_draft", "sources")
_WHERE = f'extra_args["{KEY}"]'


@dataclass(frozen=True)
class SpeculationRequest:
    """A request's parsed ``extra_args["speculation"]``."""

    # Draft cap per step, or None for the engine's.
    max_draft: int | None = None
    # Source names the request chose (hybrid), or None for all.
    sources: tuple[str, ...] | None = None
    # Worker side only: why the value is not valid (the request then drafts
    # nothing); None for a valid one.
    problem: str | None = None


def parse_speculation(sampling_params, max_draft: int) -> SpeculationRequest | None:
    """The request's ``extra_args["speculation"]``, or None without one;
    ``max_draft``: the engine's ``num_speculative_tokens``. ValueError
    names what is wrong."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or KEY not in extra:
        return None
    spec = extra[KEY]
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except RecursionError:
            raise ValueError(f"{_WHERE} is JSON text nested too deeply") from None
        except ValueError as e:
            raise ValueError(f"{_WHERE} is not valid JSON text: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{_WHERE} must be an object with keys {list(KNOWN)}, "
                         f"got {_short(spec)}")
    unknown = [k for k in spec if k not in KNOWN]
    if unknown:
        raise ValueError(f"unknown key(s) {_short(unknown)} in {_WHERE}; known keys: "
                         f"{list(KNOWN)}")
    cap = spec.get("max_draft")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                            or not 0 <= cap <= max_draft):
        raise ValueError(f'{_WHERE}["max_draft"] must be an integer in [0, {max_draft}] '
                         f"(the engine's num_speculative_tokens), got {_short(cap)}")
    chosen = spec.get("sources")
    if chosen is not None:
        if (not isinstance(chosen, (list, tuple)) or not chosen
                or not all(isinstance(s, str) for s in chosen)):
            raise ValueError(f'{_WHERE}["sources"] must be a non-empty list of source '
                             f"names, got {_short(chosen)}")
        chosen = tuple(chosen)
    return SpeculationRequest(cap, chosen)


def chosen_sources(spec: SpeculationRequest | None,
                   sources: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The engine's ``sources`` the request keeps, in the engine's order
    (None: all of them); ``sources`` None for a method without sources.
    ValueError names a source the engine does not run."""
    if spec is None or spec.sources is None:
        return None
    if sources is None:
        raise ValueError(f'{_WHERE}["sources"] is for the hybrid method only')
    bad = [s for s in spec.sources if s not in sources]
    if bad:
        raise ValueError(f'{_WHERE}["sources"] names {_short(bad)}, not among the '
                         f"engine's sources {list(sources)}")
    return tuple(s for s in sources if s in spec.sources)


def admit(sampling_params, engine: tuple[str, int, tuple[str, ...] | None] | None,
          engine_method: str | None = None) -> None:
    """Admission of a request's ``extra_args["speculation"]`` by the engine
    that serves it. ``engine``: (our method, num_speculative_tokens, hybrid
    sources or None) of that engine, None where it does not draft with our
    methods (``engine_method``: its speculative method, None without one).
    ValueError names the key."""
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or KEY not in extra:
        return
    if engine is None:
        what = (f"its speculative method is vLLM's '{engine_method}'"
                if engine_method else "it does not speculate")
        raise ValueError(f"{_WHERE} needs an engine whose speculative method is one of "
                         f"vllm-plugins'; the engine serving this request cannot take "
                         f"it: {what}")
    _, max_draft, sources = engine
    chosen_sources(parse_speculation(sampling_params, max_draft), sources)


def worker_speculation(sampling_params, max_draft: int) -> SpeculationRequest | None:
    """``parse_speculation`` where nothing may raise: a value the front end
    should have refused comes back with its ``problem`` and a cap of 0."""
    try:
        return parse_speculation(sampling_params, max_draft)
    except ValueError as e:
        return SpeculationRequest(max_draft=0, problem=str(e))


def _short(value: Any) -> str:
    """``repr(value)`` cut to a line (an error names a value, not a page)."""
    try:
        text = repr(value)
    except RecursionError:
        return f"a {type(value).__name__} nested too deeply"
    return text if len(text) <= 200 else text[:200] + "..."
