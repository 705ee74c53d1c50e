"""Pins every vLLM internal the bridge relies on; fails loudly when vLLM moves."""

import inspect
import pickle
import re

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

    from vllm_plugins.bridge.v1.step import verifies_nothing as _verifies_nothing

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
    assert callable(WorkerBase.vllm_plugins_live_state)


def test_ngram_lookup_function():
    import numpy as np
    from vllm.v1.spec_decode.ngram_proposer import (
        _find_longest_matched_ngram_and_propose_tokens as lookup)

    toks = np.array([1, 2, 3, 4, 1, 2, 3], dtype=np.int32)
    assert list(lookup(toks, 2, 3, 100, 2)) == [4, 1]


def test_greedy_threshold_is_vllms():
    """vllm_plugins.tree.sampling.SAMPLING_EPS: where vLLM switches from
    greedy to random sampling."""
    from vllm.sampling_params import _SAMPLING_EPS, SamplingParams, SamplingType

    from vllm_plugins.tree.sampling import SAMPLING_EPS, is_greedy

    assert SAMPLING_EPS == _SAMPLING_EPS
    for t in (0.0, SAMPLING_EPS / 2, SAMPLING_EPS, 0.7):
        p = SamplingParams(temperature=t)
        assert is_greedy(p) == (p.sampling_type == SamplingType.GREEDY), t


def test_options_ride_the_config_to_workers():
    from vllm.config import SpeculativeConfig

    cfg = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(cfg, "vllm_plugins_options", {"method": "token_recycling"})
    assert pickle.loads(pickle.dumps(cfg)).vllm_plugins_options["method"] == (
        "token_recycling")


def test_params_validator_is_built_per_engine():
    from vllm.v1.engine.input_processor import InputProcessor

    import vllm_plugins

    vllm_plugins.register()
    from vllm_plugins.bridge.patching import MARK

    fn = InputProcessor._build_logits_processors_params_validator
    assert getattr(fn, MARK) == "config.grammar_request_refusal"
    assert params(fn.__wrapped__) == ["self"]
    src = inspect.getsource(InputProcessor.__init__)
    assert "self._build_logits_processors_params_validator()" in src



def test_async_add_request_validates_params_on_the_loop():
    # bridge/grammar_front.py: AsyncLLM.add_request, a coroutine on the API
    # server's loop, runs the input processor synchronously, which calls the
    # custom logits processors' validate_params; generate() goes through it.
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.input_processor import InputProcessor

    fn = getattr(AsyncLLM.add_request, "__wrapped__", AsyncLLM.add_request)
    assert inspect.iscoroutinefunction(fn)
    assert params(fn)[:4] == ["self", "request_id", "prompt", "params"]
    assert "request = self.input_processor.process_inputs(" in inspect.getsource(fn)
    assert "self._validate_params(params" in inspect.getsource(InputProcessor.process_inputs)
    assert "self.validate_logits_processors_params(params)" in inspect.getsource(
        InputProcessor._validate_params)
    assert "await self.add_request(" in inspect.getsource(AsyncLLM.generate)


def test_lookahead_is_a_config_property_read_by_scheduler_and_warmup():
    from vllm.config import VllmConfig
    from vllm.v1.core.sched import scheduler

    assert isinstance(VllmConfig.__dict__["num_lookahead_tokens"], property)
    assert "vllm_config.num_lookahead_tokens" in inspect.getsource(scheduler)


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
    from vllm_plugins.proposers.draft_length import policy_options

    assert "ops.create_onednn_mm(origin_weight.t(), 32)" in inspect.getsource(utils)
    assert policy_options("goodput", None)["shape_cache"] == 32
    out = measure([3, 5], in_features=8, out_features=16, cache=4, repeats=2)
    assert [r["rows"] for r in out["per_size"]] == [3, 5]
    assert all(r["first_us"] > 0 and r["cached_us"] > 0 for r in out["per_size"])
    assert out["sweep_sizes"] == 12




