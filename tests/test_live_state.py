"""The leak check's counts (``vllm_plugins.bridge.live_state``) on our real
proposer and runner state, without an engine: rounds of the same requests
leave them where they were, and a leak of one entry or one object per
request moves them by the number of requests.
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.bridge.live_state import live_counts
from vllm_plugins.bridge.state import RunnerState
from vllm_plugins.step_context import RequestStep, StepContext

VOCAB = 64
REQUESTS = 30


def request(req_id: str, step: int, rng) -> RequestStep:
    context = rng.integers(0, VOCAB, size=8 + step).astype(np.int64)
    return RequestStep(
        req_id=req_id, accepted=context[-1:], context=context, num_prompt_tokens=8,
        num_draft=0, verified_tokens=context[-1:], topk_ids=None, topk_logprobs=None,
        temperature=0.0, group_id=req_id)


def run_round(proposer, round_no: int, rng) -> None:
    """REQUESTS requests through a few steps, then their finish notices."""
    ids = [f"cmpl-{round_no}-{i}" for i in range(REQUESTS)]
    for step in range(3):
        proposer.step(StepContext(requests=[request(r, step, rng) for r in ids],
                                  max_draft=proposer.max_draft))
    proposer.step(StepContext(requests=[], finished=set(ids),
                              max_draft=proposer.max_draft))


def token_recycling():
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    return TokenRecyclingProposer(options={"context_slots": 1024}, vocab_size=VOCAB)


def counts_after_rounds(proposer, rounds=3):
    state = RunnerState(proposer=proposer)
    rng = np.random.default_rng(0)
    out = []
    for round_no in range(rounds):
        run_round(proposer, round_no, rng)
        out.append(live_counts(state, ()))
    return out


def test_rounds_of_requests_leave_our_state_where_it_was():
    counts = counts_after_rounds(token_recycling())
    assert counts[1]["request_keyed"] == counts[2]["request_keyed"], counts
    assert counts[1]["objects"] == counts[2]["objects"], counts


@pytest.mark.parametrize("leak", ["entry", "object"])
def test_a_leak_of_one_per_request_shows(leak):
    from vllm_plugins.step_context import Drafts

    proposer = token_recycling()
    kept: dict = {}
    proposer.leaked = kept
    original = proposer.free

    def free_but_keep(req_id):
        original(req_id)
        kept[req_id] = Drafts([[1]]) if leak == "object" else 1

    proposer.free = free_but_keep
    counts = counts_after_rounds(proposer)
    if leak == "entry":
        assert counts[2]["request_keyed"] - counts[1]["request_keyed"] == REQUESTS
    assert counts[2]["objects"] - counts[1]["objects"] == (
        REQUESTS if leak == "object" else 0)


def test_live_requests_and_held_finish_notices_are_not_counted():
    state = RunnerState(proposer=token_recycling())
    base = live_counts(state, ())["request_keyed"]
    state.trees["r1"] = object()
    state.finished.add("r2")
    assert live_counts(state, ())["request_keyed"] == base + 1
    assert live_counts(state, ("r1",))["request_keyed"] == base
