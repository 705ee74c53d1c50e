"""Our controller choosing Model Runner V2's batch-wide k (no engine).

V2 verifies one k for every request, padding shorter drafts, so the goodput
rule there weighs k for the whole batch (``uniform_step_k``), the choice
rides the step's output (``bridge.v2.step_k``), and the scheduler's
``dynamic_sd_lookup`` becomes the configured k capped by it.
"""

from __future__ import annotations

from itertools import product
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_plugins.bridge.v2.step_k import OUTPUT_ATTR, ChosenStepK, from_output
from vllm_plugins.proposers.draft_length.goodput import uniform_step_k


def brute_force(q, valid, a, b, vs, by_count=()):
    batch, width = q.shape
    best = (-1.0, 0)
    for k in range(width + 1):
        tokens = batch + sum(q[i, j] for i in range(batch) for j in range(k) if valid[i, j])
        cost = a + b * batch * (1 + k) + (vs if k else 0.0)
        if batch * (1 + k) < len(by_count):
            cost += by_count[batch * (1 + k)]
        best = max(best, (tokens / cost, -k))
    return -best[1], best[0]


@pytest.mark.parametrize("seed", range(20))
def test_uniform_step_k_is_the_best_k_for_the_whole_batch(seed):
    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    q = np.cumprod(rng.uniform(0.2, 1.0, (batch, width)), axis=1)
    valid = np.arange(width)[None, :] < rng.integers(0, width + 1, batch)[:, None]
    a, b, vs = rng.uniform(0.01, 0.05), rng.uniform(1e-4, 5e-3), rng.uniform(0, 3e-3)
    by_count = rng.uniform(-5e-3, 1e-2, int(rng.integers(0, batch * (width + 1) + 2)))
    k, goodput, _ = uniform_step_k(q, valid, a, b, vs, by_count if seed % 2 else None)
    want_k, want_goodput = brute_force(q, valid, a, b, vs, by_count if seed % 2 else ())
    assert k == want_k
    assert goodput == pytest.approx(want_goodput)


def test_a_draft_that_only_one_row_offers_costs_every_row():
    """Two rows, the second offers nothing: a k that pays for one row at
    batch 1 may not pay when the runner verifies it for both."""
    q = np.array([[0.5, 0.25]])
    valid = np.ones_like(q, dtype=bool)
    a, b = 0.02, 0.004
    assert uniform_step_k(q, valid, a, b)[0] == 2
    q2 = np.vstack([q, [0.0, 0.0]])
    valid2 = np.array([[True, True], [False, False]])
    k2 = uniform_step_k(q2, valid2, a, b)[0]
    assert k2 < 2


def test_the_chosen_k_caps_the_configured_k_by_batch_size():
    lookup = ChosenStepK([0, 3, 2, 1], num_spec_tokens=3)
    assert [lookup[b] for b in (1, 2, 3)] == [3, 2, 1]
    lookup.chosen = 2
    assert [lookup[b] for b in (1, 2, 3)] == [2, 2, 1]
    unconfigured = ChosenStepK(None, num_spec_tokens=4)
    unconfigured.chosen = 0
    assert unconfigured[7] == 0


@pytest.mark.parametrize("configured", [None, [0, 4, 2]])
def test_a_reported_k_reaches_the_scheduler_and_nothing_else_does(configured):
    scheduler = SimpleNamespace(dynamic_sd_lookup=configured, num_spec_tokens=4)
    from_output(scheduler, None, SimpleNamespace())   # nothing reported: untouched
    assert scheduler.dynamic_sd_lookup is configured
    from_output(scheduler, None, SimpleNamespace(**{OUTPUT_ATTR: {"k": 3}}))
    lookup = scheduler.dynamic_sd_lookup
    assert isinstance(lookup, ChosenStepK) and lookup.chosen == 3
    assert lookup[1] == 3 and lookup[2] == (3 if configured is None else 2)
    from_output(scheduler, None, SimpleNamespace(**{OUTPUT_ATTR: {"k": 9}}))
    assert scheduler.dynamic_sd_lookup is lookup and lookup.chosen == 4