# ------------------------------------------------------------ the patch list
def test_every_patch_targets_vllm_and_names_its_pin():
    """Each patch's target exists in this vLLM (or, for an attribute we add,
    exists only as ours) and its pin test is in this module, in
    tests/test_bridge_pins_processors.py for processors, samplers and the
    scheduler under speculation, in tests/test_bridge_pins_metrics.py for
    the stats path to /metrics, in tests/test_bridge_pins_v2.py for Model
    Runner V2, or for a fix to vLLM's CPU build in tests/test_bridge_pins_cpu.py."""
    import vllm_plugins
    from tests import (test_bridge_pins_cpu, test_bridge_pins_metrics,
                       test_bridge_pins_processors, test_bridge_pins_v2)
    from vllm_plugins.bridge.patching import _MISSING
    from vllm_plugins.bridge.patches import PATCHES, RELIED_ON, vllm_names

    vllm_plugins.register()
    pin_modules = {"tests/test_bridge_pins.py": globals(),
                   "tests/test_bridge_pins_cpu.py": vars(test_bridge_pins_cpu),
                   "tests/test_bridge_pins_processors.py": vars(test_bridge_pins_processors),
                   "tests/test_bridge_pins_metrics.py": vars(test_bridge_pins_metrics),
                   "tests/test_bridge_pins_v2.py": vars(test_bridge_pins_v2)}
    for patch in PATCHES:
        file, _, test = patch.pin.partition("::")
        assert file in pin_modules and callable(pin_modules[file].get(test)), patch
        if patch.when is None or patch.when():
            assert patch.is_applied(), patch.name
        else:
            assert patch.current() is not _MISSING, patch.name
    for name in RELIED_ON:
        module, _, qualname = name.partition(":")
        obj = __import__(module, fromlist=["_"])
        for part in qualname.split("."):
            obj = getattr(obj, part)
    assert len(set(vllm_names())) == len(vllm_names())


def _names_vllm_probes_on_drafters() -> set[str]:
    """Attribute names vLLM reads on a runner's drafter anywhere in its source:
    ``drafter.x``, ``self.drafter.x`` and ``getattr/hasattr(drafter, "x")``."""
    import ast
    import pathlib

    import vllm

    def is_drafter(node) -> bool:
        return ((isinstance(node, ast.Name) and node.id == "drafter")
                or (isinstance(node, ast.Attribute) and node.attr == "drafter"))

    names = set()
    for path in pathlib.Path(vllm.__file__).parent.rglob("*.py"):
        text = path.read_text(errors="ignore")
        if "drafter" not in text:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Attribute) and is_drafter(node.value):
                names.add(node.attr)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr")
                  and len(node.args) >= 2 and is_drafter(node.args[0])
                  and isinstance(node.args[1], ast.Constant)):
                names.add(node.args[1].value)
    return names


def test_our_proposers_answer_to_no_name_vllm_probes_on_a_drafter():
    """vLLM gives meaning to attributes of runner.drafter (``model`` is read
    as a draft model by EPLB and LoRA, ``set_eplb_state``, ...): ours carry
    only ``load_model`` and ``propose``, the custom_class route's two."""
    from vllm_plugins.proposers.base import PluginProposer
    from vllm_plugins.registry import METHODS

    probed = _names_vllm_probes_on_drafters()
    assert {"model", "load_model", "propose", "set_eplb_state"} <= probed
    allowed = {"load_model", "propose"}
    base = PluginProposer(None, options={}, vocab_size=32)
    for cls in [PluginProposer] + [m.proposer_class() for m in METHODS.values()]:
        clash = (probed - allowed) & (set(dir(cls)) | set(vars(base)))
        assert not clash, (cls.__name__, sorted(clash))


def test_our_method_names_are_not_vllms():
    from vllm_plugins.registry import METHODS, translate, vllm_method_names

    vllm_names = vllm_method_names()
    assert {"ngram", "eagle", "suffix", "custom_class"} <= vllm_names
    assert not set(METHODS) & vllm_names
    # A name vLLM defines always reaches vLLM untouched.
    assert translate({"method": "ngram", "num_speculative_tokens": 3}) == (
        {"method": "ngram", "num_speculative_tokens": 3}, None)
    # vLLM's upstream "grammar" prototype: ours is named apart, and the old
    # name says so while vLLM does not define it.
    assert "grammar" not in METHODS
    if "grammar" not in vllm_names:
        with pytest.raises(ValueError, match="'grammar' is 'grammar_forced'"):
            translate({"method": "grammar"})


