"""Pins what the Model Runner V2 route relies on (vllm_plugins/bridge/v2/).

vLLM sends ``custom_class`` speculation to its V1 runner; ``v2.runner_gate``
takes our methods off that list where V2 serves them, and names them where
it does not. V2 builds its drafter in ``init_speculator``, samples through
its ``sampler`` and ``rejection_sampler`` attributes, hands each request's
sampling parameters to ``Sampler.add_request``, and calls the drafter after
``postprocess_sampled`` appended the step's tokens. Each pin fails the day
a vLLM release changes one of these.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from unittest import mock

import pytest


def _config(model_path, spec: dict):
    from vllm.engine.arg_utils import EngineArgs

    import vllm_plugins

    vllm_plugins.register()
    return EngineArgs(model=model_path, max_model_len=256, enforce_eager=True,
                      dtype="float32", speculative_config=spec).create_engine_config()


@pytest.fixture(scope="module")
def chain_config(model_path):
    return _config(model_path, {"method": "token_recycling", "num_speculative_tokens": 3})


@pytest.fixture(scope="module")
def swift_config(model_path):
    return _config(model_path, {"method": "swift", "num_speculative_tokens": 3})


def test_runner_choice_reads_the_unsupported_features(chain_config, swift_config,
                                                      monkeypatch):
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    plain = VllmConfig._get_v2_model_runner_unsupported_features.__wrapped__
    # vLLM's own list sends custom_class to V1: what the gate takes off.
    assert "speculative method 'custom_class'" in plain(chain_config)
    assert chain_config._get_v2_model_runner_unsupported_features() == [
        f for f in plain(chain_config) if "custom_class" not in f]
    reasons = swift_config._get_v2_model_runner_unsupported_features()
    assert any("'swift' (vllm-plugins)" in r for r in reasons), reasons
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with mock.patch.object(vllm_config_module, "HAS_TRITON", True):
        # With Triton (every GPU build) the property reads the list.
        assert chain_config.use_v2_model_runner is True
        assert swift_config.use_v2_model_runner is False
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
        with pytest.raises(ValueError, match="'swift' \\(vllm-plugins\\)"):
            swift_config._validate_v2_model_runner()


def test_v2_runner_builds_its_drafter_through_init_speculator():
    from vllm.v1.worker.gpu import model_runner
    from vllm.v1.worker.gpu.spec_decode import init_speculator
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    from vllm_plugins.bridge.v2.drafter_base import V2Drafter

    assert list(inspect.signature(init_speculator).parameters) == [
        "vllm_config", "device", "req_states"]
    # Called by the name imported into the runner's module (what we patch).
    assert model_runner.init_speculator.__wrapped__ is init_speculator
    src = inspect.getsource(model_runner.GPUModelRunner.__init__)
    assert "self.speculator = init_speculator(" in src
    assert BaseSpeculator.__abstractmethods__ == {
        "init_cudagraph_manager", "capture", "propose"}
    ours = inspect.signature(V2Drafter.propose).parameters
    theirs = inspect.signature(BaseSpeculator.propose).parameters
    assert list(ours) == list(theirs)
    runner_src = inspect.getsource(model_runner.GPUModelRunner)
    # Attributes V2 reads off any drafter, which ours declares.
    for name in ("supports_mm_inputs", "draft_logits", "num_query_per_req",
                 "draft_token_confidence_probs"):
        assert f"speculator.{name}" in runner_src, name
        assert hasattr(V2Drafter, name) or name in inspect.getsource(
            V2Drafter.__init__), name


def test_v2_runner_samples_through_its_sampler_attributes():
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.states import RequestState

    sample = inspect.getsource(GPUModelRunner.sample)
    assert "self.sampler(logits, input_batch)" in sample
    assert "self.rejection_sampler(\n                logits,\n                input_batch," in sample
    assert "apply_grammar_bitmask(" in sample.split("self.rejection_sampler(")[0]
    load = inspect.getsource(GPUModelRunner.load_model.__wrapped__)
    assert "self.rejection_sampler = RejectionSampler(" in load
    add = inspect.getsource(GPUModelRunner.add_requests)
    assert "self.sampler.add_request(req_index, new_req_data.sampling_params)" in add
    tokens = inspect.getsource(GPUModelRunner.sample_tokens)
    # The step's tokens are appended before the drafter runs.
    assert tokens.index("self.postprocess_sampled(") < tokens.index("self.speculator.propose(")
    assert tokens.index("self.sample(") < tokens.index("self.speculator.propose(")
    state = inspect.getsource(RequestState.__init__)
    for name in ("self.all_token_ids", "self.total_len", "self.prompt_len",
                 "self.req_id_to_index"):
        assert name in state, name


def test_v2_hands_the_drafter_the_steps_k_and_verifies_no_more():
    """V2's scheduler may pick the step's k by batch size
    (``num_speculative_tokens_per_batch_size``); the runner passes it to
    ``propose`` as ``num_speculative_tokens`` (our step's ``max_draft``,
    ``bridge/v2/speculator.py``) and marks the drafts past it -1."""
    from vllm.config import SpeculativeConfig
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    assert "num_speculative_tokens_per_batch_size" in SpeculativeConfig.__dataclass_fields__
    tokens = inspect.getsource(GPUModelRunner.sample_tokens)
    call = tokens[tokens.index("self.speculator.propose("):]
    assert "num_speculative_tokens=num_spec_tokens," in call[:call.index(")")]
    assert "draft_tokens[:, num_spec_tokens:] = -1" in tokens
    assert "num_spec_tokens = self.execute_model_state.num_spec_tokens_to_schedule" in tokens


def test_v2_sample_tokens_proposes_and_returns_the_steps_output():
    """``worker.step_reports`` reads the k V2's drafter wants next once the
    runner's ``sample_tokens`` returned: V2 has proposed (and chosen the
    next k) by then, and that output is the one the executor hands to the
    scheduler's ``update_from_output``. A runner whose drafter is not ours
    reports no k."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_plugins.bridge.v2.drafter_base import V2Drafter
    from vllm_plugins.bridge.v2.step_k import OUTPUT_ATTR
    from vllm_plugins.bridge.worker_report import wrap_worker_sample_tokens

    tokens = inspect.getsource(GPUModelRunner.sample_tokens)
    assert tokens.index("self.speculator.propose(") < tokens.rindex("return ")
    assert "ModelRunnerOutput" in tokens

    class Drafter(V2Drafter):
        def __init__(self):
            pass

        def step_k_report(self):
            return {"k": 2}

    runner = SimpleNamespace(speculator=Drafter())
    worker = SimpleNamespace(model_runner=runner)
    outputs = [ModelRunnerOutput(req_ids=["a"], req_id_to_index={"a": 0}) for _ in range(2)]
    sample_tokens = wrap_worker_sample_tokens(lambda w, grammar_output: outputs.pop(0))
    out = sample_tokens(worker, None)
    assert getattr(out, OUTPUT_ATTR) == {"k": 2}
    runner.speculator = object()
    assert not hasattr(sample_tokens(worker, None), OUTPUT_ATTR)


