"""The hybrid weighs each source's host time against the tokens only it
brings: a source that costs more than it returns is switched off, comes back
to be measured now and then, and one source always stays on."""

import time

import numpy as np

from vllm_plugins.proposers.sources import DraftSource, SourceTree
from vllm_plugins.proposers.sources.costs import SourceCosts
from vllm_plugins.step_context import StepContext

from tests.test_hybrid import VOCAB, hybrid, request


def run(costs, steps, seconds, alone_per_step, tokens=2, step_s=0.01):
    alone = np.zeros(len(seconds))
    history = []
    for _ in range(steps):
        for k, s in enumerate(seconds):
            if costs.on[k]:
                costs.add(k, s)
                alone[k] += alone_per_step[k]
        costs.end_step(tokens, step_s, alone.copy())
        history.append(costs.on.copy())
    return np.array(history)


def test_a_source_that_costs_more_than_it_brings_goes_off_and_is_probed_again():
    # Source 0: 1 ms a step for 0.5 tokens of 2 in a 10 ms step (25% of the
    # tokens for 10% of the time): pays. Source 1: 1 ms for nothing: off.
    costs = SourceCosts(2)
    on = run(costs, SourceCosts.WARMUP + SourceCosts.PROBE_GAP + SourceCosts.PROBE_STEPS + 8,
             [0.001, 0.001], [0.5, 0.0])
    assert on[:SourceCosts.WARMUP - 1].all()              # measured first
    assert on[:, 0].all()
    first_off = int(np.argmin(on[:, 1]))
    assert first_off == SourceCosts.WARMUP - 1
    back = first_off + SourceCosts.PROBE_GAP
    assert not on[first_off:back, 1].any()                 # off for the gap
    assert on[back:back + SourceCosts.PROBE_STEPS, 1].all()   # then probed
    assert not on[-1, 1]                                    # and off again
    assert costs.off_steps[1] > SourceCosts.PROBE_GAP and costs.off_steps[0] == 0


def test_a_source_pays_when_its_share_of_tokens_beats_its_share_of_time():
    # 0.1 of 2 tokens (5%) for 0.4 ms of 10 (4%) pays; for 0.6 ms (6%) it does not.
    for cost, kept in ((0.0004, True), (0.0006, False)):
        costs = SourceCosts(2)
        on = run(costs, SourceCosts.WARMUP + 4, [0.0001, cost], [1.0, 0.1])
        assert on[-1, 1] == kept, cost


def test_one_source_always_stays_on():
    costs = SourceCosts(3)
    on = run(costs, SourceCosts.WARMUP + 40, [0.005, 0.001, 0.003], [0.0, 0.0, 0.0])
    assert on.any(1).all()
    assert on[-1].tolist() == [False, True, False]   # none brings a token: the cheapest


def test_off_by_option_every_source_runs():
    costs = SourceCosts(2, enabled=False)
    assert run(costs, SourceCosts.WARMUP + 40, [0.01, 0.01], [0.0, 0.0]).all()


class Copy(DraftSource):
    """Drafts the context's last token again; ``spin`` seconds of work first."""

    calls = 0

    def propose(self, request, budget):
        type(self).calls += 1
        end = time.perf_counter() + self.options["spin"]
        while time.perf_counter() < end:
            pass
        return SourceTree.chain([int(request.context[-1])], [0.9])


def test_the_hybrid_stops_asking_a_slow_source_that_adds_nothing():
    p = hybrid(sources=["ngram"])
    fast, slow = Copy({"spin": 0.0}, VOCAB, 4), Copy({"spin": 0.002}, VOCAB, 4)
    p.sources, p.source_names = [fast, slow], ("fast", "slow")
    p.merger, p.calibrator = type(p.merger)(2), type(p.calibrator)(2, 4)
    p.costs = type(p.costs)(2)
    for name in ("source_errors", "source_nodes", "source_accepted", "source_alone"):
        setattr(p, name, np.zeros(2, int))
    slow_calls = []
    context = [7, 7]
    for step in range(SourceCosts.WARMUP + 20):
        before = Copy.calls
        ctx = StepContext([request(context, [7])], max_draft=4, last_step_seconds=0.004)
        p.step(ctx)
        slow_calls.append(Copy.calls - before)
        context = context + [7]
    # Both proposed the same token: nothing was the slow one's alone.
    assert slow_calls[0] == 2 and slow_calls[-1] == 1
    assert not p.costs.on[1] and p.costs.on[0]
    assert p.counters()["source_off_steps"]["slow"] > 0
    assert p.metrics()["sources"]["slow"]["on"] is False
