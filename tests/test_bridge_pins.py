"""Pins every vLLM internal the bridge relies on; fails loudly when vLLM moves."""

import inspect
import pickle

import pytest


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_runner_methods_keep_their_signatures():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner._sample) == ["self", "logits", "spec_decode_metadata"]
    assert params(GPUModelRunner.propose_draft_token_ids)[:10] == [
        "self", "scheduler_output", "sampled_token_ids", "sampling_metadata",
        "hidden_states", "sample_hidden_states", "aux_hidden_states",
        "spec_decode_metadata", "common_attn_metadata", "slot_mappings"]
    assert params(GPUModelRunner.execute_model)[:2] == ["self", "scheduler_output"]


def test_runner_reads_draft_probs_from_its_slot():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner._get_spec_decode_draft_probs)
    assert "self._draft_probs[row_idx, :num_draft]" in src
    assert "self._draft_prob_req_ids" in src
    assert "_get_spec_decode_draft_probs(spec_decode_metadata)" in inspect.getsource(
        GPUModelRunner._sample)


def test_runner_calls_drafter_after_bookkeeping_with_valid_tokens():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = inspect.getsource(GPUModelRunner.sample_tokens)
    assert "propose_draft_token_ids(valid_sampled_token_ids)" in src
    # num_tokens_no_spec already counts this step's tokens when we draft.
    book = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "self.input_batch.num_tokens_no_spec[req_idx] = end_idx" in book


def test_cpu_runner_is_the_v1_runner():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner)


def test_spec_decode_metadata_fields():
    import dataclasses

    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    names = {f.name for f in dataclasses.fields(SpecDecodeMetadata)}
    assert {"draft_token_ids", "num_draft_tokens"} <= names


