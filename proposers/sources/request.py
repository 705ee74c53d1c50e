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

The front end checks a request against the engine it was configured for:
``note_engine`` is called when our method's config is translated (in the
process that builds the engine), and ``validate_speculation`` runs at
admission (the grammar processor's ``validate_params``, which vLLM calls for
every request), so a bad request fails alone, with HTTP 400 in the server.
Where one process configures several engines, the last one configured is
the one checked against; the worker checks again and drafts nothing for a
request that does not fit.
"""

from __future__ import annotations

import json
from typing import Any

KEY = "speculation"
KNOWN = ("max_draft", "sources")
_WHERE = f'extra_args["{KEY}"]'


def speculation_request(extra_args: dict[str, Any] | None, max_draft: int,
                        sources: tuple[str, ...] | None = None, *,
                        check_sources: bool = True
                        ) -> tuple[int | None, tuple[str, ...] | None]:
    """(draft cap or None, sources or None) of a request's
    ``extra_args``; ValueError names what is wrong. ``sources``: the
    engine's hybrid sources, None for a method without sources;
    ``check_sources`` False reads the cap alone."""
    if not extra_args or KEY not in extra_args:
        return None, None
    spec = extra_args[KEY]
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except ValueError as e:
            raise ValueError(f"{_WHERE} is not valid JSON text: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"{_WHERE} must be an object with keys {list(KNOWN)}, got {spec!r}")
    unknown = sorted(set(spec) - set(KNOWN))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown} in {_WHERE}; known keys: {list(KNOWN)}")
    cap = spec.get("max_draft")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int)
                            or not 0 <= cap <= max_draft):
        raise ValueError(f'{_WHERE}["max_draft"] must be an integer in [0, {max_draft}] '
                         f"(the engine's num_speculative_tokens), got {cap!r}")
    chosen = spec.get("sources") if check_sources else None
    if chosen is not None:
        if sources is None:
            raise ValueError(f'{_WHERE}["sources"] is for the hybrid method only')
        if (not isinstance(chosen, (list, tuple)) or not chosen
                or not all(isinstance(s, str) for s in chosen)):
            raise ValueError(f'{_WHERE}["sources"] must be a non-empty list of source '
                             f"names among the engine's {list(sources)}, got {chosen!r}")
        bad = [s for s in chosen if s not in sources]
        if bad:
            raise ValueError(f'{_WHERE}["sources"] names {bad}, not among the engine\'s '
                             f"sources {list(sources)}")
        chosen = tuple(s for s in sources if s in chosen)
    return cap, chosen


# The engine this process configured last: (method, num_speculative_tokens,
# hybrid sources or None); None before any.
_engine: tuple[str, int, tuple[str, ...] | None] | None = None


def note_engine(method: str, max_draft: int, sources: tuple[str, ...] | None) -> None:
    global _engine
    _engine = (method, int(max_draft), None if sources is None else tuple(sources))


def validate_speculation(extra_args: dict[str, Any] | None) -> None:
    """Admission check of a request's ``extra_args["speculation"]`` against
    the engine configured in this process; ValueError names the key."""
    if not extra_args or KEY not in extra_args:
        return
    if _engine is None:
        raise ValueError(f"{_WHERE} needs an engine whose speculative method is one of "
                         f"vllm-plugins'")
    _, max_draft, sources = _engine
    speculation_request(extra_args, max_draft, sources)
