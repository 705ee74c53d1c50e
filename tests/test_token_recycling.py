import numpy as np
import pytest

from vllm_plugins.proposers.token_recycling import (RecyclingTables,
                                                    TokenRecyclingProposer)
from vllm_plugins.step_context import RequestStep, StepContext

V = 50


def step(req_id, context, accepted, verified, topk_ids, topk_lp, num_prompt=3):
    return RequestStep(
        req_id=req_id, accepted=np.array(accepted), context=np.array(context),
        num_prompt_tokens=num_prompt, num_draft=len(verified) - 1,
        verified_tokens=np.array(verified),
        topk_ids=None if topk_ids is None else np.array(topk_ids),
        topk_logprobs=None if topk_lp is None else np.array(topk_lp, dtype=np.float32),
        temperature=0.0)


def proposer(**opts):
    return TokenRecyclingProposer(
        None, {"draft_length": "fixed", "topk": 2, **opts}, vocab_size=V)


def test_matrix_rows_take_the_targets_topk_at_every_verified_position():
    t = RecyclingTables(V, 2, 1, 1024)
    t.learn_rows(np.array([5, 7]), np.array([[7, 8], [9, 1]]),
                 np.log(np.array([[0.9, 0.05], [0.8, 0.1]], dtype=np.float32)))
    assert list(t.ids[5]) == [7, 8] and list(t.ids[7]) == [9, 1]
    toks, conf = t.chain([5], 5, 0.0)
    assert toks == [7, 9]  # 9 has no successors yet: the chain stops
    assert conf == pytest.approx([0.9, 0.8])


def test_chain_stops_when_estimated_acceptance_falls_low():
    t = RecyclingTables(V, 1, 1, 1024)
    t.learn_rows(np.array([1, 2, 3]), np.array([[2], [3], [4]]),
                 np.log(np.array([[0.9], [0.5], [0.9]], dtype=np.float32)))
    assert t.chain([1], 5, 0.42)[0] == [2, 3]  # 0.45 >= 0.42 > 0.405
    assert t.chain([1], 5, 0.5)[0] == [2]         # 0.45 < 0.5


def test_longer_context_overrides_the_bigram():
    t = RecyclingTables(V, 1, 3, 1024)
    t.learn_rows(np.array([2]), np.array([[10]]), np.zeros((1, 1), np.float32))
    seq = np.array([1, 2, 3])
    t.learn_context(seq, 2, 11, 0.0)  # after (1, 2) comes 11
    assert t.next_token([1, 2])[0] == 11
    assert t.next_token([4, 2])[0] == 10


def test_save_load_round_trip_and_shape_check(tmp_path):
    t = RecyclingTables(V, 2, 2, 1024)
    t.learn_rows(np.array([3]), np.array([[4, 5]]), np.zeros((1, 2), np.float32))
    t.learn_context(np.array([1, 3]), 2, 6, -0.1)
    path = str(tmp_path / "m.npz")
    t.save(path)
    u = RecyclingTables(V, 2, 2, 1024)
    u.load(path)
    assert (u.ids == t.ids).all() and (u.ctx_key == t.ctx_key).all()
    with pytest.raises(ValueError, match="topk"):
        RecyclingTables(V, 3, 2, 1024).load(path)


def test_proposer_learns_from_steps_and_drafts_per_request():
    p = proposer(context_order=1, seed_from_prompt=False)
    # Request a verified [9 (prev), 4 (draft)]; target says 9->4, 4->6.
    ctx = StepContext([
        step("a", [1, 2, 9, 4, 6], [4, 6], [9, 4], [[4, 0], [6, 0]],
             [[-0.1, -3], [-0.2, -3]]),
        step("b", [1, 2], [], [2], None, None),  # still in prefill
    ], max_draft=4)
    drafts = p.step(ctx)
    assert drafts.tokens[1] == []
    # From 6 nothing is known yet.
    assert drafts.tokens[0] == []
    ctx2 = StepContext([step("c", [5, 9], [9], [5], [[9, 0]], [[-0.1, -3]])],
                       max_draft=4)
    assert p.step(ctx2).tokens[0] == [4, 6]


def test_prompt_seeds_empty_rows():
    p = proposer(context_order=1)
    ctx = StepContext([step("a", [3, 4, 5, 3, 4, 7], [7], [4], None, None,
                            num_prompt=5)], max_draft=3)
    p.step(ctx)
    assert p.tables.ids[3, 0] == 4


def test_an_internal_error_costs_drafts_not_the_engine():
    p = proposer()
    p.tables = None  # any use now raises
    ctx = StepContext([step("a", [1, 2], [2], [1], [[2, 0]], [[0.0, -1]])],
                      max_draft=3)
    assert p.step(ctx).tokens == [[]]
    assert p.step(ctx).tokens == [[]]
    assert p.metrics()["num_errors"] == 2


def test_finished_requests_are_forgotten():
    p = proposer()
    p.step(StepContext([step("a", [1, 2], [2], [1], [[2, 0]], [[0.0, -1]])],
                       max_draft=2))
    assert "a" in p._seen
    p.step(StepContext([], finished={"a"}, max_draft=2))
    assert "a" not in p._seen
