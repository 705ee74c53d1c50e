"""Pins the vLLM path our counters take to ``/metrics`` (bridge/counters.py).

worker ``Worker.sample_tokens`` -> the step's ``ModelRunnerOutput`` ->
``Scheduler.update_from_output`` -> ``SchedulerStats`` (msgspec, engine core
to front end) -> ``StatLoggerManager.record`` -> our ``PluginStatLogger``.
Each test fails the day vLLM changes the piece the bridge relies on.
"""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def installed():
    import vllm_plugins

    vllm_plugins.register()


def test_worker_sample_tokens_returns_the_runners_output(installed):
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    from vllm_plugins.bridge.counters import OUTPUT_ATTR
    from vllm_plugins.bridge.state import attach
    from vllm_plugins.bridge.worker_report import wrap_worker_sample_tokens

    original = inspect.unwrap(Worker.sample_tokens)
    assert list(inspect.signature(original).parameters) == ["self", "grammar_output"]
    assert "return self.model_runner.sample_tokens(grammar_output)" in inspect.getsource(
        original)
    assert "sample_tokens" not in vars(CPUWorker)  # the CPU worker's is the same
    # The report: what grew since the last one, on a ModelRunnerOutput; an
    # empty output (nothing sampled) carries nothing, and what grew waits.
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    worker = SimpleNamespace(model_runner=SimpleNamespace())
    state = attach(worker.model_runner, SimpleNamespace(counters=dict))  # step counters alone
    outputs = []
    sample_tokens = wrap_worker_sample_tokens(lambda w, grammar_output: outputs.pop(0))

    def step(out):
        outputs.append(out)
        return sample_tokens(worker, None)

    state.counters.steps = 3
    out = step(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
    assert getattr(out, OUTPUT_ATTR)["steps"] == {"": 3}
    state.counters.steps = 5
    assert step(EMPTY_MODEL_RUNNER_OUTPUT) is EMPTY_MODEL_RUNNER_OUTPUT
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, OUTPUT_ATTR)
    again = step(ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}))
    assert getattr(again, OUTPUT_ATTR) == {"steps": {"": 2}}


def test_scheduler_stats_field_travels_to_the_front_end(installed):
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    from vllm_plugins.bridge.counters import STATS_FIELD

    assert SchedulerStats().vllm_plugins is None
    stats = SchedulerStats(num_running_reqs=1)
    setattr(stats, STATS_FIELD, {"steps": {"": 4}, "source_errors": {"ngram": 1}})
    wire = MsgpackEncoder().encode(EngineCoreOutputs(scheduler_stats=stats))
    got = MsgpackDecoder(EngineCoreOutputs).decode(wire).scheduler_stats
    assert got.num_running_reqs == 1
    assert getattr(got, STATS_FIELD) == {"steps": {"": 4}, "source_errors": {"ngram": 1}}
    assert dataclasses.replace(stats).num_running_reqs == 1  # not an __init__ argument
    # update_from_output puts the step's stats on one client's outputs,
    # which is where the bridge adds our counters' growth.
    source = inspect.getsource(inspect.unwrap(Scheduler.update_from_output))
    assert "eco.scheduler_stats = stats" in source


def test_stat_logger_manager_hands_each_engines_stats_to_its_loggers(installed, model_path):
    from prometheus_client import REGISTRY
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.metrics.loggers import StatLoggerManager
    from vllm.v1.metrics.stats import SchedulerStats

    from vllm_plugins.bridge.stat_logger import PluginStatLogger

    config = EngineArgs(model=model_path, max_model_len=256, enforce_eager=True,
                        dtype="float32",
                        speculative_config={"method": "hybrid",
                                            "num_speculative_tokens": 3}).create_engine_config()
    manager = StatLoggerManager(config, engine_idxs=[0, 1], enable_default_loggers=False)
    assert [type(x) for x in manager.stat_loggers].count(PluginStatLogger) == 1
    name = config.model_config.served_model_name

    def value(metric, engine, **labels):
        return REGISTRY.get_sample_value(f"vllm_plugins:{metric}_total",
                                         {"model_name": name, "engine": engine, **labels})

    assert value("steps", "1") == 0.0  # registered at start for our method
    for _ in range(2):
        stats = SchedulerStats()
        stats.vllm_plugins = {"steps": {"": 3}, "not_a_metric": {"": 1},
                              "source_errors": {"ngram": 1}}
        manager.record(scheduler_stats=stats, iteration_stats=None, engine_idx=1)
    manager.record(scheduler_stats=SchedulerStats(), iteration_stats=None, engine_idx=0)
    assert value("steps", "1") == 6.0
    assert value("steps", "0") == 0.0
    assert value("source_errors", "1", source="ngram") == 2.0
    # A second front end in the process registers its counters anew.
    StatLoggerManager(config, engine_idxs=[0], enable_default_loggers=False)
    assert value("steps", "0") == 0.0
