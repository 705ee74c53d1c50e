"""Our logits processors among a runner's, looked up once per set.

vLLM builds a runner's logits processors once (V1: its input batch's
``LogitsProcessors``; V2: its sampler's list) and keeps that set, while
several of the bridge's hooks look for ours in it every step. The answer is
kept per holder of the set, weakly: a new input batch is a new holder, and
a holder that goes takes its entry along. A holder that cannot be weakly
referenced (a test's stand-in) is looked up each time.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Callable, Iterable

# (id of a holder, kind) -> (a weak reference to the holder, its processors of
# that kind). A plain dict read and one call of the reference: a
# WeakKeyDictionary's get builds a reference and runs Python code per call.
_FOUND: dict[tuple[int, type], tuple[weakref.ref, tuple]] = {}


def _all(holder: Any) -> Iterable:
    return holder.all


def of_kind(holder: Any, kind: type, members: Callable[[Any], Iterable] = _all) -> tuple:
    """The processors ``members(holder)`` lists (default: a V1
    ``LogitsProcessors``' ``all``) that are ``kind``, in their order."""
    key = (id(holder), kind)
    hit = _FOUND.get(key)
    if hit is not None and hit[0]() is holder:
        return hit[1]
    found = tuple(p for p in members(holder) if isinstance(p, kind))
    try:
        ref = weakref.ref(holder, functools.partial(_forget, key))
    except TypeError:
        return found
    _FOUND[key] = (ref, found)
    return found


def _forget(key: tuple[int, type], ref: weakref.ref) -> None:
    """A holder went: its entry goes, unless a new holder took its id first."""
    hit = _FOUND.get(key)
    if hit is not None and hit[0] is ref:
        del _FOUND[key]


@functools.cache
def grammar_class() -> type:
    """Our grammar processor's class, imported at first use: the bridge
    loads in every vLLM process, the grammar machinery only where asked."""
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    return GrammarLogitsProcessor


def grammar_processors(logitsprocs: Any) -> tuple:
    """Our grammar processors in a V1 ``LogitsProcessors``."""
    return of_kind(logitsprocs, grammar_class())
