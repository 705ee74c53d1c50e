"""The acceptance and confidence policies, and what every estimating policy
shares: estimates, probing, cut drafts, length bounds, calibration, state."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length import (POLICIES as ALL_POLICIES, make_controller,
                                                 policy_options)
from vllm_plugins.proposers.draft_length.calibration import PrefixCalibrator
from vllm_plugins.proposers.draft_length.slots import RequestSlots
from vllm_plugins.step_context import Drafts, StepContext

from tests.draft_length_world import D, DRAFT_TOKEN, POLICIES, World, make_policy, request_step


def test_factory_names_defaults_and_errors():
    assert set(ALL_POLICIES) == {"fixed", "acceptance", "confidence", "goodput"}
    for name in ALL_POLICIES:
        assert make_controller(name, {}, D).name == name
    with pytest.raises(ValueError, match="bogus"):
        make_controller("bogus", {}, D)
    with pytest.raises(ValueError, match="half_lfie"):
        make_controller("goodput", {"half_lfie": 2}, D)
    with pytest.raises(ValueError, match="threshold"):
        make_controller("acceptance", {"threshold": 0.5}, D)  # confidence-only option
    with pytest.raises(ValueError, match="half_life"):
        make_controller("acceptance", {"half_life": -1}, D)
    with pytest.raises(ValueError, match="explore"):
        make_controller("goodput", {"explore": 1.5}, D)
    with pytest.raises(ValueError, match="window"):
        make_controller("goodput", {"window": True}, D)       # bool is not an int
    with pytest.raises(ValueError, match="estimator"):
        make_controller("goodput", {"estimator": "kalman"}, D)
    with pytest.raises(ValueError, match="use_confidence"):
        make_controller("goodput", {"use_confidence": "yes"}, D)
    with pytest.raises(ValueError, match="threshold"):
        make_controller("confidence", {"threshold": float("nan")}, D)
    with pytest.raises(ValueError, match="dict"):
        make_controller("goodput", ["half_life", 2], D)
    with pytest.raises(ValueError, match="max_draft"):
        make_controller("goodput", {}, 0)
    c = make_controller("confidence", {"threshold": 0.5}, D)
    assert c.name == "confidence" and c.options["threshold"] == 0.5
    assert policy_options("confidence", None)["threshold"] == 0.3
    with pytest.raises(ValueError, match="seed"):
        make_controller("goodput", {"seed": -3}, D)


def test_each_controller_name_names_one_class():
    """A policy's class declares its own name, and no other controller
    class shares it (the stats' "policy" says which rule decided)."""
    from vllm_plugins.proposers.draft_length import CONTROLLERS, DraftLengthController

    classes, todo = [], [DraftLengthController]
    while todo:
        cls = todo.pop()
        classes.append(cls)
        todo += cls.__subclasses__()
    own = [c.name for c in classes if "name" in vars(c)]
    assert len(own) == len(set(own)), own
    for name, cls in CONTROLLERS.items():
        assert vars(cls).get("name") == name, cls


def test_fixed_keeps_all_and_empty_batch():
    c = make_controller("fixed", {}, D)
    ctx = StepContext([request_step("a", 0, 0), request_step("b", 0, 0)], max_draft=D)
    assert c.decide(ctx, Drafts([[1, 2, 3], []]), c.observe(ctx)) == [3, 0]
    empty = StepContext([])
    assert c.decide(empty, Drafts([]), c.observe(empty)) == []
    s = c.stats()
    assert s["decisions"] == 1 and s["no_draft"] == 1
    assert s["k_histogram"] == [0, 0, 0, 1, 0, 0, 0]   # rows with no draft are not choices


def test_decide_rejects_misaligned_drafts():
    c = make_policy("acceptance")
    ctx = StepContext([request_step("a", 0, 0)], max_draft=D)
    observation = c.observe(ctx)
    with pytest.raises(ValueError, match="rows"):
        c.decide(ctx, Drafts([[1], [2]]), observation)


@pytest.mark.parametrize("policy", POLICIES)
def test_near_zero_acceptance_gives_zero(policy):
    w = World(make_policy(policy))
    ks = w.run(0.0, 60)[20:]
    assert (ks == 0).all(), ks
    # A zero choice still learns: the cut draft's outcome is read from the
    # target's own token, so no probe is spent.
    s = w.c.stats()
    assert s["probes"] == 0 and s["cut_drafts_observed"] >= 40, s
    w = World(make_policy(policy, observe_cut=False))
    ks = w.run(0.0, 60)[20:]
    assert (ks == 0).mean() >= 0.8, ks          # probes are the only non-zeros
    assert ks.max() <= 1
    assert w.c.stats()["probes"] >= 1


@pytest.mark.parametrize("policy", POLICIES)
def test_near_one_acceptance_gives_long_drafts(policy):
    c = make_policy(policy)
    w = World(c)
    ks = w.run(0.98, 50)[20:]   # goodput explores during its 16-step warm-up
    assert np.median(ks) >= D - 1, ks
    # goodput keeps none only on its rare steps that measure the idle cost
    assert (ks == 0).sum() <= c.stats().get("idle_probes", 0) <= 2


@pytest.mark.parametrize("policy", POLICIES)
def test_reacts_within_a_few_steps_to_a_switch(policy):
    downs, ups = [], []
    for seed in range(5):
        w = World(make_policy(policy), seed=seed)
        w.run(0.97, 40)
        down = w.run(0.0, 30).ravel()
        up = w.run(0.97, 40).ravel()
        assert (down[12:] <= 1).all(), down          # stays down (probes only)
        assert (up[-10:] >= D - 2).all(), up         # and comes back up
        downs.append(int(np.argmax(down <= 1)))
        ups.append(int(np.argmax(up >= D - 2)))
    # high -> zero: short drafts within a few steps (change detection)
    assert np.median(downs) <= 4 and max(downs) <= 10, downs
    # zero -> high: found by the next probe (every 4 steps, 8 after a failed
    # one), then grown within a few steps
    assert np.median(ups) <= 2 * 4 + 4 and max(ups) <= 2 * (2 * 4) + 6, ups


def test_probing_can_be_disabled():
    w = World(make_policy("acceptance", probe_interval=0))
    ks = w.run(0.0, 60)[20:]
    assert (ks == 0).all()
    assert w.c.stats()["probes"] == 0


def test_window_estimator_reacts_within_the_window():
    w = World(make_policy("acceptance", estimator="window", window=4), seed=2)
    w.run(0.97, 30)
    down = w.run(0.0, 12)
    assert (down[5:] <= 1).all(), down


def test_change_detection_speeds_up_reaction():
    def steps_to_short(opts):
        out = []
        for seed in range(4):
            w = World(make_policy("acceptance", **opts), seed=seed)
            w.run(0.97, 60)
            down = w.run(0.0, 30)
            out.append(int(np.argmax(down <= 1)))
        return np.mean(out)
    fast, slow = steps_to_short({}), steps_to_short({"change_threshold": 0})
    assert fast < slow and fast <= 5, (fast, slow)


def test_per_request_estimates_are_independent():
    w = World(make_policy("acceptance"), batch=2)
    ks = w.run([0.98, 0.0], 40)[15:]
    assert np.median(ks[:, 0]) >= D - 1
    assert np.median(ks[:, 1]) == 0


def test_prefill_and_no_draft_steps_teach_nothing():
    c = make_policy("acceptance")
    for _ in range(20):
        ctx = StepContext([request_step("p", 3, 0, prefill=True), request_step("q", 0, 0)], max_draft=D)
        c.observe(ctx)
    assert c.estimator.counts(np.array([c.slots.get("p"), c.slots.get("q")]))[1].sum() == 0


def test_calibration_learns_an_overconfident_proposer():
    # threshold tiny: keeps drafting, so the calibration sees many outcomes
    c = make_policy("confidence", threshold=0.01)
    World(c, batch=4, seed=3).run(0.3, 60, confidence=0.95)  # claims .95, is .3
    rows = np.array([c.slots.get("r0")])
    cal = c.calibrator.calibrate(rows, np.array([[0.95]]))[0, 0]
    assert abs(c.calibrator.table()[9] - 0.3) < 0.07   # the global bin
    assert abs(cal - 0.3) < 0.2, cal                    # this request's: noisier
    # with threshold 0.5 the proposer's 0.95 is not trusted for long
    c = make_policy("confidence", threshold=0.5)
    ks = World(c, seed=3).run(0.3, 80, confidence=0.95)
    cal = c.calibrator.calibrate(rows, np.array([[0.95]]))[0, 0]
    assert cal < 0.5 and np.median(ks[40:]) == 0, (cal, ks)
    # ... and trusts an honest, high confidence
    c2 = make_policy("confidence", threshold=0.5)
    ks2 = World(c2, seed=3).run(0.95, 60, confidence=0.95)
    assert np.median(ks2[20:]) >= D - 2


def test_confidence_threshold_trims_by_cumulative_product():
    c = make_policy("confidence", threshold=0.4)
    ctx = StepContext([request_step("a", 0, 0), request_step("b", 0, 0)], max_draft=D)
    observation = c.observe(ctx)
    conf = [np.array([0.9, 0.9, 0.9, 0.9, 0.9, 0.9]), None]
    keep = c.decide(ctx, Drafts([[1] * 6, [1] * 6], confidence=conf), observation)
    # a fresh calibrator trusts raw confidence: 0.9^8 = 0.43 >= 0.4 > 0.9^9,
    # clipped to 6 drafts; row b has none: history prior (0.6) -> 0.6 >= 0.4 > 0.36
    assert keep == [6, 1]
    conf = [np.array([0.9, 0.8, 0.3, 0.9, 0.9, 0.9]), None]
    keep = c.decide(ctx, Drafts([[1] * 6, [1] * 6], confidence=conf), observation)
    assert keep[0] == 2                           # 0.9*0.8 = .72; *0.3 = .22 < .4


def test_max_length_bounds_decide_and_follows_history():
    for policy in POLICIES:
        c = make_policy(policy)
        w = World(c, batch=3, cost=(0.02, 0.001, 0.0), seed=6)
        alphas = [0.0, 0.5, 0.97]
        for _ in range(60):
            ctx = w.ctx()
            observation = c.observe(ctx)
            bound = [c.max_length(r.req_id, observation) for r in ctx.requests]
            keep = c.decide(ctx, Drafts([[7] * D] * 3), observation)
            assert all(k <= b for k, b in zip(keep, bound)), (policy, keep, bound)
            draws = w.rng.random((3, D)) < np.array(alphas)[:, None]
            w.n = np.array(keep)
            run = np.cumprod(draws, 1).sum(1)
            w.m = np.minimum(run, w.n)
            w.bonus = np.where(run > w.n, DRAFT_TOKEN, 0)
            w.tokens = int(sum(keep) + 3)
            w.seconds = 0.02 + 0.001 * w.tokens
        assert bound[0] <= 1 and bound[2] >= D - 1, (policy, bound)
        assert c.max_length("never-seen", observation) == D


def test_stats_count_choices():
    c = make_policy("goodput")
    w = World(c, batch=2, cost=(0.02, 0.001, 0.0))
    all_ks = w.run([0.0, 0.97], 50)
    s = c.stats()
    json.dumps(s, allow_nan=False)                  # the benchmark records it
    assert s["decisions"] == 100
    assert sum(s["k_histogram"]) == 100
    assert s["zero_choices"] == int((all_ks == 0).sum()) == s["k_histogram"][0]
    assert s["k_histogram"] == [int((all_ks == k).sum()) for k in range(D + 1)]
    assert s["mean_k"] == pytest.approx(all_ks.mean())
    for key in ("intercept_s", "per_token_s", "per_request_s", "warm"):
        assert key in s["cost_model"]


def test_finished_requests_are_freed_and_slots_reused_clean():
    c = make_policy("acceptance")
    w = World(c, batch=4)
    w.run(0.97, 20)
    assert c.stats()["tracked_requests"] == 4
    w.finished = {"r0", "r1"}
    w.ids[0], w.ids[1] = "s0", "s1"
    w.n[:2] = 0
    w.m[:2] = 0
    ctx = w.ctx()
    c.observe(ctx)
    assert "r0" not in c.slots and c.stats()["tracked_requests"] == 4
    # the new requests start from the prior, not from r0/r1's history
    s, n = c.estimator.counts(np.array([c.slots.get("s0"), c.slots.get("s1")]))
    assert s.sum() == 0 and n.sum() == 0
    cap = c.slots.capacity
    for i in range(200):                           # churn: memory stays put
        w.finished = {w.ids[0]}
        w.ids[0] = f"t{i}"
        w.n[0] = w.m[0] = 0
        w.step(0.5)
    assert c.slots.capacity == cap and c.stats()["tracked_requests"] == 4


def test_lost_finish_notices_are_bounded_by_max_tracked():
    c = make_policy("acceptance", max_tracked=16)
    for i in range(100):
        ctx = StepContext([request_step(f"x{i}", 0, 0)], max_draft=D)
        c.decide(ctx, Drafts([[1] * D]), c.observe(ctx))
    assert len(c.slots) == 16 and c.slots.capacity <= 16
    assert c.stats()["evicted_requests"] == 84


def _deep_world_step(c, ids, rng, p_first, p_deep, conf=None):
    """Drafts where position 1 is accepted with p_first and later positions,
    given their prefix, with p_deep (a copy regime: right once, right on)."""
    ctx = StepContext([request_step(r, int(c._n[r]), int(c._m[r]), bonus=c._b.get(r, 0))
                       for r in ids], max_draft=D)
    observation = c.observe(ctx)
    confs = None if conf is None else [np.full(D, conf, np.float32) for _ in ids]
    keep = c.decide(ctx, Drafts([[DRAFT_TOKEN] * D] * len(ids), confidence=confs),
                    observation)
    for r, k in zip(ids, keep):
        first = rng.random() < p_first
        run = 0 if not first else 1 + int(np.cumprod(rng.random(D - 1) < p_deep).sum())
        c._n[r], c._m[r] = k, min(run, k)
        c._b[r] = DRAFT_TOKEN if run > k else 0
    return keep


@pytest.mark.parametrize("with_conf", [False, True])
def test_deep_positions_learn_their_own_higher_rate(with_conf):
    # Position 1 is right 30% of the time; a draft that survived it is right
    # 95% of the time after (a copy regime). A pooled per-request rate would
    # value every position at about 0.3 and cut chains that pay; the depth
    # profile learns the deep rate.
    if with_conf:
        c = make_policy("confidence", threshold=0.15)
    else:
        c = make_policy("acceptance", min_prob=0.15, target_fraction=1.0)
    rng = np.random.default_rng(0)
    ids = [f"r{i}" for i in range(8)]
    c._n = {r: 0 for r in ids}
    c._m = {r: 0 for r in ids}
    c._b = {}
    keeps = [_deep_world_step(c, ids, rng, 0.3, 0.95, conf=0.5 if with_conf else None)
             for _ in range(150)]
    rows = c.slots.slots(ids)
    p = c.estimator.probs(rows)
    assert p[:, 0].mean() < 0.5 and p[:, 3].mean() > 0.6, p
    if with_conf:
        cal = c.calibrator.calibrate(rows, np.full((len(ids), D), 0.5))
        assert cal[:, 0].mean() < 0.5 and cal[:, 3].mean() > 0.8, cal
        assert np.median(keeps[-20:]) >= 4, keeps[-20:]


class _BudgetedProposer:
    """Drafts only what max_length allows, like ngram_adaptive does."""

    def __init__(self, c):
        self.c = c

    def step(self, w: World, alpha: float) -> int:
        ctx = w.ctx()
        observation = self.c.observe(ctx)
        budget = self.c.max_length(w.ids[0], observation)
        keep = self.c.decide(ctx, Drafts([[DRAFT_TOKEN] * budget]), observation)
        draws = w.rng.random(D) < alpha
        run = np.cumprod(draws).sum()
        w.n = np.array(keep)
        w.m = np.minimum(run, w.n)
        w.bonus = np.where(run > w.n, DRAFT_TOKEN, 0)
        w.tokens = int(sum(keep) + 1)
        w.seconds = 0.02 + 0.001 * w.tokens
        return keep[0]


def test_zero_from_max_length_counts_as_a_choice_and_still_probes():
    c = make_policy("acceptance")
    w, p = World(c, seed=1), _BudgetedProposer(c)
    for _ in range(20):
        p.step(w, 0.97)
    ks = [p.step(w, 0.0) for _ in range(40)]
    s = c.stats()
    assert ks[-20:].count(0) >= 12, ks
    # drafting nothing because max_length said 0 is the controller's choice
    assert s["zero_choices"] >= ks.count(0) and s["no_draft"] == 0, s
    # ... and it keeps learning: a probe, or (when the proposer drafts the
    # probe's token) the cut draft's outcome read from the target's token
    assert s["probes"] + s["cut_drafts_observed"] >= 2, s
    ks_up = [p.step(w, 0.97) for _ in range(30)]
    assert max(ks_up[-10:]) >= D - 2, ks_up        # so it comes back


@pytest.mark.parametrize("confidence", [None, 0.02])
def test_cut_drafts_are_observed_so_an_under_estimate_corrects_itself(confidence):
    # 30 steps where no draft is right drive the estimates to ~0 and k to 0;
    # then drafts are right 90% of the time (and, with confidence=0.02, the
    # proposer still says they are not). Learning only from kept drafts, the
    # controller waits for probes; reading each cut draft's outcome from the
    # target's own token, it climbs back a position or more per step.
    def kept_after_switch(observe_cut: bool) -> float:
        total = 0
        for seed in range(5):
            w = World(make_policy("goodput", observe_cut=observe_cut), seed=seed)
            w.run(0.0, 30)
            total += int(w.run(0.9, 15, confidence=confidence).sum())
        return total / 5

    seen, blind = kept_after_switch(True), kept_after_switch(False)
    assert seen >= 60, seen                     # of at most 15 * 6 = 90
    assert seen >= 1.5 * blind, (seen, blind)


def test_prefix_calibration_learns_realised_acceptance_of_kept_drafts():
    """Kept drafts whose prefixes were predicted at 0.6 but accepted 30% of
    the time: the calibrated q moves to ~0.3, stays non-increasing along the
    draft, and leaves buckets without data near their raw value."""
    slots = RequestSlots()
    cal = PrefixCalibrator(slots, D)
    rng = np.random.default_rng(0)
    rows = slots.slots([f"r{i}" for i in range(16)])
    for _ in range(200):
        q = np.full((16, D), 0.6)
        q[:, 1:] = 0.05                            # later positions: another bucket
        cal.remember(rows, q, np.ones(16, np.int64))   # one kept draft each
        m = (rng.random(16) < 0.3).astype(np.int64)
        cal.observe(rows, np.ones(16, np.int64), m)
    out = cal.apply(np.array([[0.6, 0.55, 0.05, 0.01, 0.01, 0.01]]))
    assert out[0, 0] == pytest.approx(0.3, abs=0.05), out
    assert (np.diff(out[0]) <= 1e-12).all(), out
    assert out[0, 3] == pytest.approx(0.01, rel=0.2), out
    g = make_controller("goodput", {}, D)
    assert g.stats()["prefix_calibration"] and "prefix_calibration" not in \
        make_controller("goodput", {"calibrate_prefix": False}, D).stats()
