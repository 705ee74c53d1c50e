"""Rank-identical timing and the per-rank digest, without an engine.

The first-rank clock runs over a real two-process gloo group (what vLLM's
tensor-parallel cpu_group is), so a wrong source rank or a local read fails.
"""

import os
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_plugins import clock
from vllm_plugins.bridge.ranks import RankDigest, first_rank_clock
from vllm_plugins.step_context import RequestStep, StepContext


def test_one_rank_clock_is_perf_counter():
    assert clock.now is time.perf_counter
    fake = iter([1.0, 2.5]).__next__
    clock.use(fake)
    try:
        assert clock.now() == 1.0 and clock.now() == 2.5
    finally:
        clock.use(None)
    assert clock.now is time.perf_counter


def _clock_reads(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=2)
    group = SimpleNamespace(ranks=[0, 1], cpu_group=dist.group.WORLD)
    if rank == 0:
        time.sleep(0.2)  # rank 1 reaches its reads first
    from vllm_plugins.bridge import ranks

    now = first_rank_clock(group)
    began = time.perf_counter()
    reads = [now() for _ in range(3)]
    ranks._GROUP = group
    values = ranks.first_rank_values(float(rank), None, began)
    queue.put((rank, reads + list(values), began))
    dist.destroy_process_group()


def test_first_rank_clock_gives_every_rank_rank_zeros_reads():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_clock_reads, args=(r, port, queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict((r, (reads, began)) for r, reads, began in
               (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=60)
    assert got[0][0] == got[1][0]
    reads, (first, none, began) = got[1][0][:3], got[1][0][3:]
    assert reads == sorted(reads) and (first, none, began) == (0.0, None, got[0][1])
    # Rank 0's reads (perf_counter is one system-wide monotonic clock):
    # none from before rank 0 began, as rank 1's own first read would be.
    assert got[1][1] < got[0][1] <= got[1][0][0]


def _ctx(history, seconds=0.01, req_id="r0"):
    req = RequestStep(req_id=req_id, accepted=np.array([history[-1]]),
                      context=np.array(history), num_prompt_tokens=2,
                      num_draft=0, verified_tokens=np.array([history[-2]]),
                      topk_ids=None, topk_logprobs=None, temperature=1.0)
    return StepContext(requests=[req], last_step_seconds=seconds)


def test_digest_tells_drafts_probabilities_history_and_seconds_apart():
    probs = [np.full((2, 4), 0.25, dtype=np.float32)]

    def digest(ctx, toks=((1, 2),), p=probs):
        d = RankDigest()
        d.add(ctx, [list(t) for t in toks], p)
        return d.steps[0]

    same = digest(_ctx([5, 6, 7]))
    assert same == digest(_ctx([5, 6, 7]))
    # Engines name requests their own way (under external_launcher each
    # rank's engine adds a random suffix): ids are not what ranks agree on.
    assert same == digest(_ctx([5, 6, 7], req_id="r0-1f2e3d4c"))
    other_p = [np.array([[0.25] * 4, [0.5, 0.5, 0, 0]], dtype=np.float32)]
    for changed in (digest(_ctx([5, 6, 8])), digest(_ctx([5, 6, 7]), toks=((1, 3),)),
                    digest(_ctx([5, 6, 7]), p=other_p), digest(_ctx([5, 6, 7]), p=None),
                    digest(_ctx([5, 6, 7], seconds=0.02))):
        assert changed != same


def test_self_drafting_uses_the_full_head_when_the_head_is_a_vocabulary_shard():
    from vllm_plugins.proposers.layer_skip.base import DraftVocab

    torch.manual_seed(0)
    full_head = torch.nn.Linear(8, 32, bias=False)
    shard = torch.nn.Linear(8, 16, bias=False)  # this rank's half of the vocabulary
    shard.tp_size = 2
    target = SimpleNamespace(
        model=SimpleNamespace(logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
                              lm_head=shard),
        logits=lambda h: h @ full_head.weight.T)  # compute_logits: all-gathered
    vocab = DraftVocab(32, 5)
    vocab.observe(np.array([3, 20, 20, 31, 31, 31]))  # ids past the shard
    hidden = torch.randn(2, 8)
    with torch.no_grad():
        out, ids = vocab.logits(target, hidden)
    assert ids is None and torch.equal(out, target.logits(hidden))
