"""Drafts checked where they enter the bridge, before vLLM sees them.

A proposer, ours or another package's, hands the bridge one token list per
request and, for a tree, one parent list. vLLM trusts what it gets: a token
id outside the vocabulary reaches the embedding lookup and a parent list
that does not describe the tokens reaches the tree step's masks, and either
fails inside a step, which kills the engine and every request in it. So a
draft that breaks the layout costs that request its draft (it is verified as
no draft at all: plain decoding for one step) and nothing else; the bridge
logs the first problem of each proposer and counts every one
(``StepCounters.malformed_drafts``).

The layout (``vllm_plugins.step_context.Drafts``): ``tokens[i]`` are ids in
``[0, vocab_size)``; ``parents[i]``, when given, has one entry per token,
each ``-1`` (the root) or an earlier node's index (``parents[i][k] < k``).
"""

from __future__ import annotations

import numbers

import numpy as np

from vllm_plugins.step_context import Drafts


def draft_problem(tokens, parents, vocab_size: int | None) -> str | None:
    """Why one request's draft breaks the layout, or None."""
    ids = _integers(tokens)
    if ids is None:
        return f"its tokens are not all integer token ids ({_first_odd(tokens)})"
    if len(ids) and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        k = int(np.flatnonzero((ids < 0) | (ids >= (vocab_size or np.inf)))[0])
        return f"token {k} is {int(ids[k])}, outside the vocabulary [0, {vocab_size})"
    if parents is None:
        return None
    if len(parents) != len(ids):
        return (f"{len(parents)} parents for {len(ids)} tokens "
                "(a tree needs one parent per node)")
    up = _integers(parents)
    if up is None:
        return f"its parents are not all integer node indices ({_first_odd(parents)})"
    wrong = np.flatnonzero((up < -1) | (up >= np.arange(len(up))))
    if len(wrong):
        k = int(wrong[0])
        return (f"node {k} has parent {int(up[k])}: a parent is -1 (the root) "
                "or an earlier node (parents[i] < i)")
    return None


def _integers(values) -> np.ndarray | None:
    """``values`` as a 1-D int64 array, or None if any is not an integer."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64) if values.ndim == 1 and values.dtype.kind in "iu" \
            else None
    values = list(values)
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
        return None
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError:
        return None


def _first_odd(values) -> str:
    for k, v in enumerate(values):
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or abs(v) >= 2**63:
            return f"item {k} is {v!r}"
    return f"an array of {np.asarray(values).dtype}"


def drop_malformed(drafts: Drafts, req_ids, vocab_size: int | None
                   ) -> tuple[Drafts, list[tuple[str, str]]]:
    """``drafts`` with every malformed request's draft emptied, and
    (request id, problem) for each. A step whose drafts do not give one row
    per request drafts nothing."""
    n = len(req_ids)
    tokens = drafts.tokens
    if tokens is None or len(tokens) != n:
        got = "no rows" if tokens is None else f"{len(tokens)} rows"
        return (Drafts([[] for _ in range(n)]),
                [(r, f"{got} of drafts for {n} requests") for r in req_ids])
    parents_all = drafts.parents
    if parents_all is not None and len(parents_all) != n:
        return (Drafts([[] for _ in range(n)]),
                [(r, f"{len(parents_all)} parent lists for {n} requests")
                 for r in req_ids])
    bad = []
    for i, req_id in enumerate(req_ids):
        parents = parents_all[i] if parents_all is not None else None
        try:
            why = draft_problem(tokens[i], parents, vocab_size)
        except (TypeError, ValueError, OverflowError) as e:  # not a list of small ints
            why = f"its draft is not a list of token ids ({e})"
        if why is not None:
            bad.append((i, req_id, why))
    if not bad:
        return drafts, []
    tokens = list(tokens)
    probs = None if drafts.probs is None else list(drafts.probs)
    confidence = None if drafts.confidence is None else list(drafts.confidence)
    parents_all = None if parents_all is None else list(parents_all)
    for i, _, _ in bad:
        tokens[i] = []
        if probs is not None and i < len(probs):
            probs[i] = None
        if confidence is not None and i < len(confidence):
            confidence[i] = None
        if parents_all is not None:
            parents_all[i] = None
    return (Drafts(tokens, probs, confidence, parents_all),
            [(req_id, why) for _, req_id, why in bad])