def test_runner_groups_attention_layers_by_kv_cache_spec():
    """Self-drafting is refused for targets with several KV-cache specs: the
    runner builds one attention group per distinct spec from this method."""
    import importlib.util

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner.get_kv_cache_spec) == ["self"]
    assert "get_layers_from_vllm_config" in inspect.getsource(
        GPUModelRunner.get_kv_cache_spec)
    # The grouping lives in kv_cache_utils in vLLM 0.32, kv_cache_planning in 0.33.
    homes = [m for m in ("vllm.v1.core.kv_cache_utils", "vllm.v1.core.kv_cache_planning")
             if importlib.util.find_spec(m) is not None]
    assert any(hasattr(importlib.import_module(m), "get_kv_cache_groups") for m in homes)


def test_tensor_parallel_group_fields():
    # bridge/ranks.py: get_tp_group() -> GroupCoordinator whose world_size,
    # ranks (first = output rank) and gloo cpu_group the first-rank clock uses.
    from vllm.distributed import parallel_state
    from vllm.distributed.parallel_state import GroupCoordinator

    src = inspect.getsource(GroupCoordinator.__init__)
    for field in ("self.ranks = ranks", "self.world_size = len(ranks)",
                  "self.cpu_group = ", 'backend="gloo"'):
        assert field in src, field
    assert GroupCoordinator.first_rank.fget.__doc__
    assert "_TP" in inspect.getsource(parallel_state.get_tp_group)
    from vllm_plugins.bridge.ranks import tensor_parallel_group

    assert tensor_parallel_group() is None  # no distributed group in this process


def test_lm_head_shards_by_tp_size():
    # proposers/layer_skip/base.py:_head_weight: a ParallelLMHead with
    # tp_size > 1 holds one vocabulary shard, so the full head drafts.
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead, VocabParallelEmbedding)

    src = inspect.getsource(VocabParallelEmbedding.__init__)
    assert "self.tp_size = " in src and "num_embeddings_per_partition" in src
    assert issubclass(ParallelLMHead, VocabParallelEmbedding)


def test_rank_digest_rpc_is_added():
    from vllm.v1.worker.worker_base import WorkerBase

    import vllm_plugins

    vllm_plugins.register()
    assert callable(WorkerBase.vllm_plugins_rank_digest)


