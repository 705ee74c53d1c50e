"""Our /metrics counters: every one documented, reports that add up.

The path through vLLM is pinned in tests/test_bridge_pins_metrics.py and
run on a real server in tests/test_data_parallel_server_e2e.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from types import SimpleNamespace

from vllm_plugins.bridge.counters import (
    METRICS, PREFIX, add, counted_processors, take_growth, totals,
)
from vllm_plugins.bridge.state import RunnerState
from vllm_plugins.counted import Counted

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def test_docs_list_every_metric_and_no_other():
    rows = re.findall(r"^\| `(vllm_plugins:\w+?)_total(?:\{(\w+)\})?` \|", DOC.read_text(),
                      flags=re.M)
    assert rows == [(PREFIX + m.name, m.label or "") for m in METRICS]


class Proposer:
    """What totals reads of a proposer: its declared counters()."""

    def __init__(self):
        self.totals = {"proposer_errors": {"": 1}, "source_errors": {"ngram": 2},
                       "not_a_metric": {"": 9}}

    def counters(self):
        return self.totals


def test_reports_carry_growth_that_adds_up_to_the_totals():
    state = RunnerState(proposer=Proposer())
    state.counters.steps = 4
    first = take_growth(state)
    assert first["steps"] == {"": 4}
    assert first["source_errors"] == {"ngram": 2}
    assert "not_a_metric" not in first  # only declared metrics travel
    assert "tree_steps" not in first  # a total of zero grew nothing
    state.counters.steps = 7
    # A reporter that changes the dict it handed out: the reports kept are copies.
    state.proposer.totals["source_errors"]["suffix"] = 1
    second = take_growth(state)
    assert second == {"steps": {"": 3}, "source_errors": {"suffix": 1}}
    assert take_growth(state) == {}
    assert add(add({}, first), second) == grown_from_zero(totals(state))


def grown_from_zero(snapshot):
    return {name: {label: v for label, v in values.items() if v}
            for name, values in snapshot.items() if any(values.values())}


def test_a_replaced_reporter_reports_from_zero_and_leaves_no_record():
    state = RunnerState()
    old, new = Processor(5), Processor(2)
    assert take_growth(state, [old]) == {"awrs_evaluations": {"": 5}}
    old.evaluations = 6
    assert take_growth(state, [new]) == {"awrs_evaluations": {"": 2}}
    assert [kept for kept, _ in state.counters_reported.values()] == [new]
    new.evaluations = 3
    assert take_growth(state, [new]) == {"awrs_evaluations": {"": 1}}


def test_proposers_declare_only_known_metrics():
    from vllm_plugins.bridge.counters import BY_NAME
    from vllm_plugins.proposers.grammar import GrammarProposer
    from vllm_plugins.proposers.hybrid import HybridProposer

    hybrid = HybridProposer(None, {"sources": ["token_recycling", "ngram"]},
                            vocab_size=64)
    grammar = GrammarProposer(None, options={"inner": {"method": "token_recycling"}},
                              vocab_size=64)
    for proposer in (hybrid, grammar):
        counters = proposer.counters()
        assert set(counters) <= set(BY_NAME), set(counters) - set(BY_NAME)
        assert counters["proposer_errors"] == {"": 0}
    assert set(hybrid.counters()["source_errors"]) == {"token_recycling", "ngram"}
    assert {"rest_steps", "zero_draft_decisions"} <= set(hybrid.counters())  # goodput
    assert grammar.counters()["grammar_forced_tokens"] == {"": 0}
    hybrid.num_errors = 2
    assert totals(RunnerState(proposer=hybrid))["proposer_errors"] == {"": 2}


def test_the_scheduler_adds_grammar_failures_to_the_steps_stats():
    from types import SimpleNamespace

    from vllm_plugins.bridge.counters import OUTPUT_ATTR, STATS_FIELD, to_scheduler_stats

    stats = SimpleNamespace(**{STATS_FIELD: None})
    outputs = {0: SimpleNamespace(scheduler_stats=None),
               1: SimpleNamespace(scheduler_stats=stats)}
    worker = SimpleNamespace(**{OUTPUT_ATTR: {"steps": {"": 1}}})
    to_scheduler_stats(outputs, worker, grammar_failures=2)
    assert getattr(stats, STATS_FIELD) == {"steps": {"": 1}, "grammar_failures": {"": 2}}
    to_scheduler_stats(outputs, SimpleNamespace(), grammar_failures=0)  # nothing grew
    to_scheduler_stats(outputs, worker)
    assert getattr(stats, STATS_FIELD)["steps"] == {"": 2}


class Processor(Counted):
    """A logits processor that declares its counters."""

    def __init__(self, evaluations):
        self.evaluations = evaluations

    def counters(self):
        return {"awrs_evaluations": {"": self.evaluations}}


def test_logits_processors_counters_travel_without_a_proposer():
    state = RunnerState()  # a runner with only our grammar processor
    state.counters.steps = 5  # not ours to report: nothing of ours drafts
    assert totals(state, [Processor(7), Processor(2)]) == {"awrs_evaluations": {"": 9}}
    drafting = RunnerState(proposer=Proposer())
    both = totals(drafting, [Processor(3)])
    assert both["awrs_evaluations"] == {"": 3} and both["proposer_errors"] == {"": 1}


def test_counted_processors_are_found_on_either_runner():
    ours, theirs = Processor(1), object()
    v1 = SimpleNamespace(input_batch=SimpleNamespace(
        logitsprocs=SimpleNamespace(all=[theirs, ours])))
    v2 = SimpleNamespace(sampler=SimpleNamespace(logits_processors=[ours, theirs]))
    assert counted_processors(v1) == (ours,)
    assert counted_processors(v2) == (ours,)
    assert counted_processors(SimpleNamespace()) == ()


def test_the_worker_hook_reports_every_growth_once():
    """Through the patched ``Worker.sample_tokens``: a runner with only our
    processors carries nothing of ours until they count; from then on, and
    on a drafting runner, the reports add up to the totals, steps with no
    growth report nothing, and a new input batch's processors are read."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.sample.logits_processor.state import LogitsProcessors

    from vllm_plugins.bridge.counters import OUTPUT_ATTR
    from vllm_plugins.bridge.state import attach, state_of
    from vllm_plugins.bridge.worker_report import wrap_worker_sample_tokens

    class Batch:
        def __init__(self, *procs):
            self.logitsprocs = LogitsProcessors()
            self.logitsprocs.non_argmax_invariant.extend(procs)

    class Runner:
        pass

    sample_tokens = wrap_worker_sample_tokens(
        lambda worker, grammar_output: ModelRunnerOutput(req_ids=[], req_id_to_index={}))
    reported = {}

    def step(worker):
        out = sample_tokens(worker, None)
        add(reported, getattr(out, OUTPUT_ATTR, {}))
        return getattr(out, OUTPUT_ATTR, None)

    plain = SimpleNamespace(model_runner=Runner())
    processor = Processor(0)
    plain.model_runner.input_batch = Batch(object(), processor)
    assert step(plain) is None and state_of(plain.model_runner) is None
    processor.evaluations = 4
    assert step(plain) == {"awrs_evaluations": {"": 4}}
    assert step(plain) is None
    plain.model_runner.input_batch = Batch(Processor(3), processor)  # a new batch
    assert step(plain) == {"awrs_evaluations": {"": 3}}

    drafting = SimpleNamespace(model_runner=Runner())
    drafting.model_runner.input_batch = Batch()
    state = attach(drafting.model_runner, Proposer())
    reported.clear()
    for n in range(1, 6):
        state.counters.steps = n
        if n == 3:
            state.proposer.totals["source_errors"] = {"ngram": 2, "suffix": 5}
        step(drafting)
    assert reported == grown_from_zero(totals(state)) == {"steps": {"": 5}, "proposer_errors": {"": 1},
                                 "source_errors": {"ngram": 2, "suffix": 5}}
    assert step(drafting) is None   # nothing grew
