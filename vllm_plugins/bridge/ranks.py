"""Tensor-parallel ranks that draft alike.

Every tensor-parallel rank runs execute_model, the sampler and
propose_draft_token_ids; the scheduler takes the output rank's drafts and
every rank then verifies those drafts against its own draft probabilities
and its own token history. So each rank's proposer must produce the same
drafts and probabilities from the same history. The target's logits are
all-gathered (identical on every rank), proposers' draws are seeded and
their data structures deterministic; what differs between processes is the
clock. ``share_first_rank_clock`` points ``vllm_plugins.clock.now`` at a
reader that broadcasts the first rank's ``perf_counter`` over vLLM's
tensor-parallel CPU group, so each timed decision (draft lengths, resting,
DEL's exit layer) is made from the same seconds on every rank, and every
rank runs the same self-drafting forwards (the same collectives). With one
rank nothing changes.

``RankDigest`` is the check: an opt-in running hash of what each step hands
vLLM (drafts, draft probabilities) and what it was made from (token history,
the seconds read), read per rank through ``WorkerBase.vllm_plugins_rank_digest``.
"""

from __future__ import annotations

import hashlib

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


def share_first_rank_clock() -> bool:
    """Under tensor parallel, every rank reads the first rank's clock."""
    group = tensor_parallel_group()
    clock.use(first_rank_clock(group) if group is not None else None)
    return group is not None


class RankDigest:
    """A hash per step of a rank's drafts, draft probabilities and history."""

    MAX_STEPS = 1 << 14

    def __init__(self):
        self.steps: list[str] = []

    def add(self, ctx, tokens: list[list[int]], probs) -> None:
        h = hashlib.sha256()
        for name in ("last_step_seconds", "last_propose_seconds",
                     "last_topk_seconds", "last_gap_seconds"):
            h.update(repr(getattr(ctx, name)).encode())
        h.update(repr(sorted(ctx.finished)).encode())
        for i, req in enumerate(ctx.requests):
            h.update(req.req_id.encode())
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
