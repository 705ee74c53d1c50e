"""STAND: store, drafting, probability rows, and exactness against a numpy
model of vLLM's rejection sampler (fast; no engine)."""

import os
from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest

from vllm_plugins.proposers import stand_debug
from vllm_plugins.proposers.stand import StandProposer, draft_distribution
from vllm_plugins.step_context import RequestStep, StepContext

V = 12


def pearson(observed, expected_probs) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of one multinomial, cells with
    expected < 5 pooled (a pooled cell expecting nothing that saw something
    gives an infinite statistic)."""
    observed = np.asarray(observed, dtype=np.float64)
    exp = np.asarray(expected_probs, dtype=np.float64) * observed.sum()
    obs_c, exp_c = [], []
    acc_o = acc_e = 0.0
    for i in np.argsort(exp):
        acc_o += observed[i]
        acc_e += exp[i]
        if acc_e >= 5:
            obs_c.append(acc_o)
            exp_c.append(acc_e)
            acc_o = acc_e = 0.0
    if not exp_c:
        return 0.0, 0
    if acc_e > 0:
        obs_c[-1] += acc_o
        exp_c[-1] += acc_e
    obs_c, exp_c = np.array(obs_c), np.array(exp_c)
    if np.any((exp_c == 0) & (obs_c > 0)):
        return float("inf"), len(exp_c) - 1
    return float(((obs_c - exp_c) ** 2 / np.maximum(exp_c, 1e-300)).sum()), len(exp_c) - 1


def chi2_pvalue(observed, expected_probs) -> float:
    """Pearson chi-square p-value (cells with expected < 5 pooled)."""
    import torch

    stat, df = pearson(observed, expected_probs)
    if df <= 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def req(req_id, context, accepted, verified=None, topk=None, temperature=0.0,
        num_prompt=None, group_id="", seed=None, top_k=0, top_p=1.0,
        extra_args=None):
    context = np.asarray(context, dtype=np.int64)
    verified = np.asarray(verified if verified is not None
                          else ([context[len(context) - len(accepted) - 1]]
                                if len(accepted) else []), dtype=np.int64)
    ids = lps = None
    if topk is not None:
        width = max(len(row) for row in topk)  # ragged rows: pad with p = 0
        topk = [list(row) + [(0, 0.0)] * (width - len(row)) for row in topk]
        ids = np.array([[t for t, _ in row] for row in topk], dtype=np.int64)
        with np.errstate(divide="ignore"):
            lps = np.log(np.array([[p for _, p in row] for row in topk],
                                  dtype=np.float32))
    params = SimpleNamespace(seed=seed, top_k=top_k, top_p=top_p, n=1,
                             extra_args=extra_args)
    return RequestStep(
        req_id=req_id, accepted=np.asarray(accepted, dtype=np.int64), context=context,
        num_prompt_tokens=num_prompt if num_prompt is not None else len(context) - len(accepted),
        num_draft=max(len(verified) - 1, 0), verified_tokens=verified,
        topk_ids=ids, topk_logprobs=lps, temperature=temperature,
        sampling_params=params, group_id=group_id)


def proposer(**opts):
    # calibrate=False: confidences are the raw stored path probabilities.
    base = {"draft_length": "fixed", "topk": 4, "max_order": 2, "calibrate": False}
    return StandProposer(None, {**base, **opts}, vocab_size=V)


# ------------------------------------------------------------ distributions
def test_draft_distribution_is_the_tempered_stored_distribution():
    p = np.array([0.5, 0.3, 0.1], dtype=np.float32)
    q, c = draft_distribution(p, 1.0)
    assert q.dtype == np.float32 and q.sum() == pytest.approx(1.0, abs=1e-6)
    assert q == pytest.approx(p / p.sum(), rel=1e-5)
    assert c == pytest.approx(0.9, rel=1e-5)
    q, _ = draft_distribution(p, 0.5)
    assert q == pytest.approx(p ** 2 / (p ** 2).sum(), rel=1e-5)
    q, _ = draft_distribution(p, 1.0, top_k=2)
    assert len(q) == 2 and q == pytest.approx([0.625, 0.375], rel=1e-5)
    q, _ = draft_distribution(p, 1.0, top_p=0.5)
    assert len(q) == 1 and q[0] == 1.0
    # A very low temperature does not underflow the top token.
    q, _ = draft_distribution(p, 1e-4)
    assert q[0] == pytest.approx(1.0) and np.isfinite(q).all()
    # Lower temperature: the unknown tail weighs less, coverage rises.
    assert draft_distribution(p, 0.5)[1] > draft_distribution(p, 1.0)[1]


# ------------------------------------------------------------------ proposer
def test_bad_option_names_it():
    with pytest.raises(ValueError, match="min_path_prob"):
        proposer(min_path_prob=2)
    with pytest.raises(ValueError, match="share"):
        proposer(share="everyone")


def greedy_history(p):
    """Prompt [1, 2, 3]; the target verified [3 -> 4 (0.9)] and [4 -> 5 (0.8)]."""
    ctx = StepContext([req("a", [1, 2, 3, 4, 5], [4, 5], verified=[3, 4],
                           topk=[[(4, 0.9), (6, 0.05)], [(5, 0.8), (7, 0.1)]],
                           num_prompt=3)], max_draft=4)
    return p.step(ctx)


def test_greedy_drafts_the_most_probable_path_without_probs():
    p = proposer(min_path_prob=0.01)
    greedy_history(p)
    # A new request of another prompt that ends in 3: its own prompt seeds only.
    ctx = StepContext([req("b", [9, 3, 4], [4], verified=[3], topk=[[(4, 0.9)]],
                           num_prompt=2)], max_draft=4)
    d = p.step(ctx)
    assert d.tokens[0] == []  # different prompt: a different store
    # Same prompt as "a": shared store; after ...3, 4 comes 5 (0.8), then 5 -> ?
    ctx = StepContext([req("c", [1, 2, 3, 4], [4], verified=[3], topk=[[(4, 0.9)]],
                           num_prompt=3)], max_draft=4)
    d = p.step(ctx)
    assert d.tokens[0][:1] == [5]
    assert d.probs is None
    assert d.confidence[0][0] == pytest.approx(0.8, rel=1e-5)


def test_path_stops_under_min_path_prob():
    p = proposer(min_path_prob=0.5, max_order=1, share="request")
    ctx = StepContext([req("a", [1, 2, 3, 4, 5], [4, 5], verified=[3, 4],
                           topk=[[(4, 0.9)], [(5, 0.6)]], num_prompt=3)], max_draft=4)
    p.step(ctx)
    # From 3: 4 (0.9), then 5 (0.9 * 0.6 = 0.54), then 5 -> nothing.
    ctx = StepContext([req("a", [1, 2, 3, 4, 5, 6, 3], [6, 3], verified=[5, 6],
                           topk=[[(6, 0.99)], [(3, 0.99)]], num_prompt=3)],
                      max_draft=6)
    d = p.step(ctx)
    # 3 -> 4 (0.9), 4 -> 5 (0.54), 5 -> 6 (0.535), 6 -> 3 (0.53), 3 -> 4 (0.477 < 0.5)
    assert d.tokens[0] == [4, 5, 6, 3]


def sampled_setup(temperature=1.0, **opts):
    p = proposer(min_path_prob=0.0, max_order=1, share="request", **opts)
    # Context token 3 -> {4: 0.5, 6: 0.3, 7: 0.1}; 4 -> {5: 0.6, 8: 0.2}.
    ctx = StepContext([req("a", [1, 2, 3, 4, 5], [4, 5], verified=[3, 4],
                           topk=[[(4, 0.5), (6, 0.3), (7, 0.1)],
                                 [(5, 0.6), (8, 0.2)]], num_prompt=3,
                           temperature=temperature)], max_draft=4)
    p.step(ctx)
    return p


def test_sampled_drafts_come_with_honest_probability_rows():
    p = sampled_setup()
    seen = {}
    for i in range(400):
        ctx = StepContext([req("a", [1, 2, 3], [3], verified=[2], topk=None,
                               num_prompt=2, temperature=1.0)], max_draft=2)
        # No topk: nothing new learned, the store stays fixed.
        d = p.step(ctx)
        toks, rows = d.tokens[0], d.probs[0]
        assert rows.shape == (len(toks), V) and rows.dtype == np.float32
        assert rows.sum(1) == pytest.approx(1.0, abs=1e-6)
        for j, t in enumerate(toks):
            assert rows[j, t] > 0
        assert rows[0, [4, 6, 7]] == pytest.approx(np.array([5, 3, 1]) / 9, rel=1e-5)
        seen[toks[0]] = seen.get(toks[0], 0) + 1
        if toks[0] == 4:
            assert len(toks) == 2 and rows[1, [5, 8]] == pytest.approx([0.75, 0.25])
        else:
            assert len(toks) == 1  # nothing known after 6 or 7
    pv = chi2_pvalue([seen.get(t, 0) for t in (4, 6, 7)], np.array([5, 3, 1]) / 9)
    assert pv > 1e-3


def test_rows_follow_the_request_temperature():
    p = sampled_setup()
    ctx = StepContext([req("a", [1, 2, 3], [3], verified=[2], num_prompt=2,
                           temperature=0.5)], max_draft=1)
    rows = p.step(ctx).probs[0]
    want = np.array([0.25, 0.09, 0.01])
    assert rows[0, [4, 6, 7]] == pytest.approx(want / want.sum(), rel=1e-5)


def test_mixed_batch_greedy_rows_have_no_probs():
    p = sampled_setup()
    ctx = StepContext([
        req("a", [1, 2, 3], [3], verified=[2], num_prompt=2, temperature=1.0),
        req("g", [1, 2, 3], [3], verified=[2], num_prompt=2, temperature=0.0),
        req("x", [1, 2], [], num_prompt=2),  # prefill
    ], max_draft=2)
    d = p.step(ctx)
    assert d.probs[1] is None and d.probs[2] is None and d.tokens[2] == []
    assert d.tokens[1] == []  # share="request": "g" has its own, empty store
    assert d.probs[0] is not None


def test_seeded_requests_draw_reproducibly():
    outs = []
    for _ in range(2):
        p = sampled_setup()
        ctx = StepContext([req("z", [1, 2, 3], [3], verified=[2], num_prompt=2,
                               temperature=1.0, seed=7)], max_draft=2)
        outs.append([p.step(ctx).tokens[0] for _ in range(1)])
    assert outs[0] == outs[1]


def test_samples_of_one_prompt_share_a_store_by_prompt_or_group():
    for share, shared in (("prompt", True), ("group", True), ("request", False)):
        p = proposer(share=share, min_path_prob=0.0)
        ctx = StepContext([
            req("0_x", [1, 2, 3, 4], [4], verified=[3], topk=[[(4, 0.9)]],
                num_prompt=3, group_id="x"),
            req("1_x", [1, 2, 3, 9], [9], verified=[3], topk=[[(9, 0.5)]],
                num_prompt=3, group_id="x"),
        ], max_draft=3)
        p.step(ctx)
        # Sample 1_x now learns 9 -> 4 and drafts; sample 0_x sees 1_x's data.
        ctx = StepContext([req("0_x", [1, 2, 3, 4, 2, 3], [2, 3], verified=[4, 2],
                               topk=[[(2, 0.9)], [(4, 0.6), (9, 0.4)]],
                               num_prompt=3, group_id="x")], max_draft=3)
        p.step(ctx)
        ctx = StepContext([req("1_x", [1, 2, 3, 9, 1, 2], [1, 2], verified=[9, 1],
                               topk=[[(1, 0.9)], [(3, 0.9)]],
                               num_prompt=3, group_id="x")], max_draft=3)
        d = p.step(ctx)
        # 1_x after (1, 2): its own data says 3; then after (2, 3) only 0_x's
        # observation (4: 0.6, mixed with 1_x's verified 3 -> 9 at order 1).
        assert d.tokens[0][0] == 3
        if shared:
            assert len(d.tokens[0]) >= 2 and d.tokens[0][1] == 4, share
            assert len(p.stores) == 1
        else:
            assert len(p.stores) == 2
        assert p.metrics()["stand"]["stores"] == len(p.stores)


def test_idle_stores_are_capped_live_ones_kept_and_requests_freed():
    p = proposer(max_stores=2)

    def step(i, finished=()):
        return p.step(StepContext([req(f"r{i}", [100 + i, 3, 4], [4], verified=[3],
                                       topk=[[(4, 0.9)]], num_prompt=2)],
                                  finished=set(finished), max_draft=2))

    for i in range(4):  # four live requests, four prompts: no store may go
        step(i)
    assert len(p.stores) == 4 and p.evicted_stores == 0
    assert p.metrics()["stand"]["live_stores"] == 4
    p.step(StepContext([], finished={"r0", "r1", "r2"}))
    step(4)  # r0..r2's stores are idle now: the least recently used go
    assert p.evicted_stores >= 1 and len(p.stores) <= 3
    assert all(k in p.stores for k in p._live)  # live stores never dropped
    p.step(StepContext([], finished={"r3", "r4"}))
    assert not p._req_key and not p._req_rng and not p._live


def test_entries_in_all_stores_stay_under_max_entries():
    p = proposer(max_entries=256, max_stores=8, topk=2, max_order=3)
    rng = np.random.default_rng(0)
    for i in range(120):
        toks = rng.integers(0, 50 * V, size=60) % V
        ctx = StepContext([req(f"q{j}-{i // 10}", toks + j, (toks + j)[-3:],
                               verified=(toks + j)[-4:-1],
                               topk=[[(int(a), 0.5), (int(b), 0.2)]
                                     for a, b in rng.integers(0, V, size=(3, 2))],
                               num_prompt=40) for j in range(3)],
                          finished={f"q{j}-{i // 10 - 1}" for j in range(3)}
                          if i % 10 == 0 else set(), max_draft=3)
        p.step(ctx)
        m = p.metrics()["stand"]
        assert m["entries"] <= 256, (i, m)
    assert p.num_errors == 0
    assert m["evicted_entries"] > 0 or m["evicted_stores"] > 0
    # Stated bound: 8 * topk + 40 B a slot, up to 2 slots an entry by
    # doubling, plus each live store's first allocation.
    assert m["bytes"] <= 256 * 2 * (8 * 2 + 40) + 3 * 256 * (8 * 2 + 40)


def test_internal_error_costs_drafts_not_the_engine():
    p = proposer()
    bad = req("a", [1, 2, 3], [3], verified=[2], num_prompt=2)
    bad.context = None  # breaks drafting
    d = p.step(StepContext([bad], max_draft=2))
    assert d.tokens == [[]] and p.num_errors == 1


# ------------------------------------------------------------- exactness
# A numpy model of vLLM's rejection sampler (v1/sample/rejection_sampler.py,
# rejection_random_sample_kernel + sample_recovered_tokens): accept draft x with
# probability min(1, p(x) / q(x)); on rejection draw from max(p - q, 0); after
# the last accepted draft a bonus token from p.

P1 = np.array([0.05, 0, 0, 0, 0.4, 0.05, 0.3, 0.2, 0, 0, 0, 0])     # after 3
P2 = {t: np.roll(np.array([0.5, 0.2, 0.1, 0.1, 0.1] + [0] * 7), t) for t in range(V)}


def _target(dist, temperature, banned=()):
    w = dist ** (1.0 / temperature)
    w[list(banned)] = 0.0  # the request's grammar masks the target's logits
    return w / w.sum()


def _sample(rng, dist):
    return int(rng.choice(len(dist), p=dist / dist.sum()))


def _run_exactness(p, temperature, trials, seed=0, extra_args=None, banned=()):
    """vLLM's verification in plain numpy: rejection sampling of each drafted
    token against the target (one-hot where the proposer gave no row), the
    residual at the first rejection. ``banned``: the request has structured
    outputs whose grammar rejects these tokens everywhere; the target is
    masked and, as vLLM's scheduler does (update_draft_token_ids ->
    validate_tokens), the draft is cut before the first banned token."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    last = (0, 0)  # (drafts verified, accepted) of the previous trial
    for _ in range(trials):
        n, m = last
        # The context stays [1, 2, 3]; only the outcome counts change, which
        # is all the calibration reads (no topk: the store stays fixed).
        r = req("a", [1, 2, 3], [3], verified=[2], num_prompt=2,
                temperature=temperature, extra_args=extra_args)
        if banned:
            r.sampling_params.structured_outputs = SimpleNamespace(regex="...")
        r.accepted = np.full(m + 1, 3, dtype=np.int64)
        r.num_draft = n
        r.verified_tokens = np.full(n + 1, 2, dtype=np.int64)
        d = p.step(StepContext([r], max_draft=2))
        toks = d.tokens[0]
        rows = d.probs[0] if d.probs is not None else None
        cut = [j for j, x in enumerate(toks) if x in banned]
        if cut:
            toks, rows = toks[:cut[0]], None if rows is None else rows[:cut[0]]
        out = []
        targets = [_target(P1, temperature, banned)]
        for j, x in enumerate(toks):
            tp = targets[j]
            q = rows[j].astype(np.float64) if rows is not None else np.eye(V)[x]
            if rng.random() < min(1.0, tp[x] / q[x]):
                out.append(x)
                targets.append(_target(P2[x], temperature, banned))
            else:
                out.append(_sample(rng, np.maximum(tp - q, 0)))
                break
        m = 0  # a rejected draft is never re-drawn: residual(x) = 0 there
        while m < len(toks) and m < len(out) and out[m] == toks[m]:
            m += 1
        last = (len(toks), m)
        while len(out) < 2:  # bonus / next steps
            tp = _target(P1 if not out else P2[out[0]], temperature, banned)
            out.append(_sample(rng, tp))
        counts[out[0], out[1]] += 1
    want = _target(P1, temperature, banned)[:, None] * np.stack(
        [_target(P2[t], temperature, banned) for t in range(V)])
    return chi2_pvalue(counts.ravel(), want.ravel())


