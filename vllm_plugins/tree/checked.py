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
``[0, vocab_size)``, at most ``num_speculative_tokens`` of them (vLLM
schedules no more); ``parents[i]``, when given, has one entry per token,
each ``-1`` (the root) or an earlier node's index (``parents[i][k] < k``);
``probs[i]``, when given, has one row per token over the vocabulary, each
a distribution (finite, non-negative, summing to 1) that gives its drafted
token a positive probability: vLLM's rejection sampler divides by it, and a
row that is not a distribution would make the sampled output another's.
"""

from __future__ import annotations

import numbers

import numpy as np

from vllm_plugins.step_context import Drafts


# How far a probability row's sum may be from 1 (float32 rows of a large
# vocabulary sum to 1 within about 1e-5).
ROW_SUM_TOLERANCE = 1e-3

_PLAIN_INT = frozenset({int})


def draft_problem(tokens, parents, vocab_size: int | None, probs=None,
                  max_draft: int | None = None) -> str | None:
    """Why one request's draft breaks the layout, or None."""
    if probs is None and _well_formed_lists(tokens, parents, vocab_size, max_draft):
        return None
    ids = _integers(tokens)
    if ids is None:
        return f"its tokens are not all integer token ids ({_first_odd(tokens)})"
    if max_draft is not None and len(ids) > max_draft:
        return (f"{len(ids)} tokens, more than num_speculative_tokens "
                f"({max_draft})")
    if len(ids) and (ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size)):
        k = int(np.flatnonzero((ids < 0) | (ids >= (vocab_size or np.inf)))[0])
        return f"token {k} is {int(ids[k])}, outside the vocabulary [0, {vocab_size})"
    if probs is not None:
        why = rows_problem(probs, ids, vocab_size)
        if why is not None:
            return why
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


def _well_formed_lists(tokens, parents, vocab_size: int | None,
                       max_draft: int | None) -> bool:
    """Whether a draft of plain-int lists (what proposers hand over) keeps
    the layout, by Python's builtins, which run over a short list in C:
    every step checks every request's draft, and the arrays and reductions
    of the full check cost tens of microseconds after a forward. False
    where anything is off or not plain: the full check then names it."""
    if type(tokens) is not list or not _plain_ints(tokens):
        return False
    n = len(tokens)
    if max_draft is not None and n > max_draft:
        return False
    if n and (min(tokens) < 0 or max(tokens) >= (2**63 if vocab_size is None else vocab_size)):
        return False
    if parents is None:
        return True
    if type(parents) is not list or len(parents) != n or not _plain_ints(parents):
        return False
    # parents[k] in [-1, k): the root or an earlier node.
    return not n or (min(parents) >= -1 and all(map(int.__lt__, parents, range(n))))


def _plain_ints(values) -> bool:
    """Whether every entry is a plain ``int`` (not a bool, not a numpy
    integer): what proposers hand over, told apart by the entries' types in
    one C pass, where a check against ``numbers.Integral`` costs about a
    third of a microsecond an entry, every step, for every request."""
    return set(map(type, values)) <= _PLAIN_INT


def rows_problem(probs, ids: np.ndarray, vocab_size: int | None) -> str | None:
    """Why a request's probability rows are not one distribution per
    drafted token, or None."""
    p = np.asarray(probs)
    want = (len(ids), vocab_size if vocab_size is not None else
            (p.shape[1] if p.ndim == 2 else -1))
    if p.shape != want:
        return (f"probability rows of shape {p.shape} for {len(ids)} tokens "
                f"(one row per token over the vocabulary: {want})")
    if p.dtype.kind != "f":
        return f"probability rows of dtype {p.dtype}, not floating point"
    if not len(ids):
        return None
    sums = p.sum(axis=1, dtype=np.float64)
    bad = np.flatnonzero(~(np.abs(sums - 1.0) <= ROW_SUM_TOLERANCE))
    if len(bad):
        k = int(bad[0])
        return f"probability row {k} sums to {float(sums[k])!r}, not 1"
    if p.min() < 0:
        return "a probability row holds a negative entry"
    drawn = p[np.arange(len(ids)), ids]
    if not (drawn > 0).all():
        k = int(np.flatnonzero(~(drawn > 0))[0])
        return (f"token {k} ({int(ids[k])}) has probability {float(drawn[k])!r} in its "
                "own row: a drafted token must be one its row can draw")
    return None


def _integers(values) -> np.ndarray | None:
    """``values`` as a 1-D int64 array, or None if any is not an integer."""
    if isinstance(values, np.ndarray):
        return values.astype(np.int64) if values.ndim == 1 and values.dtype.kind in "iu" \
            else None
    values = list(values)
    if not _plain_ints(values) and not all(
            isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in values):
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


def drop_malformed(drafts: Drafts, req_ids, vocab_size: int | None,
                   max_draft: int | None = None) -> tuple[Drafts, list[tuple[str, str]]]:
    """``drafts`` with every malformed request's draft emptied, and
    (request id, problem) for each. A step whose drafts do not give one row
    per request (tokens, parents or probability rows) drafts nothing."""
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
    probs_all = drafts.probs
    if probs_all is not None and len(probs_all) != n:
        return (Drafts([[] for _ in range(n)]),
                [(r, f"{len(probs_all)} probability row sets for {n} requests")
                 for r in req_ids])
    bad = []
    for i, req_id in enumerate(req_ids):
        parents = parents_all[i] if parents_all is not None else None
        probs = probs_all[i] if probs_all is not None else None
        try:
            why = draft_problem(tokens[i], parents, vocab_size, probs, max_draft)
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
        if probs is not None:
            probs[i] = None
        if confidence is not None and i < len(confidence):
            confidence[i] = None
        if parents_all is not None:
            parents_all[i] = None
    return (Drafts(tokens, probs, confidence, parents_all),
            [(req_id, why) for _, req_id, why in bad])
