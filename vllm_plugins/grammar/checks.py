"""Token checks: constraints that are a function, not a grammar.

A check says whether a candidate token may follow the text generated so far::

    def no_digits(text: str, token: str) -> bool:
        return not any(c.isdigit() for c in token)

``text`` is the request's output so far and ``token`` the candidate's text,
both decoded from UTF-8 with invalid bytes replaced (a character split over
two tokens shows as U+FFFD in each). The end-of-sequence token is never
shown to a check: where the grammar allows the output to end, it may end.

A request names a check in its grammar spec, ``{"check": "no_digits",
"sampling": "awrs"}``, alone or on top of a grammar kind. Only the AWRS
sampler (``logits_processors.awrs``) applies checks: it calls the check on
the tokens it draws, a handful per step, where a mask would call it once per
vocabulary entry.

Checks come from other packages through the entry-point group
``vllm_plugins.grammar_checks`` (name = "module:function")::

    [project.entry-points."vllm_plugins.grammar_checks"]
    no_digits = "my_package.checks:no_digits"

A check must be deterministic (the processor caches its answers within a
step) and cheap; an exception it raises fails its request only.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points

ENTRY_POINT_GROUP = "vllm_plugins.grammar_checks"

Check = Callable[[str, str], bool]


def _entry_points() -> dict[str, object]:
    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def available() -> list[str]:
    """The names of the checks installed here."""
    return sorted(_entry_points())


def check_function(name: str) -> Check:
    """The check registered as ``name``; ValueError names an unknown one or
    an entry point that is not a function."""
    ep = _entry_points().get(name)
    if ep is None:
        have = available()
        raise ValueError(f"unknown check {name!r}; installed checks: "
                         f"{', '.join(have) if have else 'none'} (entry-point group "
                         f"{ENTRY_POINT_GROUP})")
    fn = ep.load()
    if not callable(fn):
        raise ValueError(f"check {name!r} (entry point {ep.value}) is not callable")
    return fn