def _exactness_proposer(debug="exact"):
    # The store believes something else than the target: q != p, and the
    # second position's distribution (and whether it is drafted at all)
    # depends on the first drafted token. ``debug``: the test hook's mode
    # (proposers/stand_debug.py), read when the proposer is built.
    with mock.patch.dict(os.environ, {stand_debug.ENV: debug}):
        p = proposer(min_path_prob=0.3, max_order=1, share="request", calibrate=True)
    ctx = StepContext([req("a", [1, 2, 3, 4, 6, 7], [4, 6, 7], verified=[3, 4, 6],
                           topk=[[(4, 0.7), (6, 0.2), (0, 0.05)],
                                 [(0, 0.3), (5, 0.3), (6, 0.2)],
                                 [(6, 0.5), (7, 0.4)]],
                           num_prompt=2, temperature=1.0)], max_draft=2)
    p.step(ctx)
    return p


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rejection_sampling_with_our_rows_keeps_the_target_distribution(temperature):
    assert _run_exactness(_exactness_proposer(), temperature, 6000) > 0.01


def test_the_exactness_check_catches_dishonest_rows():
    assert _run_exactness(_exactness_proposer("uniform"), 1.0, 6000) < 1e-4


def test_dishonest_rows_are_a_test_hook_not_an_option():
    from vllm_plugins.registry import translate

    with pytest.raises(ValueError, match="debug_probs"):
        translate({"method": "stand", "debug_probs": "uniform"})
    assert proposer().debug_probs == "exact"
    with mock.patch.dict(os.environ, {stand_debug.ENV: "sideways"}):
        with pytest.raises(ValueError, match=stand_debug.ENV):
            proposer()