def test_a_step_without_drafts_can_take_the_plain_sampler():
    """The bridge hands a step with no drafts to the plain sampler: that
    needs max_spec_len, the plain branch of _sample, and bookkeeping that
    tells the two outputs apart by shape alone."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_plugins.bridge import _verifies_nothing

    none = SpecDecodeMetadata.make_dummy([[], []], torch.device("cpu"))
    some = SpecDecodeMetadata.make_dummy([[], [5, 6]], torch.device("cpu"))
    assert none.max_spec_len == 0 and some.max_spec_len == 2
    assert _verifies_nothing(none) and not _verifies_nothing(some)
    assert not _verifies_nothing(None)
    assert len(none.logits_indices) == 2             # one row per request
    sample = inspect.getsource(GPUModelRunner._sample)
    assert "if spec_decode_metadata is None:\n            return self.sampler(" in sample
    book = inspect.getsource(GPUModelRunner._bookkeeping_sync)
    assert "max_gen_len = sampled_token_ids.shape[-1]" in book
    assert "if max_gen_len == 1:" in book


def test_input_batch_and_scheduler_output_fields():
    import dataclasses

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.worker.gpu_input_batch import InputBatch

    src = inspect.getsource(InputBatch.__init__)
    for attr in ("self.token_ids_cpu", "self.num_tokens_no_spec",
                 "self.num_prompt_tokens", "self._req_ids", "self.vocab_size"):
        assert attr in src, attr
    names = {f.name for f in dataclasses.fields(SchedulerOutput)}
    assert {"finished_req_ids", "total_num_scheduled_tokens"} <= names


def test_engine_args_builds_speculative_config_after_plugins():
    from vllm.engine.arg_utils import EngineArgs

    src = inspect.getsource(EngineArgs.create_speculative_config.__wrapped__
                            if hasattr(EngineArgs.create_speculative_config,
                                       "__wrapped__")
                            else EngineArgs.create_speculative_config)
    assert "SpeculativeConfig(**self.speculative_config)" in src
    assert "load_general_plugins()" in inspect.getsource(EngineArgs.__post_init__)


def test_custom_class_route_and_worker_rpc():
    from vllm.v1.spec_decode.custom_class_proposer import create_custom_proposer
    from vllm.v1.worker.worker_base import WorkerBase

    assert "user_class(vllm_config)" in inspect.getsource(create_custom_proposer)
    import vllm_plugins

    vllm_plugins.register()
    assert callable(WorkerBase.vllm_plugins_stats)


def test_ngram_lookup_function():
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as lookup)

    toks = np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int32)
    assert list(lookup(toks, 2, 3, 100, 2)) == [4, 1]


def test_options_ride_the_config_to_workers():
    from vllm.config import SpeculativeConfig

    cfg = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(cfg, "vllm_plugins_options", {"method": "token_recycling"})
    assert pickle.loads(pickle.dumps(cfg)).vllm_plugins_options["method"] == (
        "token_recycling")


def test_patches_are_installed_once():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import vllm_plugins
    from vllm_plugins import bridge

    vllm_plugins.register()
    sample = GPUModelRunner._sample
    bridge._INSTALLED = False
    bridge.install()
    assert GPUModelRunner._sample is sample
    assert getattr(EngineArgs.create_speculative_config, "_vllm_plugins", False)


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_version_gate_names_both_versions(version):
    from vllm_plugins import check_vllm_version

    with pytest.raises(RuntimeError, match=rf"0\.32.*{version}|{version}.*0\.32"):
        check_vllm_version(version)
    check_vllm_version("0.32.0+cpu")


def test_params_validator_is_built_per_engine():
    from vllm.v1.engine.input_processor import InputProcessor

    import vllm_plugins

    vllm_plugins.register()
    fn = InputProcessor._build_logits_processors_params_validator
    assert getattr(fn, "_vllm_plugins", False)
    assert params(fn.__wrapped__) == ["self"]
    src = inspect.getsource(InputProcessor.__init__)
    assert "self._build_logits_processors_params_validator()" in src



def test_finish_notices_survive_steps_that_schedule_nothing():
    """execute_model returns before drafting when nothing is scheduled; the
    finished ids of that step must still reach the proposer next step."""
    from types import SimpleNamespace

    from vllm_plugins import bridge

    bridge.install()
    runner = SimpleNamespace()
    empty_step = SimpleNamespace(finished_req_ids={"a", "b"},
                                 total_num_scheduled_tokens=0)
    with pytest.raises(Exception):  # a stand-in runner cannot really execute
        bridge._runner_class().execute_model(runner, empty_step)
    next_step = SimpleNamespace(finished_req_ids={"c"})
    assert bridge._take_finished(runner, next_step) == {"a", "b", "c"}
    assert bridge._take_finished(runner, SimpleNamespace(finished_req_ids=set())) == set()


# ------------------------------------------------ self-drafting (SWIFT / DEL)
def test_lookahead_is_a_config_property_read_by_scheduler_and_warmup():
    from vllm.config import VllmConfig
    from vllm.v1.core.sched import scheduler

    assert isinstance(VllmConfig.__dict__["num_lookahead_tokens"], property)
    assert "vllm_config.num_lookahead_tokens" in inspect.getsource(scheduler)


def test_plugin_lookahead_only_for_self_drafting_methods():
    from types import SimpleNamespace

    from vllm_plugins.bridge import plugin_lookahead
    from vllm_plugins.registry import METHODS, PLUGIN_OPTIONS_ATTR

    def config(method):
        return SimpleNamespace(**{PLUGIN_OPTIONS_ATTR: {"method": method},
                                  "model": METHODS[method].class_path,
                                  "num_speculative_tokens": 5})

    assert plugin_lookahead(config("swift")) == 5
    assert plugin_lookahead(config("del")) == 5
    assert plugin_lookahead(config("token_recycling")) == 0
    composed = config("grammar")
    getattr(composed, PLUGIN_OPTIONS_ATTR)["inner"] = {"method": "swift"}
    assert plugin_lookahead(composed) == 5
    getattr(composed, PLUGIN_OPTIONS_ATTR)["inner"] = "token_recycling"
    assert plugin_lookahead(composed) == 0
    assert plugin_lookahead(SimpleNamespace(model="x.Y", num_speculative_tokens=3)) == 0


def test_aux_hidden_state_route():
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    assert hasattr(LlamaForCausalLM, "set_aux_hidden_state_layers")
    for cls in (GPUModelRunner, CPUModelRunner):
        src = inspect.getsource(cls.load_model)
        assert src.index("drafter.load_model") < src.index(
            "_setup_eagle3_aux_hidden_state_outputs()")
    src = inspect.getsource(GPUModelRunner.execute_model)
    assert "hidden_states, aux_hidden_states = model_output" in src


def test_partial_forward_touch_points():
    import dataclasses

    from vllm.forward_context import set_forward_context
    from vllm.model_executor.layers.attention import attention
    from vllm.model_executor.models.llama import LlamaDecoderLayer, LlamaModel
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.worker.utils import AttentionGroup

    assert {"attn_metadata", "vllm_config", "num_tokens", "slot_mapping"} <= set(
        params(set_forward_context))
    fields = {f.name for f in dataclasses.fields(CommonAttentionMetadata)}
    assert {"query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs",
            "num_actual_tokens", "max_query_len", "max_seq_len",
            "block_table_tensor", "slot_mapping", "positions"} <= fields
    assert params(AttentionGroup.build_metadata)[:2] == ["self", "common_attn_metadata"]
    # K/V writes come from the forward context's per-layer slot mapping; no
    # entry, no write (scoring over committed context relies on this).
    src = inspect.getsource(attention.unified_kv_cache_update)
    assert "if layer_slot_mapping is not None" in src
    layer_src = inspect.getsource(LlamaDecoderLayer.__init__)
    for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
        assert f"self.{name}" in layer_src
    assert hasattr(LlamaModel, "embed_input_ids")


def test_cpu_linears_keep_32_kernels_per_token_count():
    """The goodput controller's ``shape_cache`` default (32) mirrors vLLM's
    CPU linear dispatch, which builds oneDNN kernels per token count and
    keeps 32 per layer; vllm_plugins.bench.kernel_sizes measures that cost."""
    from vllm.model_executor.layers import utils

    from vllm_plugins.bench.kernel_sizes import measure
    from vllm_plugins.proposers.controllers import POLICY_OPTIONS

    assert "ops.create_onednn_mm(origin_weight.t(), 32)" in inspect.getsource(utils)
    assert POLICY_OPTIONS["goodput"]["shape_cache"].default == 32
    out = measure([3, 5], in_features=8, out_features=16, cache=4, repeats=2)
    assert [r["rows"] for r in out["per_size"]] == [3, 5]
    assert all(r["first_us"] > 0 and r["cached_us"] > 0 for r in out["per_size"])
    assert out["sweep_sizes"] == 12


@pytest.mark.parametrize("k", [0, 4])
def test_topk_extraction_is_timed_for_the_controller(k):
    """The bridge times its top-k extraction (work a resting step skips) and
    hands it to the next step's context."""
    import types

    import torch

    from vllm_plugins import bridge

    runner = types.SimpleNamespace(drafter=types.SimpleNamespace(topk_wanted=lambda: k))
    bridge._stash_topk(runner, torch.randn(3, 50), None)
    assert runner._vp_topk_seconds >= 0.0
    assert (runner._vp_topk_seconds > 0.0) == (k > 0)
    assert (runner._vp_topk[2] is None) == (k == 0)

