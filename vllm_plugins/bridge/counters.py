"""Our counters, from a worker's runner state to vLLM's Prometheus ``/metrics``.

They travel vLLM's own stat path, the one its ``spec_decode`` counters take:

  worker        ``Worker.sample_tokens`` (patch ``worker.step_reports``,
                ``bridge/worker_report.py``): ``take_growth`` reads the
                runner's ``RunnerState``; what grew since the last report
                rides the step's ``ModelRunnerOutput`` as ``OUTPUT_ATTR``
  engine core   ``Scheduler.update_from_output`` puts it on the step's
                ``SchedulerStats`` (field ``STATS_FIELD``, added by patch
                ``metrics.scheduler_stats_field``), which vLLM sends to the
                front end with every step's outputs
  front end     ``PluginStatLogger`` (``bridge/stat_logger.py``), beside
                vLLM's ``PrometheusStatLogger``, adds it to counters named
                ``vllm_plugins:<name>`` with vLLM's labels ``model_name`` and
                ``engine`` (a data-parallel rank's index)

Reports are increments, not totals: whichever front end (API server) gets a
step's stats adds that step's growth, so counters summed over API servers
and over data-parallel engines are exact. The output rank's counters are
read: tensor-parallel ranks draft alike (``bridge/ranks.py``).

``take_growth`` takes a ``RunnerState`` and the runner's ``Counted`` logits
processors (``vllm_plugins/counted.py``), nothing else of the runner, so
any adapter that keeps one (the V1 runner's, V2's) feeds the same path
through it. An engine that runs only our grammar processor
reports its counters too, from its first count on (a state without a proposer keeps
the last report; until then the engine holds nothing of ours).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable

from vllm_plugins.bridge.processors import of_kind
from vllm_plugins.bridge.state import attach, state_of
from vllm_plugins.counted import Counted

#: ModelRunnerOutput attribute: {metric: {label value: increment}}.
OUTPUT_ATTR = "vllm_plugins_counters"
#: SchedulerStats field: the same, summed over the steps of one report.
STATS_FIELD = "vllm_plugins"
#: Prefix of every metric, as vLLM's own are "vllm:<name>".
PREFIX = "vllm_plugins:"


@dataclass(frozen=True)
class Metric:
    """One Prometheus counter: ``PREFIX + name``, vLLM's labels, and
    ``label`` when the counter is split further (None: not split)."""

    name: str
    documentation: str
    label: str | None = None


# Every metric, in docs/metrics.md's order (tests/test_metrics.py checks both).
METRICS: tuple[Metric, ...] = (
    Metric("steps", "Engine steps of a model runner drafting with a vllm-plugins method."),
    Metric("proposer_errors",
           "Steps whose proposer raised and so drafted nothing."),
    Metric("malformed_drafts",
           "Request drafts dropped because they broke the draft layout."),
    Metric("zero_draft_decisions",
           "Request steps offered a draft that the draft-length controller cut to none."),
    Metric("rest_steps",
           "Steps the goodput controller rested: no request drafted, because "
           "drafting was measured to cost more than it returned."),
    Metric("rest_probes", "Rests the goodput controller began to re-measure resting."),
    Metric("tree_steps", "Steps that verified tree drafts."),
    Metric("tree_requests", "Tree drafts verified."),
    Metric("kv_moved_tokens",
           "Accepted tree nodes whose K/V moved to the slot chain decoding uses."),
    Metric("source_draft_nodes", "Draft nodes a hybrid source proposed.", "source"),
    Metric("source_accepted_tokens", "Accepted tokens a hybrid source had proposed.",
           "source"),
    Metric("source_errors", "Calls into a hybrid source that raised (its candidates dropped).",
           "source"),
    Metric("source_off_steps",
           "Request-steps a hybrid source was switched off for a drafting request "
           "that chose it: its host time outweighed the tokens only it brought that "
           "request.", "source"),
    Metric("grammar_failures",
           "Requests ended with finish reason error because their grammar could not "
           "follow the output (the grammar logits processor's requests)."),
    Metric("grammar_forced_tokens", "Draft tokens a request's grammar forced (grammar_forced)."),
    Metric("grammar_lost_requests",
           "Structured-output requests whose grammar grammar_forced lost track of "
           "(the inner method drafts for them after)."),
    Metric("grammar_unusable_requests",
           "Structured-output requests whose grammar grammar_forced could not use "
           "(the inner method drafts for them)."),
    Metric("awrs_tokens", 'Tokens the grammar processor decided with "sampling": "awrs".'),
    Metric("awrs_evaluations",
           "Grammar evaluations AWRS made: single-token checks, and a vocabulary's "
           "worth for each whole mask it fell back to."),
    Metric("awrs_masks", "AWRS rows that fell back to the whole mask."),
    Metric("awrs_check_calls", "Calls of requests' token checks (AWRS)."),
)
BY_NAME = {m.name: m for m in METRICS}

Snapshot = dict[str, dict[str, int]]
_NOTHING: dict[str, int] = {}   # a metric not reported before (never written)


def totals(state: Any, processors: Iterable[Counted] = ()) -> Snapshot:
    """Totals of one ``RunnerState`` (its step counters and its proposer's,
    where it has one) and of the runner's ``Counted`` logits processors, in
    fresh dicts: what ``take_growth``'s reports add up to."""
    out: Snapshot = {}
    proposer = state.proposer
    if proposer is not None:
        out = _step_counters(state.counters)
        _add_declared(out, proposer.counters())
    for counted in processors:
        _add_declared(out, counted.counters())
    return out