def test_per_request_debug_rows_only_for_the_marked_request():
    p = _exactness_proposer("per_request")
    dishonest = {"stand_debug_probs": "uniform"}
    assert _run_exactness(p, 1.0, 6000, extra_args=dishonest) < 1e-4
    assert _run_exactness(p, 1.0, 3000, seed=1) > 0.01


# The store's favourite first token, which the request's grammar rejects.
GRAMMAR_BANNED = (4,)


def test_structured_output_drafts_go_out_one_hot_and_stay_exact():
    """Rule 3: vLLM cuts the draft at the first token the grammar rejects, so
    whether a position is verified depends on the token drawn there."""
    p = _exactness_proposer()
    assert _run_exactness(p, 1.0, 6000, banned=GRAMMAR_BANNED) > 0.01
    drafted = p.drafted
    assert drafted["sampled"] > 1000 and drafted["sampled_one_hot"] == drafted["sampled"]


def test_honest_rows_under_a_grammar_cut_are_caught_as_biased():
    """The same check with the rows the tokens were drawn from: biased
    (p = (.5, .5, 0), q = (0, .5, .5) gives .75 in the smallest case)."""
    p = _exactness_proposer("drawn")
    assert _run_exactness(p, 1.0, 6000, banned=GRAMMAR_BANNED) < 1e-4
    assert p.drafted["sampled_one_hot"] == 0


