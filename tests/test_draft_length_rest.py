"""Goodput rests a proposer that may rest: when, for how long, and what it measures."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length.rest import ModeRates, _mode_record
from vllm_plugins.step_context import Drafts, StepContext

from tests.draft_length_world import CountingProposer, D, DRAFT_TOKEN, World, make_policy, request_step, resting


def test_goodput_rests_a_proposer_whose_drafts_cannot_pay():
    """Where no draft pays, the controller stops calling the proposer at all
    (no top-k, no drafting) for stretches that double while nothing changes;
    when acceptance jumps, drafting comes back within one stretch."""
    p = CountingProposer(can_rest=True)
    c = p.controller
    w = World(c, batch=16, cost=(0.064, 0.001, 0.0, 0.012), noise=0.01, seed=3,
              proposer=p)
    w.run(0.3, 200)
    steps, calls = c.steps, p.calls
    rested_topk = []
    for _ in range(200):
        will_rest = c.rests_next_step
        rested_topk.append((will_rest, p.topk_wanted()))
        w.step(0.3)
        assert c.rest.resting == will_rest
    assert c.steps - steps == 200
    skipped = 200 - (p.calls - calls)
    assert skipped >= 150, skipped                 # stretches up to 32 steps
    assert c.stats()["rest_steps"] >= skipped
    assert all(k == (0 if rest else 4) for rest, k in rested_topk)
    ks = w.run(0.97, 80)
    assert ks[-10:].mean() >= 3, ks.mean(1)

    never = CountingProposer(can_rest=False)
    w = World(never.controller, batch=16, cost=(0.064, 0.001, 0.0, 0.012), noise=0.01,
              seed=3, proposer=never)
    w.run(0.3, 200)
    assert never.calls == 200 and never.controller.stats()["rest_steps"] == 0


def test_goodput_rests_where_measured_rates_say_drafting_loses():
    """Drafts at acceptance 0.35 about pay for themselves by the step-time
    model, so the rule keeps a few and never has three empty steps in a
    row; but an awake step costs 10% more than a resting one in ways the
    model has no term for (the proposer's own work). The measured rates of
    resting and awake steps catch it: the controller rests nearly all the
    time and runs at about the resting rate, where without the comparison
    it stays awake and loses."""
    cost = (0.064, 0.001, 0.0, 0.006)
    rest_rate = 16 / (0.064 + 0.016)
    rates, rested = {}, {}
    for compare in (True, False):
        p = CountingProposer(can_rest=True)
        if not compare:   # rest only after three empty steps, as before
            p.controller.rest._MODE_EVIDENCE = float("inf")
            p.controller.rest._REST_PROBE_GAP = 10 ** 9
        w = World(p.controller, batch=16, cost=cost, noise=0.01, seed=7, proposer=p,
                  awake_cost=0.008)
        w.run(0.35, 300)
        tokens = seconds = 0.0
        before = p.controller.rest.steps
        for _ in range(400):
            w.step(0.35)
            tokens += w.m.sum() + 16
            seconds += w.seconds
        rates[compare] = tokens / seconds
        rested[compare] = p.controller.rest.steps - before
    assert rates[True] > 0.97 * rest_rate, (rates, rest_rate, rested)
    assert rates[True] > 1.03 * rates[False], (rates, rested)
    assert rested[True] > 300 and rested[False] < 50, rested


def test_goodput_compares_modes_as_of_now_on_a_host_whose_load_moves():
    """Resting is measured while drafts fail on a quiet host; then the host
    gets twice as slow and drafts start to pay (1.3x resting's rate, at any
    load). Compared as of now (each mode against the model's promise at its
    time), the controller wakes and runs at the rate of one that never
    rests. Compared by absolute rates, the rest measured on the quiet host
    beats drafting on the slow one, and it rests most of the time."""
    base = (0.09, 0.007, 0.0, 0.003)
    for seed in range(2):
        rates, rests = [], 0
        for can_rest in (True, False):
            p = CountingProposer(can_rest=can_rest)
            c = p.controller
            w = World(c, batch=1, cost=base, noise=0.05, seed=seed, proposer=p)
            w.run(0.05, 300)
            assert not can_rest or c.rest.steps > 150, c.rest.steps
            w.cost = tuple(2.0 * x for x in base)
            w.run(0.4, 300)   # the step model's window moves to the new load
            before, tokens, seconds = c.rest.steps, 0.0, 0.0
            for _ in range(200):
                w.step(0.4)
                tokens += w.m.sum() + 1
                seconds += w.seconds
            rates.append(tokens / seconds)
            rests = rests or c.rest.steps - before
        assert rests <= 10, (seed, rests)
        assert rates[0] >= 0.97 * rates[1], (seed, rates)


def test_goodput_wakes_for_a_new_request():
    """At batch 1 a rest that began on a request whose drafts are never
    accepted must not roll over the next request, whose context may be
    all copies: a batch that is half new since the rest began decides
    again, as a halved one does."""
    p = CountingProposer(can_rest=True)
    c = p.controller
    w = World(c, batch=1, cost=(0.05, 0.0005, 0.0), noise=0.01, seed=5, proposer=p)
    for _ in range(120):                     # long enough for rests to double
        w.step(0.0)
        if c.rests_next_step and c.rest.length == c.rest._REST_MAX:
            break
    assert c.rests_next_step and c.rest.length == c.rest._REST_MAX
    w.finished.add(w.ids[0])
    w.ids[0] = "next"
    w.n[:] = w.m[:] = w.bonus[:] = 0
    calls = p.calls
    kept = [int(w.step(0.9)[0]) for _ in range(3)]
    assert p.calls > calls and not c.rest.resting, (p.calls, calls)
    assert sum(kept) > 0, kept


def test_goodput_wakes_when_the_batch_halves():
    p = CountingProposer(can_rest=True)
    c = p.controller
    w = World(c, batch=16, cost=(0.064, 0.001, 0.0, 0.012), noise=0.01, seed=3,
              proposer=p)
    for _ in range(400):
        w.step(0.3)
        if c.rests_next_step:
            break
    assert c.rests_next_step
    calls_before = p.calls
    small = StepContext([request_step(f"r{i}", 0, 0) for i in range(8)], max_draft=D,
                        last_step_seconds=0.08, last_step_tokens=8)
    assert len(p.step(small).tokens) == 8
    assert not c.rest.resting and p.calls > calls_before


def test_goodput_measures_modes_on_decode_steps_only():
    """A step that ran prompt tokens (a request joining in flight) costs
    its prompt in either mode and emits next to nothing: it must teach
    neither the step model nor the measured rates of resting and awake."""
    c = make_policy("goodput")
    w = World(c, batch=4, cost=(0.02, 0.001, 0.0), seed=1)
    w.run(0.5, 50)
    observed = c.cost.num_observed
    joining = [request_step(f"r{i}", 0, 0) for i in range(4)] + [request_step("new", 0, 0, prefill=True)]
    # The previous step ran 300 prompt tokens beside four decoding rows.
    ctx = StepContext(joining, max_draft=D, last_step_seconds=0.5, last_step_tokens=305)
    c.decide(ctx, Drafts([[DRAFT_TOKEN] * D] * 5), c.observe(ctx))
    weights = c.rest.modes.count.sum()
    c.observe(StepContext([request_step(f"r{i}", 0, 0) for i in range(4)], max_draft=D,
                          last_step_seconds=0.03, last_step_tokens=4))
    assert c.cost.num_observed == observed + 1                 # the decode step only
    assert c.rest.modes.count.sum() == weights                     # nothing added
    decode = StepContext([request_step("a", 2, 1)], max_draft=D, last_step_seconds=0.03,
                         last_step_tokens=3)
    assert _mode_record(decode, False, 40.0)[:3] == (False, 1, 2.0)


def test_mode_rates_measure_rest_awake_and_the_models_bias():
    m = ModeRates()
    for _ in range(50):
        m.observe(True, 16, 16, 0.08)                  # 200 tok/s resting
        m.observe(False, 16, 19, 0.1, predicted_rate=250.0)   # 190 delivered
        m.observe(False, 16, 40, 0.1)                  # no prediction: ignored
    rest, awake, n_rest, n_awake = m.rates(16)
    assert rest == pytest.approx(200) and awake == pytest.approx(190)
    assert m.bias(16) == pytest.approx(0.76) and m.bias(8) == 1.0
    assert n_rest == pytest.approx(n_awake) and n_rest > 30
    assert m.cell(64) == 64 and m.cell(65) == m.cell(127) != m.cell(128)
    assert m.own_seconds(16) is None
    for _ in range(200):
        m.observe(True, 16, 16, 0.08, own_seconds=0.0005)
        m.observe(False, 16, 19, 0.1, predicted_rate=250.0, own_seconds=0.006)
        m.observe(False, 16, 16, 0.1, own_seconds=0.004)   # timed all the same
    rest_own, awake_own = m.own_seconds(16)
    assert rest_own == pytest.approx(0.0005) and 0.004 < awake_own < 0.006
    assert m.own_seconds(8) is None
    assert m.own_table()["16"] == [0.5, pytest.approx(1e3 * awake_own, abs=1e-3)]


def test_goodput_wakes_to_a_new_request_whose_drafts_pay():
    """Batch 1: a long request whose drafts are almost never accepted (the
    measured rates say rest: an awake step costs 4 ms more), then a new one
    whose drafts are accepted 80% of the time. The new request's first
    decisions read the old acceptance and keep nothing; resting must not
    then hide the new acceptance for a whole doubled rest. The rest that
    follows starts short, and the cut draft observed on its first step,
    accepted, ends it."""
    waits = []
    for seed in range(12):
        p = CountingProposer(can_rest=True)
        c = p.controller
        w = World(c, batch=1, cost=(0.09, 0.007, 0.0, 0.003), noise=0.08, seed=seed,
                  proposer=p, awake_cost=0.004)
        w.run(0.05, 300)
        assert c.rest.steps > 100, c.rest.steps
        w.finished.add(w.ids[0])
        w.ids[0] = "next"
        w.n[:] = w.m[:] = w.bonus[:] = 0
        ks = w.run(0.8, 40)[:, 0]
        waits.append(int(np.argmax(ks > 0)) if (ks > 0).any() else len(ks))
    assert max(waits) <= 8, waits
