"""Pins what the bridge relies on in vLLM's logits processors, samplers and
scheduler under speculation: where processors run (and are dropped), how the
rejection sampler orders bonus and target rows, and how grammar requests are
held, failed and handed to the workers. Fails loudly when vLLM moves."""

import inspect

import pytest

from tests.test_bridge_pins import params


def _original(fn):
    return getattr(fn, "__wrapped__", fn)


def test_build_logitsprocs_drops_processors_when_speculating():
    """vLLM builds only min_tokens under speculation; the runner calls the
    name it imported, with the engine's explicit processors."""
    from vllm.v1.sample import logits_processor as lp
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor, MinPLogitsProcessor)
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fn = _original(gpu_model_runner.build_logitsprocs)
    assert params(fn) == ["vllm_config", "device", "is_pin_memory",
                          "is_pooling_model", "custom_logitsprocs"]
    src = inspect.getsource(fn)
    assert "if vllm_config.speculative_config:" in src
    assert "[MinTokensLogitsProcessor(vllm_config, device, is_pin_memory)]" in src
    assert "build_logitsprocs(" in inspect.getsource(GPUModelRunner.__init__)
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor} <= set(
        lp.BUILTIN_LOGITS_PROCESSORS)
    assert callable(lp._load_logitsprocs_plugins)
    assert callable(lp._load_logitsprocs_by_fqcns)
    # What the target-row path reads to skip idle processors.
    assert "self.biases" in inspect.getsource(LogitBiasLogitsProcessor.__init__)
    assert "self.min_p_count" in inspect.getsource(MinPLogitsProcessor.__init__)


def test_spec_decode_refuses_min_p_and_logit_bias():
    from vllm.sampling_params import SamplingParams

    fn = _original(SamplingParams._validate_spec_decode)
    assert params(fn) == ["self", "speculative_config"]
    assert "self._validate_spec_decode(speculative_config)" in inspect.getsource(
        SamplingParams.verify)
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        fn(SamplingParams(min_p=0.1), object())
    fn(SamplingParams(min_p=0.1), None)


def test_rejection_sampler_samples_bonus_rows_then_target_rows():
    """forward samples the bonus rows with the plain Sampler (which runs the
    processors), then processes the target rows, then divides by the
    temperature; the plain sampler runs non-argmax-invariant processors
    before penalties and min_p after the temperature."""
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    fwd = _original(RejectionSampler.forward)
    assert params(fwd) == ["self", "metadata", "draft_probs", "logits",
                           "sampling_metadata"]
    assert params(_original(RejectionSampler.apply_logits_processors)) == [
        "self", "logits", "sampling_metadata", "metadata"]
    src = inspect.getsource(fwd)
    bonus = src.index("bonus_sampler_output = self.sampler(")
    target = src.index("target_logits = self.apply_logits_processors(")
    constraints = src.index("target_logits = apply_sampling_constraints(")
    assert bonus < target < constraints
    plain = inspect.getsource(Sampler.apply_logits_processors)
    assert plain.index("non_argmax_invariant") < plain.index("self.apply_penalties(")
    sample = inspect.getsource(Sampler.sample)
    assert sample.index("self.apply_temperature(") < sample.index(
        "logitsprocs.argmax_invariant")
    mine = inspect.getsource(_original(RejectionSampler.apply_logits_processors))
    # vLLM runs only min_tokens there, and none of ours.
    assert "MinTokensLogitsProcessor" in mine and "processor.apply(" not in mine
    # verify_processors.vllm_masks: the plain sampler masks allowed tokens and
    # bad words before the processors; on target rows vLLM masks them (and
    # min_tokens) after the penalties, with these helpers.
    assert (plain.index("allowed_token_ids_mask") < plain.index("apply_bad_words(")
            < plain.index("non_argmax_invariant"))
    assert (mine.index("self.apply_penalties(") < mine.index("allowed_token_ids_mask[")
            < mine.index("apply_bad_words_with_drafts(")
            < mine.index("processor.apply_with_spec_decode("))
    from vllm.v1.sample.ops.bad_words import apply_bad_words_with_drafts

    assert params(apply_bad_words_with_drafts) == [
        "logits", "bad_words_token_ids", "past_tokens_ids", "num_draft_tokens"]
    assert params(RejectionSampler._combine_outputs_with_spec_tokens) == [
        "output_token_ids", "spec_token_ids"]