def test_the_exactness_check_catches_argmax_drafts_with_drawn_rows():
    """The hook's "argmax", the structured-output e2e test's control."""
    assert _run_exactness(_exactness_proposer("argmax"), 1.0, 6000) < 1e-4


def test_rows_stay_for_requests_without_structured_outputs():
    p = sampled_setup()
    r = req("a", [1, 2, 3], [3], verified=[2], num_prompt=2, temperature=1.0)
    s = req("a", [1, 2, 3], [3], verified=[2], num_prompt=2, temperature=1.0)
    s.sampling_params.structured_outputs = SimpleNamespace(choice=["x"])
    p2 = sampled_setup()  # another proposer: the same store, its own draws
    d = p.step(StepContext([r], max_draft=2))
    d2 = p2.step(StepContext([s], max_draft=2))
    assert d.probs[0] is not None and len(d.tokens[0]) > 0
    assert d2.tokens[0] and (d2.probs is None or d2.probs[0] is None)


def test_acceptance_policy_sees_a_length_fixed_before_drafting():
    """Rule 2: a controller that looks at the whole chain must not learn how
    long the sampled chain is (that depends on the sampled tokens)."""
    p = sampled_setup(draft_length="acceptance")
    seen = []
    original = p.controller.decide

    def spy(ctx, drafts, observation):
        seen.append([len(t) for t in drafts.tokens])
        return original(ctx, drafts, observation)

    p.controller.decide = spy
    lengths = set()
    for _ in range(50):
        ctx = StepContext([req("a", [1, 2, 3], [3], verified=[2], num_prompt=2,
                               temperature=1.0)], max_draft=3)
        d = p.step(ctx)
        lengths.add(len(d.tokens[0]))
        assert len(d.probs[0]) == len(d.tokens[0])
    assert {s[0] for s in seen} == {3}   # always the padded length
    assert lengths <= {0, 1, 2} and len(lengths) >= 2  # real drafts still vary