def _add_declared(out: Snapshot, reported: Snapshot) -> None:
    for name, values in reported.items():
        if name not in BY_NAME:
            continue
        have = out.get(name)
        if have is None:
            have = out[name] = {}
        for label, value in values.items():
            have[label] = have.get(label, 0) + int(value)


def counted_processors(runner: Any) -> tuple[Counted, ...]:
    """The runner's logits processors that keep counters: V1's in its input
    batch (``InputBatch.logitsprocs``), V2's in its sampler
    (``Sampler.logits_processors``)."""
    procs = getattr(getattr(runner, "input_batch", None), "logitsprocs", None)
    if procs is not None:
        return of_kind(procs, Counted)
    sampler = getattr(runner, "sampler", None)
    if sampler is None:
        return ()
    return of_kind(sampler, Counted, _sampler_processors)


def _sampler_processors(sampler: Any) -> Iterable:
    return getattr(sampler, "logits_processors", None) or ()


def any_counted(processors: Iterable[Counted]) -> bool:
    """Whether any of ``processors`` counted anything yet."""
    return any(v for p in processors for values in p.counters().values()
               for v in values.values())


def add(total: Snapshot, more: Snapshot) -> Snapshot:
    for name, values in more.items():
        merged = total.setdefault(name, {})
        for label, value in values.items():
            merged[label] = merged.get(label, 0) + value
    return total


def take_growth(state: Any, processors: Iterable[Counted] = ()) -> Snapshot:
    """What ``state``'s counters (and ``processors``') grew since the last
    call, which it marks as reported: for a step whose output reaches the
    scheduler. Each reporter is compared with its own last report, a metric
    at a time, and no totals are built: an unchanged metric, most of them
    on most steps, costs one dict comparison. The reports add up to
    ``totals``; a reporter that goes (a replaced input batch's processors)
    takes its last report with it, and a new one reports from zero."""
    last = state.counters_reported
    grown: Snapshot = {}
    reporters = 0
    proposer = state.proposer
    if proposer is not None:
        _grow_steps(grown, last, state.counters)
        _grow(grown, last, proposer, proposer.counters())
        reporters = 2
    for counted in processors:
        _grow(grown, last, counted, counted.counters())
        reporters += 1
    if len(last) > reporters:
        keep = {id(state.counters), id(proposer), *map(id, processors)}
        for key in [key for key in last if key not in keep]:
            del last[key]
    return grown


#: The bridge's own step counters (``StepCounters``' fields, ``_step_values``).
_STEP_METRICS = ("steps", "malformed_drafts", "tree_steps", "tree_requests", "kv_moved_tokens")


def _step_values(c: Any) -> tuple[int, ...]:
    return c.steps, c.malformed_drafts, c.tree_steps, c.tree_requests, c.kv_moved


def _step_counters(c: Any) -> Snapshot:
    return {name: {"": value} for name, value in zip(_STEP_METRICS, _step_values(c))}