def test_min_tokens_masks_bonus_rows_by_committed_output():
    """The plain Sampler calls MinTokensLogitsProcessor.apply on the bonus
    rows, which masks by the committed output alone; its state and helpers
    are what bridge.v1.verify_processors.bonus_min_tokens reads."""
    from vllm.v1.sample.logits_processor import MinTokensLogitsProcessor

    fn = _original(MinTokensLogitsProcessor.apply)
    assert params(fn) == ["self", "logits"]
    src = inspect.getsource(fn)
    assert "self.logits_slice" in src and "self._mask_stop_token_logits(" in src
    init = inspect.getsource(MinTokensLogitsProcessor.__init__)
    assert "self.min_toks: dict[int, tuple[int, Sequence[int], set[int], bool]]" in init
    assert "self.neg_inf_tensor" in init
    assert params(MinTokensLogitsProcessor._mask_stop_token_logits) == [
        "self", "logits", "logits_slice", "restore_logits_slice"]
    assert params(MinTokensLogitsProcessor._device_tensor) == ["self", "data", "dtype"]
    add = inspect.getsource(MinTokensLogitsProcessor.add_request)
    assert "params.all_stop_token_ids" in add
    # Target rows: vLLM counts the drafts there (apply_with_spec_decode).
    spec = inspect.getsource(MinTokensLogitsProcessor.apply_with_spec_decode)
    assert "remaining = min_tok - current_len" in spec


def test_scheduler_holds_blocked_requests_and_ends_errors():
    # bridge/grammar_hold.py: a new request in a blocked-waiting status goes
    # to deferred_waiting; the blocked branch for grammars reads vLLM's own
    # structured_output_request (ours is absent, so we answer first);
    # grammar_compile_error_reqs become FINISHED_ERROR outputs in
    # update_from_output, and an empty sampled-token list adds nothing.
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine import FinishReason
    from vllm.v1.request import RequestStatus

    import vllm_plugins

    vllm_plugins.register()
    add = inspect.getsource(Scheduler.add_request.__wrapped__)
    assert "self._enqueue_waiting_request(request)" in add
    assert "RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR" in inspect.getsource(
        Scheduler._is_blocked_waiting_status)
    blocked = inspect.getsource(Scheduler._handle_blocked_waiting_request.__wrapped__)
    assert "request.structured_output_request" in blocked
    # 0.32: a set of ids; 0.33: ids -> RequestError (grammar_hold.mark_error).
    assert ("self.grammar_compile_error_reqs.add(request.request_id)" in blocked
            or "self.grammar_compile_error_reqs[request.request_id] = RequestError(" in blocked)
    update = inspect.getsource(Scheduler.update_from_output.__wrapped__)
    assert ("error_req_ids = set(self.grammar_compile_error_reqs)" in update
            or "request_errors = self.grammar_compile_error_reqs" in update)
    assert "error_req_ids, RequestStatus.FINISHED_ERROR" in update
    assert "sampled_token_ids[req_index] if sampled_token_ids else []" in update
    assert "if new_token_ids:" in update
    assert RequestStatus.get_finished_reason(RequestStatus.FINISHED_ERROR) == (
        FinishReason.ERROR)
    assert params(Scheduler._handle_blocked_waiting_request) == ["self", "request"]