def test_samples_of_one_request_share_the_bridges_group_id():
    """Pins vLLM's child naming (v1/engine/parallel_sampling.py,
    ParentRequest.get_child_info: f"{index}_{request_id}", child n = 1) to
    vllm_plugins.bridge.groups.group_of."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    from vllm_plugins.bridge.groups import group_of as _group_of

    parent_id = "chat-42-1a2b3c4d"
    parent = ParentRequest(SimpleNamespace(
        request_id=parent_id, external_req_id="chat-42",
        params=SamplingParams(n=4, temperature=1.0, seed=3)))
    groups = set()
    for i in range(4):
        child_id, child_params = parent.get_child_info(i)
        assert child_params.n == 1
        groups.add(_group_of(child_id, child_params))
    assert groups == {parent_id}
    assert _group_of("b7-3-9f8e7d6c", SamplingParams(n=1)) == "b7-3-9f8e7d6c"


def test_calibration_learns_acceptance_per_kind_and_shortens_bad_paths():
    p = proposer(min_path_prob=0.2, max_order=1, share="request", calibrate=True)
    ctx = StepContext([req("a", [1, 2, 3, 4, 5], [4, 5], verified=[3, 4],
                           topk=[[(4, 0.9)], [(5, 0.9)]], num_prompt=3)], max_draft=4)
    p.step(ctx)  # target-learned: 3 -> 4, 4 -> 5; prompt seeds 1 -> 2, 2 -> 3
    kind = p.calibration.kind(False, 1, False)
    # Prior 0.5 at the entries' mean score: 3 -> 4 -> 5 (0.5, 0.25).
    d = p.step(StepContext([req("a", [1, 2, 3], [3], verified=[2], num_prompt=3)],
                           max_draft=4))
    assert d.tokens[0] == [4, 5]
    # Every draft of that kind is accepted from now on.
    for _ in range(40):
        r = req("a", [1, 2, 3], [3], verified=[2], num_prompt=3)
        r.accepted = np.array([4, 5, 6])
        r.num_draft = 2
        r.verified_tokens = np.array([3, 4, 5])
        d = p.step(StepContext([r], max_draft=4))
    assert p.calibration.estimate(kind) > 0.9
    assert d.confidence[0] == pytest.approx([0.99, 0.99], abs=0.06)
    # ... and then every one is rejected: confidence falls, the path shortens.
    for _ in range(200):
        r = req("a", [1, 2, 3], [3], verified=[2], num_prompt=3)
        r.num_draft = 2
        r.verified_tokens = np.array([3, 4, 5])
        d = p.step(StepContext([r], max_draft=4))
    assert p.calibration.estimate(kind) < 0.3
    assert d.tokens[0] == []
    assert "greedy/order1" in p.metrics()["stand"]["acceptance_by_kind"]


def test_requests_whose_finish_notice_never_came_are_swept():
    p = proposer()
    p.step(StepContext([req("lost", [1, 2, 3], [3], verified=[2], num_prompt=2,
                            temperature=1.0)], max_draft=2))
    assert "lost" in p._req_key and p._live
    for _ in range(p.SWEEP_STEPS + 64):
        p.step(StepContext([req("alive", [5, 6, 7], [7], verified=[6], num_prompt=2)],
                           max_draft=2))
    assert "lost" not in p._req_key and "lost" not in p._req_rng
    assert "alive" in p._req_key and p.swept_requests == 1
    assert list(p._live.values()) == [1]
