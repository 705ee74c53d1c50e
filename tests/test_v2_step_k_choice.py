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


def brute_force(q, valid, a, b, vs):
    batch, width = q.shape
    best = (-1.0, 0)
    for k in range(width + 1):
        tokens = batch + sum(q[i, j] for i in range(batch) for j in range(k) if valid[i, j])
        cost = a + b * batch * (1 + k) + (vs if k else 0.0)
        best = max(best, (tokens / cost, -k))
    return -best[1], best[0]


@pytest.mark.parametrize("seed", range(20))
def test_uniform_step_k_is_the_best_k_for_the_whole_batch(seed):
    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 6)), int(rng.integers(1, 7))
    q = np.cumprod(rng.uniform(0.2, 1.0, (batch, width)), axis=1)
    valid = np.arange(width)[None, :] < rng.integers(0, width + 1, batch)[:, None]
    a, b, vs = rng.uniform(0.01, 0.05), rng.uniform(1e-4, 5e-3), rng.uniform(0, 3e-3)
    k, goodput, _ = uniform_step_k(q, valid, a, b, vs)
    want_k, want_goodput = brute_force(q, valid, a, b, vs)
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
    from_output(scheduler, SimpleNamespace())   # nothing reported: untouched
    assert scheduler.dynamic_sd_lookup is configured
    from_output(scheduler, SimpleNamespace(**{OUTPUT_ATTR: {"k": 3}}))
    lookup = scheduler.dynamic_sd_lookup
    assert isinstance(lookup, ChosenStepK) and lookup.chosen == 3
    assert lookup[1] == 3 and lookup[2] == (3 if configured is None else 2)
    from_output(scheduler, SimpleNamespace(**{OUTPUT_ATTR: {"k": 9}}))
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