def test_runner_output_carries_matcher_errors():
    # bridge/worker_report.py: the worker's sample_tokens returns the runner's
    # output (or an async one with get_output), made after sampling, while
    # input_batch.req_ids still maps the processors' rows; logits processors
    # are on input_batch.logitsprocs.all; a ModelRunnerOutput keeps an
    # attribute of ours through pickling (a multiprocess executor's channel).
    import dataclasses

    from vllm.v1.outputs import AsyncModelRunnerOutput, ModelRunnerOutput
    from vllm.v1.sample.logits_processor.state import LogitsProcessors
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import vllm_plugins

    vllm_plugins.register()
    assert params(GPUModelRunner.sample_tokens) == ["self", "grammar_output"]
    src = inspect.getsource(inspect.unwrap(GPUModelRunner.sample_tokens))
    assert "sampler_output = self._sample(logits, spec_decode_metadata)" in src
    assert "get_output" in AsyncModelRunnerOutput.__abstractmethods__
    assert dataclasses.is_dataclass(ModelRunnerOutput)
    assert not hasattr(ModelRunnerOutput, "__slots__")
    assert isinstance(LogitsProcessors.__dict__["all"], property)


def test_scheduler_output_reaches_every_worker_with_held_specs():
    # bridge/grammar_hold.py: Scheduler.schedule returns the SchedulerOutput
    # that every worker's execute_model receives (CPUWorker inherits it);
    # an attribute of ours pickles with it to worker processes.
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu_worker import Worker

    import vllm_plugins

    vllm_plugins.register()
    assert "execute_model" not in vars(CPUWorker) and issubclass(CPUWorker, Worker)
    assert params(Worker.execute_model)[:2] == ["self", "scheduler_output"]
    assert "return scheduler_output" in inspect.getsource(Scheduler.schedule.__wrapped__)
    assert dataclasses.is_dataclass(SchedulerOutput)
    assert not hasattr(SchedulerOutput, "__slots__")



def test_sampler_draws_as_awrs_replays_them():
    """The AWRS sampler (logits_processors/awrs.py) replays vLLM's draw of a
    row: greedy_sample is the argmax; the CPU sampler's seeded row is
    fused_gumbel_argmax with one randint(2**31) drawn from the request's
    generator; elsewhere random_sample is argmax(probs / q), q exponential
    from the generator. Temperature divides before top-k / top-p."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import (
        TopKTopPSampler, apply_top_k_top_p, random_sample)
    from vllm.v1.sample.sampler import Sampler

    row = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    assert int(Sampler.greedy_sample(row.clone())[0]) == int(row.argmax())
    src = inspect.getsource(TopKTopPSampler.forward_cpu)
    assert "torch.randint(\n                0, 2**31, (1,), generator=gen" in src
    assert "fused_gumbel_argmax" in src
    mine = torch.Generator().manual_seed(7)
    seed = torch.randint(0, 2**31, (1,), generator=mine, dtype=torch.long)
    got = TopKTopPSampler().forward_cpu(row.clone(), {0: torch.Generator().manual_seed(7)},
                                        None, None)[0]
    assert int(got[0]) == int(torch.ops._C.fused_gumbel_argmax(row, seed)[0])
    q = torch.empty(64).exponential_(generator=torch.Generator().manual_seed(3))
    probs = row.softmax(-1)
    assert int(random_sample(probs.clone(), {0: torch.Generator().manual_seed(3)})[0]) \
        == int(probs[0].div(q).argmax())
    assert "apply_temperature" in inspect.getsource(Sampler.sample)
    kept = apply_top_k_top_p(row.clone(), torch.tensor([3], dtype=torch.int32), None)
    assert int(torch.isfinite(kept).sum()) == 3


def test_sampler_divides_the_processors_rows_in_place():
    """AWRS leaves an unseeded row to vLLM's draw and reads it back after
    sampling (bridge/v1/grammar_awrs.py, AwrsRows.awrs_after_sample): the
    tensor a logits processor was handed is the one the sampler draws
    from, divided by each row's temperature in place, and nothing else
    changes rows without top-k, top-p or min-p."""
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.sampler import Sampler

    seen = []

    class Keep:
        def apply(self, logits):
            seen.append(logits)
            return logits

        def is_argmax_invariant(self):
            return False

    raw = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    temps = torch.tensor([0.5, 1.0, 2.0])
    meta = SamplingMetadata(
        temperature=temps, all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(3), presence_penalties=torch.zeros(3),
        repetition_penalties=torch.ones(3), output_token_ids=[[], [], []],
        allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors([Keep()]))
    Sampler()(raw.clone(), meta)
    (logits,) = seen
    assert torch.equal(logits, raw / temps[:, None])
