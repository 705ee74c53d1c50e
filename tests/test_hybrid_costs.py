"""The hybrid weighs each source's host time against the tokens only it
brings, request by request: a source that costs a request more than it
returns is off for that request, a new request starts from what the engine
knows, a source off for every request comes back to be measured now and
then, and each request keeps one source on."""

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_plugins.proposers import hybrid as hybrid_module
from vllm_plugins.proposers.sources import DraftSource, SourceTree
from vllm_plugins.proposers.sources.costs import SourceCosts
from vllm_plugins.step_context import StepContext

from tests.test_hybrid import VOCAB, hybrid, request


class WorkClock:
    """The hybrid's clock in these tests: it moves only by the work the test
    sources say they do, so the costs the hybrid measures are exactly that
    work, whatever else runs on the host (a busy host would stretch a
    spinning source's time and flip the decisions under test)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def spend(self, seconds: float) -> None:
        self.now += seconds


CLOCK = WorkClock()


@pytest.fixture(autouse=True)
def work_clock(monkeypatch):
    monkeypatch.setattr(hybrid_module, "time", SimpleNamespace(perf_counter=CLOCK))


def run(costs, steps, seconds, alone_per_step, tokens=2, step_s=0.01):
    """Steps of one request that chose every source: each source it asks
    costs ``seconds[k]`` and brings ``alone_per_step[k]`` tokens only it
    proposed. Returns the engine-wide ``on`` after each step."""
    every = tuple(range(len(seconds)))
    history = []
    for _ in range(steps):
        costs.join("r", every)
        asked = costs.ask("r")
        for k in asked.on:
            asked.seconds[k] += seconds[k]
        costs.outcomes(["r"], [[alone_per_step[k] if k in asked.on else 0 for k in every]])
        costs.end_step(tokens, step_s)
        history.append(costs.on.copy())
    return np.array(history)


@pytest.mark.parametrize("cost_s", [0.001, 0.0001])
def test_a_source_that_costs_more_than_it_brings_goes_off_and_is_probed_again(cost_s):
    # Source 0: 1 ms a step for 0.5 tokens of 2 in a 10 ms step (25% of the
    # tokens for 10% of the time): pays. Source 1 brings nothing: off, and
    # probed again after a gap its cost sets, so that its probes take
    # PROBE_SHARE of the engine's time (160 steps at 1 ms, 16 at 0.1 ms).
    gap = round(SourceCosts.PROBE_STEPS * cost_s / (SourceCosts.PROBE_SHARE * 0.01))
    costs = SourceCosts(2)
    on = run(costs, SourceCosts.WARMUP + gap + SourceCosts.PROBE_STEPS + 8,
             [0.001, cost_s], [0.5, 0.0])
    assert on[:SourceCosts.WARMUP - 1].all()              # measured first
    assert on[:, 0].all()
    first_off = int(np.argmin(on[:, 1]))
    assert first_off == SourceCosts.WARMUP - 1
    back = first_off + gap
    assert not on[first_off:back, 1].any()                 # off for the gap
    assert on[back:back + SourceCosts.PROBE_STEPS, 1].all()   # then probed
    assert not on[-1, 1]                                    # and off again
    assert costs.off_steps[1] > gap and costs.off_steps[0] == 0


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
    """Drafts the context's last token again after ``spin`` seconds of work
    (on ``CLOCK``)."""

    calls = 0

    def propose(self, request, budget):
        type(self).calls += 1
        CLOCK.spend(self.options["spin"])
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


# ------------------------------------------------------------ per request
class Spin(DraftSource):
    """Drafts one token after ``spin`` seconds of work (on ``CLOCK``): ``token``, or the
    context's last token plus ``shift``. Keeps the requests it was asked
    for, step by step, and counts its learn and sent calls."""

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        self.asked: list[list[str]] = []
        self.taught = 0

    def propose(self, request, budget):
        self.asked[-1].append(request.req_id)
        CLOCK.spend(self.options["spin"])
        token = self.options.get("token")
        if token is None:
            token = int(request.context[-1]) + self.options.get("shift", 0)
        return SourceTree.chain([token], [0.9])

    def learn(self, ctx):
        self.taught += 1

    def sent(self, ctx, drafts):
        self.taught += 1


def with_sources(sources, **options):
    """A hybrid of these ``{name: source}``, fresh counters and costs."""
    p = hybrid(sources=["ngram"], **options)
    k = len(sources)
    p.sources, p.source_names = list(sources.values()), tuple(sources)
    p.merger, p.calibrator = type(p.merger)(k), type(p.calibrator)(k, 4)
    p.costs = type(p.costs)(k, p.options["source_costs"])
    for name in ("source_errors", "source_nodes", "source_accepted", "source_alone"):
        setattr(p, name, np.zeros(k, int))
    return p


# The targets: "repeat" emits its last token again, "count" the next id.
NEXT = {"repeat": lambda c: c[-1], "count": lambda c: c[-1] + 1}


class Engine:
    """Steps of a hybrid over synthetic requests: each step the target
    emits its next token, and where the draft had it at the root, the one
    after too (one accepted token). A step takes 24 ms, the proposer's own
    time left out, so that the rule reads the sources' measured time only."""

    STEP_S = 0.024

    def __init__(self, p):
        self.p = p
        self.live: dict[str, list] = {}     # req_id: [kind, context, emitted, params]
        self.finished: set[str] = set()

    def add(self, req_id, kind, params=None):
        start = [7, 7, 7] if kind == "repeat" else [100, 101, 102]
        self.live[req_id] = [kind, start, start[-1:], params]

    def finish(self, req_id):
        del self.live[req_id]
        self.finished.add(req_id)

    def step(self):
        for s in self.p.sources:
            s.asked.append([])
        ctx = StepContext([request(c, e, req_id=i, params=params)
                           for i, (_, c, e, params) in self.live.items()],
                          max_draft=4, finished=self.finished,
                          last_step_seconds=self.STEP_S, last_propose_seconds=0.0)
        self.finished = set()
        d = self.p.step(ctx)
        for row, (i, (kind, context, _, _)) in enumerate(self.live.items()):
            tokens = d.tokens[row]
            parents = d.parents[row] if d.parents and d.parents[row] is not None \
                else range(-1, len(tokens) - 1)
            roots = [t for t, par in zip(tokens, parents) if par == -1]
            emitted = [NEXT[kind](context)]
            if emitted[0] in roots:
                emitted.append(NEXT[kind](context + emitted))
            self.live[i][1], self.live[i][2] = context + emitted, emitted
        return d

    def asked(self, name, steps):
        """The requests source ``name`` was asked for, over the last steps."""
        k = self.p.source_names.index(name)
        return {i for step in self.p.sources[k].asked[-steps:] for i in step}