def _ctx(step_k, history, steers=True):
    """Request 'a' at batch 1: it emitted ``history`` (accepted drafts and
    the sampled token) after drafts of which ``step_k`` were verified."""
    from vllm_plugins.step_context import RequestStep, StepContext

    context = np.arange(1, 20 + len(history), dtype=np.int64)
    n = len(history) - 1
    return StepContext(
        requests=[RequestStep(req_id="a", accepted=context[-len(history):],
                              context=context, num_prompt_tokens=8,
                              num_draft=step_k, verified_tokens=context[-len(history) - 1:-1]
                              if n else context[-1:],
                              topk_ids=None, topk_logprobs=None, temperature=0.0)],
        max_draft=step_k, last_step_seconds=0.03, last_step_tokens=1 + step_k,
        steers_step_k=steers)


def _controller():
    from vllm_plugins.proposers.draft_length import make_controller

    return make_controller("goodput", {"warmup_explore": 0.0, "explore": 0.0}, 4)


def test_the_controller_drafts_past_the_steps_k_and_keeps_up_to_it():
    """This step's drafts are verified at the scheduler's k whatever is
    kept; the rule weighs drafts past it for the next step's k."""
    from vllm_plugins.step_context import Drafts

    controller = _controller()
    ctx = _ctx(2, [5])
    observation = controller.observe(ctx)
    assert observation.step_k == 2
    assert controller.max_length("a", observation) > 2   # past the step's k
    keep = controller.decide(ctx, Drafts([[1, 2, 3, 4]], confidence=[np.ones(4)]),
                             observation)
    assert keep == [2]
    assert controller.next_step_k is not None and 0 <= controller.next_step_k <= 4


def test_without_steering_the_controller_chooses_no_step_k():
    from vllm_plugins.step_context import Drafts

    controller = _controller()
    ctx = _ctx(2, [5], steers=False)
    observation = controller.observe(ctx)
    assert observation.step_k is None
    controller.decide(ctx, Drafts([[1, 2]]), observation)
    assert controller.next_step_k is None


def test_a_run_of_zero_ks_is_broken_by_a_probe():
    """With k = 0 nothing is verified and the estimates cannot move: one
    step in ``_STEP_K_PROBE_GAP`` verifies a draft."""
    controller = _controller()
    gap = controller._STEP_K_PROBE_GAP
    chosen = []
    for _ in range(2 * gap):
        controller._choose_next_step_k(0)
        chosen.append(controller.next_step_k)
    assert chosen.count(1) == 2 and chosen[gap - 1] == 1
    assert controller.stats()["step_k_probes"] == 2


def _world_step(chooser, k, alpha, batch, rng, a=0.02, b=0.002):
    """A step at k in a world where each draft is accepted with ``alpha``
    after the ones before it, and a step costs a + b tokens."""
    accepted = []
    for _ in range(batch):
        n = 0
        while n < k and rng.random() < alpha:
            n += 1
        accepted.append(n)
    tokens = batch * (1 + k)
    chooser.observe([k] * batch, accepted, a + b * tokens, tokens)


def _rates(alpha, batch, max_k, a=0.02, b=0.002):
    """Tokens per second at each k in that world."""
    return np.array([batch * sum(alpha ** j for j in range(k + 1)) / (a + b * batch * (1 + k))
                     for k in range(max_k + 1)])


@pytest.mark.parametrize("choose_every", [1, 2])
@pytest.mark.parametrize("alpha,batch", [(0.9, 1), (0.6, 4), (0.2, 16)])
def test_the_engine_cores_chooser_finds_the_best_k_from_counts_alone(alpha, batch,
                                                                      choose_every):
    """Only verified and accepted counts and step times: after warming up
    it settles on a k within 1% of the best tokens per second in that
    world (and far from the worst), choosing every step or every other;
    its acceptance is near the world's wherever its counts are many."""
    from vllm_plugins.proposers.draft_length.batch_k import BatchStepK

    rng = np.random.default_rng(0)
    chooser = BatchStepK(5, explore=0.0, choose_every=choose_every)
    k = 5
    for _ in range(400):
        _world_step(chooser, k, alpha, batch, rng)
        k = chooser.choose(batch)
    assert chooser.cost.warm
    counted = chooser.reached >= 5
    assert counted[0]
    assert np.allclose(chooser.acceptance()[counted], alpha, atol=0.15)
    recent = [chooser.choose(batch) for _ in range(20)]
    chosen = max(set(recent), key=recent.count)
    rates = _rates(alpha, batch, 5)
    assert rates[chosen] >= 0.99 * rates.max(), (recent, rates)
    assert rates.max() > 1.05 * rates.min()   # the world tells ks apart


