import math

import numpy as np
import pytest

from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
from vllm_plugins.proposers.token_recycling_tables import (RecyclingTables, context_hash,
                                                           context_hashes)
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


def test_context_hashes_match_the_scalar_hash():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 49152, 400)
    ends = rng.integers(8, 400, 300)
    orders = rng.integers(1, 9, 300)
    want = [context_hash(seq[e - n:e], int(n)) for e, n in zip(ends, orders)]
    assert context_hashes(seq, ends, orders).astype(np.int64).tolist() == want


def _learn_one_by_one(t, seq, ends, toks, logps, only_if_empty):
    """Reference: what learn_contexts does, one end and one order at a time."""
    for end, tok, lp in zip(ends, toks, logps):
        for n in range(2, t.context_order + 1):
            if end < n:
                break
            h = context_hash(seq[end - n:end], n)
            slot = h % t.slots
            if only_if_empty and t.ctx_key[slot] == h:
                continue
            t.ctx_key[slot], t.ctx_tok[slot], t.ctx_logp[slot] = h, tok, lp


@pytest.mark.parametrize("only_if_empty,slots", [(False, 1024), (True, 65521)])
def test_learn_contexts_matches_learning_one_end_at_a_time(only_if_empty, slots):
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 6, 300)          # few symbols: contexts repeat
    ends = np.arange(0, 300)
    toks = rng.integers(0, V, 300)
    logps = np.log(rng.random(300)).astype(np.float32)
    got, want = RecyclingTables(V, 1, 4, slots), RecyclingTables(V, 1, 4, slots)
    for t in (got, want):                  # an entry already there
        t.learn_context(seq, 10, 7, -0.5)
    got.learn_contexts(seq, ends, toks, logps, only_if_empty=only_if_empty)
    _learn_one_by_one(want, seq, ends, toks, logps, only_if_empty)
    if only_if_empty:
        # Seeding keeps each context's first occurrence; where two distinct
        # contexts share a slot the one-by-one order may differ, so this
        # case is checked where they do not.
        keys = {context_hash(seq[e - n:e], n) for e in ends for n in range(2, 5) if e >= n}
        assert len({k % slots for k in keys}) == len(keys)
    assert (got.ctx_key == want.ctx_key).all()
    assert (got.ctx_tok == want.ctx_tok).all()
    assert (got.ctx_logp == want.ctx_logp).all()


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


def _plain_chain(t, tail, length, min_confidence):
    """The walk as the plain Python loop was: the longest context with an
    entry, else the matrix; stop on an unknown successor or when the running
    product of stored probabilities falls below min_confidence."""
    seq, out, conf, running = [int(x) for x in tail], [], [], 1.0
    for _ in range(length):
        for n in range(min(t.context_order, len(seq)), 1, -1):
            h = context_hash(seq[-n:], n)
            if t.ctx_key[h % t.slots] == h:
                tok, lp = int(t.ctx_tok[h % t.slots]), float(t.ctx_logp[h % t.slots])
                break
        else:
            tok, lp = int(t.ids[seq[-1], 0]), float(t.logp[seq[-1], 0])
        if tok < 0:
            break
        running *= math.exp(lp)
        if running < min_confidence:
            break
        out.append(tok)
        conf.append(math.exp(lp))
        seq.append(tok)
    return out, conf


def _random_tables(rng, order, slots=1024):
    t = RecyclingTables(V, 2, order, slots)
    known = rng.random(V) < 0.8  # some tokens have no successor yet
    rows = np.flatnonzero(known)
    t.learn_rows(rows, rng.integers(0, V, (len(rows), 2)),
                 np.log(rng.uniform(0.2, 1.0, (len(rows), 2))).astype(np.float32))
    seq = rng.integers(0, 8, 600)  # few symbols: contexts repeat, slots collide
    t.learn_contexts(seq, np.arange(600), rng.integers(0, 8, 600),
                     np.log(rng.uniform(0.3, 1.0, 600)).astype(np.float32))
    return t


