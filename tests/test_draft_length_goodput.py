"""The goodput policy against synthetic cost curves, and the simulator."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length import make_controller
from vllm_plugins.proposers.draft_length import simulator as sim
from vllm_plugins.proposers.draft_length.rest import ModeRates
from vllm_plugins.step_context import Drafts, StepContext

from tests.draft_length_world import D, DRAFT_TOKEN, World, make_policy, request_step, resting


def test_goodput_uses_confidence_when_given():
    c = make_policy("goodput")
    w = World(c, cost=(0.02, 0.001, 0.0), seed=4)
    ks = w.run(0.95, 60, confidence=0.05)        # proposer says "hopeless", wrongly
    assert np.median(ks[30:]) >= D - 2           # calibration corrects it


def test_goodput_keeps_none_where_only_the_verify_step_cost_makes_drafts_lose():
    """Acceptance 0.3 at batch 16, a token costing 1/80 of a step (break-even
    about 0.2 per token), and a verifying step costing 8% more: one draft per
    request gains 16 * (0.3 - 0.2) = 1.6 tokens' worth, less than the 1.3
    tokens the switch costs plus noise... so the switch-aware rule keeps
    about none, and delivers more tokens per second than the same rule
    blind to the switch cost."""
    cost = (0.064, 0.001, 0.0, 0.012)
    rates = {}
    for switch in (True, False):
        c = make_policy("goodput", verify_step_cost=switch, explore=0.05, rest=False)
        w = World(c, batch=16, cost=cost, noise=0.01, seed=3)
        w.run(0.3, 150)
        tokens = seconds = 0.0
        for _ in range(300):
            keep = w.step(0.3)
            tokens += w.m.sum() + 16
            seconds += w.seconds
        rates[switch] = tokens / seconds
    assert rates[True] > 1.02 * rates[False], rates


def test_goodput_learns_the_cost_of_new_step_sizes_and_keeps_to_few():
    """A runtime that rebuilds its kernels for a token count it has not seen
    among the last 32 (vLLM's CPU linear layers: vllm_plugins.bench.kernel_sizes
    measures that cost). Requests of mixed acceptance make the best draft count
    differ every step; a rule that knows the cost keeps to a few step sizes
    and delivers more tokens per second than the same rule blind to it. (The
    per-count correction is off in both: a count the rule keeps to is a
    cheap count, so it learns much of the same from the other side.)"""
    rates, sizes = {}, {}
    alpha = np.linspace(0.2, 0.95, 16)
    for cache in (32, 0):
        c = make_policy("goodput", shape_cache=cache, explore=0.05, rest=False, count_prior=0)
        w = World(c, batch=16, cost=(0.064, 0.001, 0.0, 0.006), noise=0.01, seed=5,
                  new_shape_cost=0.1)
        w.run(alpha, 200)
        tokens = seconds = 0.0
        seen = set()
        for _ in range(300):
            w.step(alpha)
            tokens += w.m.sum() + 16
            seconds += w.seconds
            seen.add(w.tokens)
        rates[cache], sizes[cache] = tokens / seconds, len(seen)
        if cache:
            co = c.stats()["cost_model"]
            assert 0.05 < co["new_shape_s"] < 0.15, co
    assert rates[32] > 1.1 * rates[0], (rates, sizes)
    assert sizes[32] < sizes[0], sizes


@pytest.mark.parametrize("seed", range(2))
def test_goodput_learns_a_step_time_that_moves_in_steps_with_the_token_count(seed):
    """A runtime whose kernels differ by token count: each 8 more tokens
    cost a step of their own (vLLM's CPU linear layers at some row counts, a
    GPU's captured graph sizes). A line through it charges every token the
    same; with each count's own residual the rule stops where a level ends
    and delivers more. Where the curve is a line, the corrections cost next
    to nothing."""
    rates = {}
    for stairs in (0.008 * (np.arange(80) // 8), None):
        for prior in (4, 0):
            c = make_policy("goodput", count_prior=prior, explore=0.02, rest=False,
                            shape_cache=0)
            w = World(c, batch=4, cost=(0.02, 0.0002, 0.0), noise=0.05, seed=seed,
                      by_count=stairs)
            w.run(0.7, 300)
            tokens = seconds = 0.0
            for _ in range(400):
                w.step(0.7)
                tokens += w.m.sum() + 4
                seconds += w.seconds
            rates[stairs is None, prior] = tokens / seconds
            # Milliseconds a count, as the stats report them; none without a prior.
            kept = c.stats()["cost_model"]["count_costs_ms"]
            assert bool(kept) == bool(prior), kept
    assert rates[False, 4] > 1.03 * rates[False, 0], rates
    assert rates[True, 4] > 0.99 * rates[True, 0], rates


def test_goodput_learns_the_engine_curve():
    c = make_controller("goodput", {"explore": 0.05}, D)
    w = World(c, batch=4, cost=(0.015, 0.0004, 0.0), noise=0.02)
    w.run(0.6, 200)
    co = c.stats()["cost_model"]
    assert co["warm"]
    assert abs(co["per_token_s"] - 0.0004) / 0.0004 < 0.2, co


def test_goodput_zero_at_large_batch_on_a_steep_curve():
    c = make_policy("goodput")
    w = World(c, batch=64, cost=(0.01, 0.0005, 0.0), noise=0.02)
    w.run(0.5, 30)
    before = c.stats()
    ks = w.run(0.5, 30)
    after = c.stats()
    # (nearly) every request-step is a zero choice or a one-token probe, and
    # probes are rare where drafts are this dear (stretched interval). Zero
    # choices keep learning from the cut draft, so a noisy estimate (true
    # acceptance 0.5, break-even about 0.76) keeps a draft now and then.
    zeros = after["zero_choices"] - before["zero_choices"]
    probes = after["probes"] - before["probes"]
    assert zeros + probes >= 0.95 * 30 * 64, (zeros, probes)
    assert probes <= 0.1 * 30 * 64 and ks.mean() <= 0.1, (probes, ks.mean())


def test_goodput_long_at_batch_one_on_a_flat_curve():
    c = make_policy("goodput")
    w = World(c, batch=1, cost=(0.02, 0.00001, 0.0), noise=0.005)
    ks = w.run(0.5, 80)[30:]
    assert np.median(ks) >= D - 1, ks


def test_goodput_k_shrinks_as_batch_cost_grows():
    ks = []
    for batch in (1, 8, 64):
        c = make_policy("goodput")
        ks.append(World(c, batch=batch, cost=(0.01, 0.0002, 0.0)).run(0.7, 60)[30:].mean())
    assert ks[0] > ks[1] > ks[2], ks


def test_simulation_goodput_vs_fixed():
    steep = replace(sim.SCENARIOS[2], steps=150)            # batch 64, steep
    assert steep.batch == 64
    fixed = sim.simulate("fixed", steep)
    good = sim.simulate("goodput", steep)
    assert good["expected_tokens_per_s"] > 1.5 * fixed["expected_tokens_per_s"]
    flat = replace(sim.SCENARIOS[0], steps=300)             # batch 1, flat
    fixed = sim.simulate("fixed", flat)
    good = sim.simulate("goodput", flat)
    assert good["expected_tokens_per_s"] > 0.93 * fixed["expected_tokens_per_s"]
    oracle = sim.simulate("oracle", flat)
    assert oracle["expected_tokens_per_s"] >= 0.99 * fixed["expected_tokens_per_s"]


def test_goodput_cost_counts_the_proposers_own_time_and_reports_our_work():
    """The engine waits for the proposer too: the proposer base hands its
    previous step's time to the controller, which adds it to the step. Our
    own work per step (the bridge's top-k, the proposer) and the engine's
    time around the runner are reported apart (an idle wait longer than the
    step is not work)."""
    import time as _time

    from vllm_plugins.proposers.base import PluginProposer

    class Slow(PluginProposer):
        def draft(self, ctx):
            _time.sleep(0.02)
            return Drafts([[DRAFT_TOKEN] * 2 for _ in ctx.requests])

    p = Slow(None, {"draft_length": "goodput"}, vocab_size=16)
    seen = []
    for gap in (None, 0.01, 0.01, 0.2):
        ctx = StepContext([request_step("a", 2, 1)], max_draft=D, last_step_seconds=0.05,
                          last_step_tokens=3, last_topk_seconds=0.004,
                          last_gap_seconds=gap)
        p.step(ctx)
        seen.append(ctx.last_propose_seconds)
    assert seen[0] is None and all(s >= 0.02 for s in seen[1:]), seen
    recorded = p.controller.cost._y[:4]
    assert recorded[0] == pytest.approx(0.05)
    assert recorded[1:] == pytest.approx(0.05 + np.array(seen[1:]))
    rest, awake = p.controller.rest.modes.own_seconds(1)
    assert rest == 0.0   # no resting step timed yet
    w = 0.5 ** (np.arange(len(seen) - 2, -1, -1) / ModeRates._HALF_LIFE)  # decayed
    assert awake == pytest.approx(0.004 + np.average(seen[1:], weights=w), rel=1e-9)
    stats = p.controller.stats()
    assert stats["own_ms_per_step"]["1"][1] == pytest.approx(1e3 * awake, abs=1e-3)
    assert 0 < stats["engine_gap_ms"] < 10   # 10 ms gaps, then one idle wait


def test_goodput_prices_each_step_at_its_requests_context():
    """With ``cost_features: "tokens+batch+context"`` the policy hands the
    cost model each timed step's committed tokens (the context its forward
    read: the requests' tokens before this step's output), and decides the
    next step at its requests' context now. Two requests, 400 and 900
    tokens long, each emitting 3 tokens a step; the step time follows the
    curve of ``test_context_term_keeps_long_prompts_out_of_the_slope``."""
    from vllm_plugins.step_context import RequestStep

    c = make_policy("goodput", cost_features="tokens+batch+context", warmup=4, rest=False)
    plain = make_policy("goodput", warmup=4, rest=False)
    lengths = np.array([400, 900])
    seconds = None
    for step in range(24):
        num_draft = 2 + step % 3          # what the step that just ran verified
        reqs = [RequestStep(req_id=f"r{i}", accepted=np.full(3, DRAFT_TOKEN, np.int64),
                            context=np.zeros(n, np.int64), num_prompt_tokens=100,
                            num_draft=num_draft, verified_tokens=np.zeros(num_draft + 1, np.int64),
                            topk_ids=None, topk_logprobs=None, temperature=0.0)
                for i, n in enumerate(lengths)]
        for policy in (c, plain):
            ctx = StepContext(requests=reqs, max_draft=D, last_step_seconds=seconds,
                              last_step_tokens=2 * (num_draft + 1), last_propose_seconds=0.0)
            policy.decide(ctx, Drafts([[DRAFT_TOKEN] * D] * 2), policy.observe(ctx))
        if seconds is not None:
            # The step that just ran read the committed tokens before its output.
            assert c.cost.num_observed == step
            assert c.cost._x[(step - 1) % c.cost.window, 5] == (lengths - 3).sum()
        assert c.cost.context_now == lengths.sum()     # the step being decided
        assert plain.cost.context_now == 0.0 and not plain.cost._x[:, 5].any()
        # The next step: it reads these tokens and verifies the next count.
        seconds = 0.09 + 0.00004 * lengths.sum() + 0.007 * 2 * (3 + (step + 1) % 3)
        lengths = lengths + 3
    got = c.cost.coefficients()
    assert got["per_context_token_s"] == pytest.approx(0.00004, rel=0.05), got
    assert got["per_token_s"] == pytest.approx(0.007, rel=0.05), got


def test_the_proposer_cost_bench_times_the_controller_on_synthetic_step_times():
    """``proposer-cost --draft-length goodput --parts``: the controller's own
    time is a part, and the steps' synthetic times make its decisions the
    same on every run (what the bench compares across commits)."""
    from vllm_plugins.bench import proposer_cost

    args = proposer_cost.parse_args(["--steps", "40", "--warmup", "5", "--prompt", "40",
                                     "--distinct", "20", "--output", "30", "--batch-sizes",
                                     "1", "--draft-length", "goodput", "--flush-mb", "1",
                                     "--parts"])
    methods = {"token_recycling": proposer_cost.DEFAULT_METHODS["token_recycling"]}
    first, again = (proposer_cost.run(methods, args.batch_sizes, args)[0] for _ in range(2))
    assert first["parts_ms"]["controller"] > 0
    assert first["nodes_per_step"] == again["nodes_per_step"]
    assert first["accepted_per_step"] == again["accepted_per_step"]


@pytest.mark.parametrize("policy", ["acceptance", "confidence", "goodput"])
def test_a_new_controller_has_its_loops_compiled_and_its_state_untouched(policy, monkeypatch):
    """``make_controller`` runs a twin through synthetic steps, so numba
    compiles (or loads) the controller's loops then, not in the engine's
    first steps; the controller it returns has seen nothing."""
    import numba.core.dispatcher as dispatcher

    from tests.draft_length_world import World

    c = make_controller(policy, {}, D)
    assert c.steps == 0 and len(c.slots) == 0 and c.stats()["decisions"] == 0
    compiled = []
    real = dispatcher.Dispatcher.compile
    monkeypatch.setattr(dispatcher.Dispatcher, "compile",
                        lambda self, sig: compiled.append(self.py_func.__name__) or real(self, sig))
    World(c, batch=2, seed=1).run(0.6, 30)
    assert compiled == []