def two_kinds(**options):
    """An engine past its warmup over a "repeat" and a "count" request, with
    sources that pay for one kind each (``copy``, ``next``: 1 ms for one
    token a step) and one that pays for none (``never``). In a 24 ms step
    of 4 tokens, a token pays for up to 6 ms: each source pays for its kind
    6x and for the mean request (half a token a step) 3x. For the other
    kind it stays off: the warmup's 30 steps without a token outweigh the 8
    steps of that mean unless a token paid for 9 ms or more."""
    p = with_sources({"copy": Spin({"spin": 0.001}, VOCAB, 4),
                      "next": Spin({"spin": 0.001, "shift": 1}, VOCAB, 4),
                      "never": Spin({"spin": 0.001, "token": VOCAB - 1}, VOCAB, 4)},
                     **options)
    engine = Engine(p)
    engine.add("r", "repeat")
    engine.add("c", "count")
    for _ in range(SourceCosts.WARMUP + 24):
        engine.step()
    return engine


def test_a_source_is_on_for_the_request_it_pays_for_and_off_for_the_other():
    engine = two_kinds()
    assert engine.asked("copy", 16) == {"r"}
    assert engine.asked("next", 16) == {"c"}
    assert engine.asked("never", 16) == set()
    table = engine.p.metrics()["sources"]
    assert table["copy"]["on"] and table["copy"]["requests_on"] == 1
    assert not table["never"]["on"] and table["never"]["requests_on"] == 0
    # Request-steps off: each request has had two sources off since the
    # step that ended the warmup.
    off, steps = engine.p.counters()["source_off_steps"], 24 + 1
    assert off["copy"] == off["next"] == steps and off["never"] == 2 * steps


def test_a_new_request_starts_from_what_the_engine_knows():
    """From its first step: on, the sources that pay for the mean request
    (copy and next, half a token a step each); off, the one that pays for
    none."""
    engine = two_kinds()
    engine.add("new", "repeat")
    engine.step()
    assert "new" in engine.asked("copy", 1) and "new" in engine.asked("next", 1)
    assert "new" not in engine.asked("never", 1)


def test_a_source_off_for_every_request_learns_nothing_until_a_request_names_it():
    engine = two_kinds()
    never = engine.p.sources[2]
    taught = never.taught
    for _ in range(4):
        engine.step()
    assert never.taught == taught and not engine.p.costs.on[2]
    copy_taught = engine.p.sources[0].taught
    engine.step()
    assert engine.p.sources[0].taught == copy_taught + 2   # learn and sent
    # A request naming only sources that are off drafts with the closest.
    params = SimpleNamespace(extra_args={"speculation": {"sources": ["never"]}},
                             temperature=0.0)
    engine.add("picky", "repeat", params)
    d = engine.step()
    assert d.tokens[list(engine.live).index("picky")] == [VOCAB - 1]
    assert engine.asked("never", 1) == {"picky"} and never.taught == taught + 2
    # Freed, it leaves the source off for every request again.
    engine.finish("picky")
    engine.step()
    taught = never.taught
    engine.step()
    assert never.taught == taught and engine.p.costs.requests.keys() == {"r", "c"}


def test_off_by_option_every_request_asks_every_source():
    engine = two_kinds(source_costs=False)
    assert all(engine.asked(name, 16) == {"r", "c"} for name in ("copy", "next", "never"))
    assert engine.p.counters()["source_off_steps"] == {"copy": 0, "next": 0, "never": 0}