def test_the_scheduler_takes_the_steps_k_from_its_lookup_by_request_count():
    """``bridge.v2.step_k`` caps the scheduler's k through
    ``dynamic_sd_lookup``: the scheduler indexes it by the step's request
    count for ``num_spec_tokens_to_schedule`` and otherwise only tests it
    against None; the async scheduler sizes its placeholders from that
    output field, and V2's runner hands it to the drafter."""
    import re

    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    schedule = inspect.getsource(Scheduler.schedule)
    assert re.search(r"num_spec_tokens_to_schedule = self\.dynamic_sd_lookup\[\s*"
                     r"len\(num_scheduled_tokens\)\s*\]", schedule)
    assert "num_spec_tokens_to_schedule=num_spec_tokens_to_schedule," in schedule
    uses = re.findall(r"self\.dynamic_sd_lookup[^\n]*", schedule)
    assert uses and all("is None" in u or "is not None" in u or u.endswith("[")
                        for u in uses), uses
    init = inspect.getsource(Scheduler.__init__)
    assert "self.dynamic_sd_lookup: list[int] | None = None" in init
    assert "self.num_spec_tokens = " in init
    after = inspect.getsource(AsyncScheduler._update_after_schedule)
    assert "scheduler_output.num_spec_tokens_to_schedule" in after