@pytest.mark.parametrize("order", [1, 2, 3, 5])
def test_walk_matches_the_plain_loop(order):
    rng = np.random.default_rng(order)
    t = _random_tables(rng, order)
    n, width = 300, max(order, 1)
    tail_lens = rng.integers(1, width + 1, n)
    tails = np.zeros((n, width), np.int64)
    for i, m in enumerate(tail_lens):
        tails[i, :m] = rng.integers(0, 8, m)
    lengths = rng.integers(0, 9, n)
    out_tok, out_conf = np.zeros((n, 8), np.int64), np.zeros((n, 8))
    out_len = np.zeros(n, np.int64)
    for min_conf in (0.0, 0.02, 0.3):
        t.walk(tails, tail_lens, lengths, min_conf, out_tok, out_conf, out_len)
        drafted = 0
        for i in range(n):
            want = _plain_chain(t, tails[i, :tail_lens[i]], lengths[i], min_conf)
            m = out_len[i]
            assert (out_tok[i, :m].tolist(), out_conf[i, :m].tolist()) == want
            assert t.chain(tails[i, :tail_lens[i]], lengths[i], min_conf) == want
            drafted += m
        assert drafted > n // 2  # the walks are not all empty


def test_drafts_are_the_plain_walk_of_each_request_as_batches_change():
    p = proposer(context_order=3)
    rng = np.random.default_rng(5)
    p.tables = _random_tables(rng, 3, slots=1 << 16)
    for size in (3, 16, 1, 7):  # the walk's buffers grow and are reused
        reqs = []
        for j in range(size):
            ctx = rng.integers(0, 8, int(rng.integers(4, 20)))
            reqs.append(step(f"r{size}-{j}", ctx, ctx[-1:], ctx[-2:-1], None, None))
        reqs.append(step("prefill", [1, 2], [], [1], None, None))
        drafts = p.step(StepContext(reqs, max_draft=6))
        assert drafts.tokens[-1] == []
        for r, tok, conf in zip(reqs[:-1], drafts.tokens, drafts.confidence):
            want_tok, want_conf = _plain_chain(p.tables, r.context[-3:], 6, 0.02)
            assert tok == want_tok
            assert conf.dtype == np.float32 and conf.tolist() == np.float32(want_conf).tolist()


def test_continue_draft_walks_from_the_prefix_and_reads_only():
    p = proposer(context_order=3)
    p.tables = _random_tables(np.random.default_rng(6), 3, slots=1 << 16)
    r = step("a", [1, 2, 3, 4], [4], [3], None, None)
    before = [a.copy() for a in (p.tables.ids, p.tables.ctx_key, p.tables.ctx_tok)]
    for prefix in ([], [5], [5, 6], [5, 6, 7, 1]):
        got = p.continue_draft(r, prefix, 5)
        want = _plain_chain(p.tables, ([1, 2, 3, 4] + prefix)[-3:], 5, 0.02)[0]
        assert got.dtype == np.int64 and got.tolist() == want
    assert p.continue_draft(r, [5], 0).tolist() == []
    after = (p.tables.ids, p.tables.ctx_key, p.tables.ctx_tok)
    assert all((a == b).all() for a, b in zip(before, after))


@pytest.mark.parametrize("context_dtype", [np.int32, np.int64])
def test_learning_chains_one_by_one_writes_what_the_batched_arrays_write(context_dtype):
    """A few requests' chains are learnt one compiled call each, more in one
    batched pass: over random steps (requests sharing tokens, so later rows
    overwrite earlier ones) both leave the same tables."""
    rng = np.random.default_rng(3)
    one, batched = proposer(context_order=4, context_slots=1024), \
        proposer(context_order=4, context_slots=1024)
    batched._LEARN_ONE_BY_ONE = 0
    for _ in range(30):
        reqs = []
        for b in range(int(rng.integers(1, 6))):
            n_ctx, rows = int(rng.integers(1, 12)), int(rng.integers(1, 6))
            context = rng.integers(0, 6, n_ctx + rows).astype(context_dtype)
            accepted = context[n_ctx:]
            verified = np.concatenate([context[n_ctx - 1:n_ctx], rng.integers(0, 6, rows - 1)])
            reqs.append(RequestStep(
                req_id=f"r{b}", accepted=accepted, context=context, num_prompt_tokens=1,
                num_draft=rows - 1, verified_tokens=verified.astype(np.int64),
                topk_ids=rng.integers(0, V, (rows, 2)),
                topk_logprobs=np.log(rng.random((rows, 2))).astype(np.float32),
                temperature=0.0))
        for p in (one, batched):
            p.learn(StepContext(reqs, max_draft=4))
    for name in ("ids", "logp", "ctx_key", "ctx_tok", "ctx_logp"):
        assert (getattr(one.tables, name) == getattr(batched.tables, name)).all(), name