def test_prepare_inputs_computes_slots_before_the_forward_reads_positions():
    # bridge/v1/tree_step.py: the slot mapping comes from the standard positions
    # inside _prepare_inputs; rewriting self.positions after it returns
    # changes only what the model reads. Drafts are verified in the step
    # right after they were proposed (no async scheduling for custom_class).
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner._prepare_inputs) == [
        "self", "scheduler_output", "num_scheduled_tokens"]
    src = inspect.getsource(GPUModelRunner._prepare_inputs)
    at = src.index("self.positions[:total_num_scheduled_tokens] = (")
    assert src.index("compute_slot_mapping(", at) > at
    assert "self.positions[:total_num_scheduled_tokens]," in src[at:]
    run = inspect.getsource(GPUModelRunner.execute_model)
    assert run.index("self._prepare_inputs(") < run.index("self._model_forward(")
    pre = inspect.getsource(GPUModelRunner._preprocess)
    assert "positions = self.positions[:num_input_tokens]" in pre
    assert "self.slot_mapping.gpu" in inspect.getsource(
        __import__("vllm.v1.worker.block_table", fromlist=["_"]).BlockTable
        .compute_slot_mapping)
    names = {f.name for f in __import__("dataclasses").fields(SpecDecodeMetadata)}
    assert {"num_draft_tokens", "logits_indices"} <= names
    # Tree acceptance writes vLLM's output layout and processing.
    from vllm.v1.sample import rejection_sampler

    assert rejection_sampler.PLACEHOLDER_TOKEN_ID == -1
    assert params(rejection_sampler.apply_sampling_constraints) == [
        "logits", "cu_num_draft_tokens", "sampling_metadata"]
    # bridge/v1/runner.py tree_sample: a step of tree requests only skips the
    # rejection sampler (tree_step.trees_output stands in for its output),
    # which is all _sample does with drafts besides async-scheduling updates.
    from vllm.v1.outputs import SamplerOutput

    assert [f.name for f in __import__("dataclasses").fields(SamplerOutput)] == [
        "sampled_token_ids", "logprobs_tensors"]
    sample = inspect.getsource(rejection_sampler.rejection_sample)
    assert "(batch_size, max_spec_len + 1),\n        PLACEHOLDER_TOKEN_ID,\n" \
        "        dtype=torch.int32," in sample
    spec_part = inspect.getsource(GPUModelRunner._sample).split(
        "if spec_decode_metadata is None:")[1]
    calls = set(re.findall(r"self\.(\w+(?:\.\w+)*)\(", spec_part))
    assert calls == {"sampler", "input_batch.update_async_spec_token_ids",
                     "_get_draft_token_ids_cpu", "_get_spec_decode_draft_probs",
                     "rejection_sampler"}, calls
    assert "if self.use_async_scheduling and" in spec_part
    assert "self.kv_caches" in inspect.getsource(GPUModelRunner.initialize_kv_cache) \
        or "self.kv_caches" in inspect.getsource(GPUModelRunner)
    # bridge/v1/runner.py held_generators: beside other requests, the rejection
    # sampler draws from seeded requests' generators (by batch index) where
    # they have drafts; tree requests' are put back before acceptance.
    uniform = inspect.getsource(rejection_sampler.generate_uniform_probs)
    assert "generators.get(req_idx)" in uniform and "if n == 0:" in uniform
    recovered = inspect.getsource(rejection_sampler.sample_recovered_tokens)
    assert "sampling_metadata.generators.items()" in recovered
    assert "if num_draft_tokens[i] > 0:" in recovered


def test_the_steps_forward_calls_each_attention_layers_impl_forward():
    # bridge/v1/runner.py wrap_model_forward and route_trees: a tree step's
    # _model_forward (the CPU runner's too) is the step's one forward, and
    # the attention op calls each layer's impl.forward inside it, an attribute
    # read on the instance, so a wrapper put there for that forward serves
    # its layers and none after.
    import ast
    import textwrap

    from vllm.model_executor.layers.attention import attention
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert params(GPUModelRunner._model_forward)[0] == "self"
    assert "_model_forward" not in vars(CPUModelRunner)
    run = ast.parse(textwrap.dedent(inspect.getsource(GPUModelRunner.execute_model)))
    assert len([c for c in ast.walk(run) if isinstance(c, ast.Call)
                and getattr(c.func, "attr", None) == "_model_forward"]) == 1
    op = inspect.getsource(attention.unified_attention_with_output)
    assert "self.impl.forward(" in op


def test_cpu_attention_forward_reads_a_cache_vllm_wrote():
    # bridge/v1/tree_step.py attend: the CPU backend writes K/V in
    # do_kv_cache_update before forward (forward_includes_kv_cache_update
    # False), in [num_blocks, kv_heads, block_size, 2 * head_size].
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend, CPUAttentionBackendImpl)

    assert CPUAttentionBackend.forward_includes_kv_cache_update is False
    assert params(CPUAttentionBackendImpl.forward)[:8] == [
        "self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"]
    src = inspect.getsource(CPUAttentionBackendImpl.forward)
    assert "kv_cache.view((num_blocks, num_kv_heads, block_size * 2, -1))" in src
    assert "key_cache, value_cache = kv_cache.chunk(2, dim=2)" in src
    for field in ("block_table", "seq_lens", "num_actual_tokens"):
        assert field in CPUAttentionBackendImpl.forward.__code__.co_names or field in src