def test_the_engine_core_chooses_where_the_drafter_asks_it_to():
    """``{"engine_core": 1}``: the step's scheduled drafts and sampled
    tokens feed the chooser, whose k caps the scheduler's."""
    scheduler = SimpleNamespace(dynamic_sd_lookup=None, num_spec_tokens=3,
                                running=["a", "b"])
    sched_out = SimpleNamespace(num_scheduled_tokens={"a": 4, "b": 4, "c": 9},
                                scheduled_spec_decode_tokens={"a": [-1] * 3, "b": [-1] * 3},
                                total_num_scheduled_tokens=17)
    runner_out = SimpleNamespace(req_id_to_index={"a": 0, "b": 1, "c": 2},
                                 sampled_token_ids=[[5, 6, 7], [8], []],
                                 **{OUTPUT_ATTR: {"engine_core": 1}})
    from_output(scheduler, sched_out, runner_out)
    lookup = scheduler.dynamic_sd_lookup
    chooser = lookup.chooser
    assert chooser is not None and sum(chooser.hist) == 1
    assert lookup.chosen == chooser.k
    # a: 2 of 3 accepted (positions 0, 1 reached and accepted, 2 reached);
    # b: none of 3 (position 0 reached); c, a prefill chunk, is not counted.
    fresh = type(chooser)(3)
    fresh.observe([3, 3], [2, 0], None, 17)
    assert np.allclose(chooser.acceptance(), fresh.acceptance())


@pytest.mark.parametrize("batch", [1, 3, 64, 256])
def test_the_engine_cores_compiled_counts_and_k_are_numpy_s(batch):
    """``BatchStepK``'s compiled counting and choice against the numpy
    they replace (``goodput.uniform_step_k`` over the batch's rows, the
    counts' decayed sums), step by step on random steps: the same counts
    to the bit and the same k."""
    from vllm_plugins.proposers.draft_length.batch_k import BatchStepK, _uniform_k
    from vllm_plugins.proposers.draft_length.goodput import uniform_step_k

    rng = np.random.default_rng(batch)
    wanted = set()
    chooser = BatchStepK(6, explore=0.0, warmup_explore=0.0)
    reached, hits = chooser.reached.copy(), chooser.accepted.copy()
    for _ in range(200):
        verified = rng.integers(0, 9, batch)
        accepted = rng.integers(-1, 9, batch)
        chooser.observe(verified.tolist(), accepted.tolist(), None, batch)
        new_reached, new_hits = np.zeros(6), np.zeros(6)
        for v, a in zip(verified, accepted):
            v = min(int(v), 6)
            if v > 0:
                a = max(0, min(int(a), v))
                new_reached[:min(a + 1, v)] += 1.0
                new_hits[:a] += 1.0
        if new_reached.any():
            reached = chooser.decay * reached + new_reached
            hits = chooser.decay * hits + new_hits
        assert np.array_equal(chooser.reached, reached)
        assert np.array_equal(chooser.accepted, hits)
        a, b, v = rng.uniform(0.001, 0.05), rng.uniform(1e-5, 3e-3), rng.uniform(0, 0.01)
        q = np.cumprod(hits / np.maximum(reached, 1e-12))[None, :]
        by_count = rng.uniform(-2e-3, 5e-3, int(rng.integers(0, 7 * batch + 2)))
        want = uniform_step_k(np.broadcast_to(q, (batch, 6)), np.ones((batch, 6), bool), a, b,
                              v, by_count)[0]
        assert _uniform_k(chooser.accepted, chooser.reached, batch, a, b, v, by_count) == want
        wanted.add(want)
    assert len(wanted) >= 3  # the steps tell ks apart


def test_a_choice_holds_for_choose_every_steps_of_one_batch_size():
    """Every step observes; a choice is made every ``choose_every`` steps,
    and at once where the batch size changed."""
    from vllm_plugins.proposers.draft_length.batch_k import BatchStepK

    chooser = BatchStepK(4, warmup_explore=1.0, choose_every=3)
    made = []
    for batch in (2, 2, 2, 2, 2, 5, 5, 5, 5):
        before = sum(chooser.hist)
        chooser.choose(batch)
        made.append(sum(chooser.hist) - before)
    assert made == [1, 0, 0, 1, 0, 1, 0, 0, 1]
