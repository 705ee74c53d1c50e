"""Tensor-parallel ranks that draft alike.

Every tensor-parallel rank runs execute_model, the sampler and
propose_draft_token_ids; the scheduler takes the output rank's drafts and
every rank then verifies those drafts against its own draft probabilities
and its own token history. So each rank's proposer must produce the same
drafts and probabilities from the same history. The target's logits are
all-gathered (identical on every rank), proposers' draws are seeded and
their data structures deterministic; what differs between processes is the
clock. The bridge measures a step's seconds on each rank and then hands
every rank the first rank's (``first_rank_values``, one broadcast over
vLLM's tensor-parallel CPU group per step); a decision a proposer times
itself (DEL's draft forwards) reads ``vllm_plugins.clock.now``, which under
tensor parallel broadcasts the first rank's ``perf_counter`` at each read.
So draft lengths, resting and exit layers are chosen from the same seconds
on every rank, and every rank runs the same self-drafting forwards (the
same collectives). With one rank nothing changes: no collective.

What a proposer cannot promise (a source from another package that fails,
or answers differently, on one rank) the bridge checks: each step, before
the drafts go to vLLM, every rank compares a digest of each request's draft
(tokens, tree parents, probability rows) with the first rank's
(``differing_drafts``: one broadcast and one all-reduce of a number per
request). A request whose draft differs anywhere drafts nothing this step,
on every rank, so no rank verifies a tree another verifies as a chain.

``RankDigest`` is the check: an opt-in running hash of what each step hands
vLLM (drafts, draft probabilities) and what it was made from (token history,
the seconds read), read per rank through ``WorkerBase.vllm_plugins_rank_digest``.
"""

from __future__ import annotations

import hashlib
import zlib

import numpy as np
import torch

from vllm_plugins import clock


def tensor_parallel_group():
    """vLLM's tensor-parallel GroupCoordinator when it spans ranks, else None.

    vllm.distributed.parallel_state.get_tp_group() -> GroupCoordinator with
    world_size, ranks (global ranks, first is the output rank) and cpu_group
    (a gloo group).
    """
    from vllm.distributed.parallel_state import get_tp_group

    try:
        group = get_tp_group()
    except AssertionError:  # no distributed environment (a test runner)
        return None
    return group if group.world_size > 1 else None


def first_rank_clock(group):
    """A clock whose every read is the group's first rank's perf_counter.

    Each read is one collective: every rank must read it equally often, which
    holds while their decisions are equal (they read it at the same points of
    the same code).
    """
    import time

    src, cpu_group = group.ranks[0], group.cpu_group
    buf = torch.zeros(1, dtype=torch.float64)

    def now() -> float:
        buf[0] = time.perf_counter()
        torch.distributed.broadcast(buf, src=src, group=cpu_group)
        return float(buf[0])

    return now


# vLLM's tensor-parallel group when this worker is one of several ranks.
_GROUP = None


def join_tensor_parallel() -> bool:
    """Called once per worker after the model loads: under tensor parallel,
    decisions read the first rank's seconds (``clock.now`` and
    ``first_rank_values``); on one rank, this process's own."""
    global _GROUP
    _GROUP = tensor_parallel_group()
    clock.use(first_rank_clock(_GROUP) if _GROUP is not None else None)
    return _GROUP is not None


def in_tensor_parallel() -> bool:
    """Whether this worker is one of several tensor-parallel ranks."""
    return _GROUP is not None


def first_rank_values(*values: float | None) -> tuple[float | None, ...]:
    """The first rank's ``values`` on every rank: one broadcast of a small
    tensor under tensor parallel (None travels as NaN); on one rank the
    values themselves, with no work."""
    if _GROUP is None:
        return values
    buf = torch.tensor([np.nan if v is None else float(v) for v in values],
                       dtype=torch.float64)
    torch.distributed.broadcast(buf, src=_GROUP.ranks[0], group=_GROUP.cpu_group)
    return tuple(None if np.isnan(v) else float(v) for v in buf.tolist())


def draft_digest(tokens, parents, probs) -> int:
    """A number that differs, but for a crc32 collision, between two
    different drafts of one request (tokens, tree parents or None,
    probability rows or None)."""
    h = zlib.crc32(np.asarray(tokens, dtype=np.int64).tobytes())
    h = zlib.crc32(b"chain" if parents is None
                   else np.asarray(parents, dtype=np.int64).tobytes(), h)
    if probs is not None:
        h = zlib.crc32(np.ascontiguousarray(probs, dtype=np.float32).tobytes(), h)
    else:
        h = zlib.crc32(b"one-hot", h)
    return h


def differing_drafts(digests: list[int]) -> list[int]:
    """Under tensor parallel, the indices (batch order) of the requests
    whose draft digest differs from the first rank's on any rank: the same
    list on every rank. On one rank, none, with no work."""
    if _GROUP is None or not digests:
        return []
    mine = torch.tensor(digests, dtype=torch.int64)
    first = mine.clone()
    torch.distributed.broadcast(first, src=_GROUP.ranks[0], group=_GROUP.cpu_group)
    differ = (mine != first).to(torch.int64)
    torch.distributed.all_reduce(differ, op=torch.distributed.ReduceOp.MAX,
                                 group=_GROUP.cpu_group)
    return torch.nonzero(differ).flatten().tolist()


class RankDigest:
    """A hash per step of a rank's drafts, draft probabilities and history.

    Request ids are left out: they are each engine's own names, and under
    ``external_launcher`` every rank runs an engine of its own whose ids
    carry a random suffix. What ranks must agree on is what each request
    (in batch order) drafts from its history, and how many finished."""

    MAX_STEPS = 1 << 14

    def __init__(self):
        self.steps: list[str] = []

    def add(self, ctx, tokens: list[list[int]], probs) -> None:
        h = hashlib.sha256()
        for name in ("last_step_seconds", "last_propose_seconds",
                     "last_topk_seconds", "last_gap_seconds"):
            h.update(repr(getattr(ctx, name)).encode())
        h.update(repr(len(ctx.finished)).encode())
        for i, req in enumerate(ctx.requests):
            h.update(np.ascontiguousarray(req.context, dtype=np.int64).tobytes())
            h.update(np.asarray(tokens[i], dtype=np.int64).tobytes())
            p = probs[i] if probs is not None and i < len(probs) else None
            if p is not None:
                h.update(np.ascontiguousarray(
                    np.asarray(p, dtype=np.float32)[:len(tokens[i])]).tobytes())
            else:
                h.update(b"one-hot")
        if len(self.steps) < self.MAX_STEPS:
            self.steps.append(h.hexdigest())
