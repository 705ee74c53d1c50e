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

_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _all(holder: Any) -> Iterable:
    return holder.all


def of_kind(holder: Any, kind: type, members: Callable[[Any], Iterable] = _all) -> tuple:
    """The processors ``members(holder)`` lists (default: a V1
    ``LogitsProcessors``' ``all``) that are ``kind``, in their order."""
    try:
        found = _FOUND.get(holder)
        if found is None:
            found = _FOUND[holder] = {}
    except TypeError:
        found = {}
    hit = found.get(kind)
    if hit is None:
        hit = found[kind] = tuple(p for p in members(holder) if isinstance(p, kind))
    return hit


@functools.cache
def grammar_class() -> type:
    """Our grammar processor's class, imported at first use: the bridge
    loads in every vLLM process, the grammar machinery only where asked."""
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    return GrammarLogitsProcessor


def grammar_processors(logitsprocs: Any) -> tuple:
    """Our grammar processors in a V1 ``LogitsProcessors``."""
    return of_kind(logitsprocs, grammar_class())