def _grow_steps(grown: Snapshot, last: dict, c: Any) -> None:
    """``_grow`` of the bridge's step counters, kept as one tuple: they
    change every step, and a tuple is cheaper to build and compare than a
    dict per metric. No other reporter reports these metrics."""
    values = _step_values(c)
    kept = last.get(id(c))
    before = kept[1] if kept is not None and kept[0] is c else (0,) * len(values)
    if values == before:
        return
    last[id(c)] = (c, values)
    for name, now, was in zip(_STEP_METRICS, values, before):
        if now > was:
            grown[name] = {"": now - was}


def _grow(grown: Snapshot, last: dict, reporter: Any, reported: Snapshot) -> None:
    """Adds what ``reported`` grew since ``reporter``'s last report to
    ``grown``, and keeps a copy of each changed metric (a reporter may hand
    out its own dicts and change them later)."""
    kept = last.get(id(reporter))
    if kept is None or kept[0] is not reporter:
        kept = last[id(reporter)] = (reporter, {})
    before = kept[1]
    for name, values in reported.items():
        was_values = before.get(name, _NOTHING)
        if values == was_values or name not in BY_NAME:
            continue
        more = grown.get(name)
        for label, value in values.items():
            was = was_values.get(label, 0)
            if value > was:
                if more is None:
                    more = grown[name] = {}
                more[label] = more.get(label, 0) + int(value - was)
        before[name] = dict(values)


def runner_growth(runner: Any) -> Snapshot:
    """``take_growth`` of a runner's state and its counted processors; a
    runner with only our logits processors gets a state to keep its last
    report in once they counted something (a state without a proposer
    drafts nothing; an engine whose requests used nothing of ours keeps
    nothing of ours)."""
    state = state_of(runner)
    processors = counted_processors(runner)
    if state is None:
        if not processors or not any_counted(processors):
            return {}
        state = attach(runner)
    elif not processors and state.proposer is None:
        return {}
    return take_growth(state, processors)


def to_scheduler_stats(engine_core_outputs: dict, model_runner_output: Any,
                       grammar_failures: int = 0) -> None:
    """After ``Scheduler.update_from_output``: the worker's reported growth,
    and the requests the scheduler ended on a grammar failure, onto the
    step's ``SchedulerStats`` (on one client's outputs, as vLLM sends them).
    Growth on a step without stats (stats off) is dropped, as vLLM drops its
    own then."""
    grown = dict(getattr(model_runner_output, OUTPUT_ATTR, None) or {})
    if grammar_failures:
        grown["grammar_failures"] = {"": grammar_failures}
    if not grown or not engine_core_outputs:
        return
    for outputs in engine_core_outputs.values():
        stats = getattr(outputs, "scheduler_stats", None)
        if stats is not None:
            setattr(stats, STATS_FIELD, add(getattr(stats, STATS_FIELD) or {}, grown))
            return


def add_stats_field(_missing):
    # vllm.v1.metrics.stats.SchedulerStats: a dataclass that msgspec encodes
    # field by field from the engine core to the front end (EngineCoreOutputs
    # .scheduler_stats); an attribute outside its fields would be dropped.
    # The field is declared (not an __init__ argument, default None) so that
    # it travels; its value lives in the instance's __dict__.
    import dataclasses

    from vllm.v1.metrics.stats import SchedulerStats

    field = dataclasses.field(default=None, init=False, repr=False, compare=False)
    field.name = STATS_FIELD
    field.type = dict[str, Any] | None
    field._field_type = dataclasses._FIELD  # what dataclasses.fields() lists
    SchedulerStats.__dataclass_fields__[STATS_FIELD] = field
    SchedulerStats.__annotations__[STATS_FIELD] = dict[str, Any] | None

    def get(self):
        return self.__dict__.get(STATS_FIELD)

    def set_(self, value):
        self.__dict__[STATS_FIELD] = value

    return property(get, set_, doc="vllm-plugins counters grown in this report")


def wrap_stat_logger_manager(original):
    # vllm.v1.metrics.loggers.StatLoggerManager.__init__(self, vllm_config,
    #     engine_idxs=None, custom_stat_loggers=None, ...) fills
    # self.stat_loggers (AggregateStatLoggerBase instances) and
    # self.engine_indexes; its record() then passes every engine's
    # SchedulerStats to each logger's record(..., engine_idx=).
    @functools.wraps(original)
    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        from vllm_plugins.bridge.stat_logger import PluginStatLogger

        self.stat_loggers.append(PluginStatLogger(vllm_config, self.engine_indexes))

    return __init__
