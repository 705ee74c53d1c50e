"""Every vLLM internal this package touches, in one list.

``PATCHES`` are the attributes we replace or add, each a named
``vllm_plugins.bridge.patching.Patch`` with its reason and pin test;
``vllm_plugins.bridge.install`` applies them in this order. ``RELIED_ON``
are the vLLM internals we read without replacing them (fields, call order,
helpers). ``vllm_names`` lists both: what a new vLLM release must keep, and
what ``scripts/`` compares between two releases.
"""

from __future__ import annotations

from vllm_plugins.bridge import (config, counters, cpu_fixes, grammar_front, grammar_hold,
                                 worker_report, worker_rpc)
from vllm_plugins.bridge.patching import Patch
from vllm_plugins.bridge.v1 import runner, verify_processors
from vllm_plugins.bridge.v2 import gate as v2_gate
from vllm_plugins.bridge.v2 import speculator as v2_speculator

_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
_PINS = "tests/test_bridge_pins.py::"
_CPU_PINS = "tests/test_bridge_pins_cpu.py::"
_PROCESSOR_PINS = "tests/test_bridge_pins_processors.py::"
_V2_PINS = "tests/test_bridge_pins_v2.py::"
_V2_RUNNER = "vllm.v1.worker.gpu.model_runner"
_METRICS_PINS = "tests/test_bridge_pins_metrics.py::"

PATCHES: tuple[Patch, ...] = (
    Patch("v2.runner_gate",
          "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
          "Model Runner V2 serves our methods where it can; where it cannot, "
          "vLLM's own fallback to V1 (or refusal under VLLM_USE_V2_MODEL_RUNNER=1) "
          "names our method and the reason",
          _V2_PINS + "test_runner_choice_reads_the_unsupported_features",
          v2_gate.wrap_unsupported_features),
    Patch("v2.init_speculator", _V2_RUNNER + ":init_speculator",
          "V2 builds its drafter from a fixed list of vLLM's methods; ours "
          "becomes a BaseSpeculator around our proposer",
          _V2_PINS + "test_v2_runner_builds_its_drafter_through_init_speculator",
          v2_speculator.wrap_init_speculator),
    Patch("v2.load_model", _V2_RUNNER + ":GPUModelRunner.load_model",
          "after V2 built its samplers: our taps on them (the target's top-k "
          "at verified rows, each request's sampling parameters) and the "
          "target handed to our proposer",
          _V2_PINS + "test_v2_runner_samples_through_its_sampler_attributes",
          v2_speculator.wrap_load_model),
    Patch("config.speculative_method",
          "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
          "our method names become vLLM's custom_class route; our options are "
          "validated and ride the config to the workers; unsafe combinations "
          "are refused before a model loads",
          _PINS + "test_engine_args_builds_speculative_config_after_plugins",
          config.wrap_create_speculative_config),
    Patch("config.grammar_request_refusal",
          "vllm.v1.engine.input_processor:InputProcessor"
          "._build_logits_processors_params_validator",
          "a grammar request that a speculating engine would decode "
          "unconstrained is refused (HTTP 400) instead",
          _PINS + "test_params_validator_is_built_per_engine",
          config.wrap_params_validator),
    Patch("grammar.validate_off_loop",
          "vllm.v1.engine.async_llm:AsyncLLM.add_request",
          "a request's grammar compiles on a thread before vLLM's input "
          "processor validates it on the API server's event loop, so a large "
          "schema does not pause the server's other streams",
          _PINS + "test_async_add_request_validates_params_on_the_loop",
          grammar_front.wrap_add_request),
    Patch("config.self_draft_lookahead",
          "vllm.config:VllmConfig.num_lookahead_tokens",
          "the scheduler reserves KV slots for drafts that self-drafting "
          "methods write",
          _PINS + "test_lookahead_is_a_config_property_read_by_scheduler_and_warmup",
          config.wrap_lookahead),
    Patch("runner.after_load", _RUNNER + "._setup_eagle3_aux_hidden_state_outputs",
          "runs once after drafter.load_model: attaches our runner state, "
          "checks a self-drafting target, requests DEL's per-layer streams",
          _PINS + "test_aux_hidden_state_route",
          runner.wrap_after_load),
    Patch("runner.step_clock", _RUNNER + ".execute_model",
          "times each step for the cost model and holds finish notices of "
          "steps that schedule nothing",
          _PINS + "test_runner_methods_keep_their_signatures",
          runner.wrap_execute_model),
    Patch("runner.verified_topk", _RUNNER + "._sample",
          "takes the target's top-k at every verified row; a step with no "
          "drafts takes the plain sampler; AWRS checks vLLM's draw of the rows "
          "it left to it (bridge.v1.grammar_awrs)",
          _PINS + "test_a_step_without_drafts_can_take_the_plain_sampler",
          runner.wrap_sample),
    Patch("runner.propose", _RUNNER + ".propose_draft_token_ids",
          "our proposers see a StepContext keyed by request id and may give "
          "draft probabilities",
          _PINS + "test_runner_calls_drafter_after_bookkeeping_with_valid_tokens",
          runner.wrap_propose),
    Patch("tree.depth_positions", _RUNNER + "._prepare_inputs",
          "a step verifying tree drafts reads rotary positions by depth (the "
          "slots stay vLLM's, by node index) and plans the step's ancestry "
          "masks for attention; put on a runner at its first tree",
          _PINS + "test_prepare_inputs_computes_slots_before_the_forward_reads_positions",
          runner.wrap_prepare_inputs, per_instance=True),
    Patch("tree.forward_plan", _RUNNER + "._model_forward",
          "the attention route is on a runner's layers for its tree steps' "
          "forwards alone, each layer's wrapper bound to the runner's state, "
          "which holds the step's plan: no other forward, step or runner sees "
          "it; put on a runner at its first tree",
          _PINS + "test_the_steps_forward_calls_each_attention_layers_impl_forward",
          runner.wrap_model_forward, per_instance=True),
    Patch("tree.cpu_attention",
          "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl.forward",
          "in a step verifying tree drafts, tree requests attend by ancestry "
          "(kernels.tree_attention) and vLLM's forward runs on the other "
          "requests alone, so no row is computed twice; put on a runner's "
          "attention layers at its first tree, so that no other engine pays "
          "for it",
          _PINS + "test_cpu_attention_forward_reads_a_cache_vllm_wrote",
          runner.wrap_cpu_attention, per_instance=True),
    Patch("worker.stats", "vllm.v1.worker.worker_base:WorkerBase.vllm_plugins_stats",
          "collective_rpc target: step counters and proposer metrics",
          _PINS + "test_custom_class_route_and_worker_rpc",
          worker_rpc.add_read_stats, adds=True),
    Patch("worker.count_steps",
          "vllm.v1.worker.worker_base:WorkerBase.vllm_plugins_count_steps",
          "collective_rpc target: a benchmark counts vLLM's own drafters too",
          _PINS + "test_custom_class_route_and_worker_rpc",
          worker_rpc.add_count_steps, adds=True),
    Patch("worker.live_state",
          "vllm.v1.worker.worker_base:WorkerBase.vllm_plugins_live_state",
          "collective_rpc target: counts of what our state holds, so a leak "
          "of one object per request shows on an idle engine",
          _PINS + "test_custom_class_route_and_worker_rpc",
          worker_rpc.add_live_state, adds=True),
    Patch("worker.rank_digest",
          "vllm.v1.worker.worker_base:WorkerBase.vllm_plugins_rank_digest",
          "collective_rpc target: per-step digests of each rank's drafts, "
          "draft probabilities and token history, to check ranks agree",
          _PINS + "test_custom_class_route_and_worker_rpc",
          worker_rpc.add_rank_digest, adds=True),
    Patch("verify.build_logitsprocs",
          "vllm.v1.worker.gpu_model_runner:build_logitsprocs",
          "an engine drafting with our proposers keeps min_p, logit_bias and "
          "our grammar processor, which vLLM builds only without speculation",
          _PROCESSOR_PINS + "test_build_logitsprocs_drops_processors_when_speculating",
          verify_processors.wrap_build_logitsprocs),
    Patch("verify.sampling_params",
          "vllm.sampling_params:SamplingParams._validate_spec_decode",
          "min_p and logit_bias requests are admitted by engines drafting "
          "with our proposers, whose verified rows get them",
          _PROCESSOR_PINS + "test_spec_decode_refuses_min_p_and_logit_bias",
          config.wrap_validate_spec_decode),
    Patch("verify.bonus_rows",
          "vllm.v1.sample.rejection_sampler:RejectionSampler.forward",
          "our grammar processor masks each bonus row after the request's "
          "drafts while the plain sampler samples the bonus rows",
          _PROCESSOR_PINS + "test_rejection_sampler_samples_bonus_rows_then_target_rows",
          verify_processors.wrap_rejection_forward),
    Patch("verify.target_rows",
          "vllm.v1.sample.rejection_sampler:RejectionSampler.apply_logits_processors",
          "logit_bias, our grammar processor (per draft position) and min_p "
          "on the target rows, in the plain sampler's order",
          _PROCESSOR_PINS + "test_rejection_sampler_samples_bonus_rows_then_target_rows",
          verify_processors.wrap_apply_logits_processors),
    Patch("verify.bonus_min_tokens",
          "vllm.v1.sample.logits_processor.builtin:MinTokensLogitsProcessor.apply",
          "min_tokens on a bonus row counts the request's drafts before it, as "
          "on the target rows and in plain decoding at that position (vLLM "
          "counts only the committed output there)",
          _PROCESSOR_PINS + "test_min_tokens_masks_bonus_rows_by_committed_output",
          verify_processors.wrap_min_tokens_apply),
    Patch("grammar.hold_new_requests", _SCHEDULER + ".add_request",
          "a request with our grammar waits (vLLM's blocked-waiting state) "
          "while its grammar compiles on a thread, not inside a step",
          _PROCESSOR_PINS + "test_scheduler_holds_blocked_requests_and_ends_errors",
          grammar_hold.wrap_add_request, when=grammar_hold.hold_enabled),
    Patch("grammar.release_compiled", _SCHEDULER + "._handle_blocked_waiting_request",
          "a held grammar request is scheduled once compiled, or finished "
          "with an error when its grammar does not compile",
          _PROCESSOR_PINS + "test_scheduler_holds_blocked_requests_and_ends_errors",
          grammar_hold.wrap_handle_blocked_waiting_request,
          when=grammar_hold.hold_enabled),
    Patch("grammar.send_held_specs", _SCHEDULER + ".schedule",
          "the step's output names the specs held in it, so that worker "
          "processes compile them while the request waits",
          _PROCESSOR_PINS + "test_scheduler_output_reaches_every_worker_with_held_specs",
          grammar_hold.wrap_schedule, when=grammar_hold.hold_enabled),
    Patch("grammar.worker_compiles_held_specs",
          "vllm.v1.worker.gpu_worker:Worker.execute_model",
          "a worker process starts compiling held specs off its loop",
          _PROCESSOR_PINS + "test_scheduler_output_reaches_every_worker_with_held_specs",
          grammar_hold.wrap_worker_execute_model, when=grammar_hold.hold_enabled),
    Patch("grammar.end_on_matcher_errors", _SCHEDULER + ".update_from_output",
          "a request whose grammar failed ends with finish reason error, "
          "not a silent stop; an AWRS request's weights add up and reach its "
          "output; the step's growth of our counters goes onto its SchedulerStats; "
          "on V2, the k our controller wants next caps the scheduler's k",
          _PROCESSOR_PINS + "test_scheduler_holds_blocked_requests_and_ends_errors",
          grammar_hold.wrap_update_from_output),
    Patch("worker.step_reports", "vllm.v1.worker.gpu_worker:Worker.sample_tokens",
          "what our runner state's counters grew in the step, the requests "
          "whose grammar failed in it with AWRS requests' weights "
          "(bridge.grammar_weights), and on V2 the k our drafter wants next, "
          "ride the step's output to the scheduler (bridge.worker_report)",
          _METRICS_PINS + "test_worker_sample_tokens_returns_the_runners_output",
          worker_report.wrap_worker_sample_tokens),
    Patch("metrics.scheduler_stats_field",
          "vllm.v1.metrics.stats:SchedulerStats.vllm_plugins",
          "a declared field, so that our counters' growth travels with the "
          "stats vLLM sends from the engine core to the front end",
          _METRICS_PINS + "test_scheduler_stats_field_travels_to_the_front_end",
          counters.add_stats_field, adds=True),
    Patch("metrics.stat_logger", "vllm.v1.metrics.loggers:StatLoggerManager.__init__",
          "the front end's stat loggers include ours, which serves our counters "
          "on /metrics beside vLLM's (bridge.stat_logger)",
          _METRICS_PINS + "test_stat_logger_manager_hands_each_engines_stats_to_its_loggers",
          counters.wrap_stat_logger_manager),
    Patch("cpu.expand_batch_to_tokens",
          "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens",
          "vLLM's CPU build without Triton leaves per-request sampling "
          "parameters uninitialised on draft rows",
          _CPU_PINS + "test_cpu_expand_batch_to_tokens_fix",
          cpu_fixes.replace_expand_batch_to_tokens, when=cpu_fixes.no_triton),
    Patch("cpu.kernel_scan_vars", "vllm.triton_utils.dispatcher:vars",
          "vLLM's CPU build scans every module for Triton kernels to rebind "
          "and fails on llvmlite's objects once numba is imported, so an "
          "engine built in a process that loaded our proposers would not start",
          _CPU_PINS + "test_cpu_kernel_scan_survives_numba",
          cpu_fixes.add_kernel_scan_vars, when=cpu_fixes.no_triton, adds=True),
)

# Read, not replaced: each pinned in tests/test_bridge_pins.py.
RELIED_ON: tuple[str, ...] = (
    _RUNNER + "._bookkeeping_sync",
    _RUNNER + "._get_spec_decode_draft_probs",
    _RUNNER + ".get_model",
    _RUNNER + ".load_model",
    "vllm.v1.worker.cpu_model_runner:CPUModelRunner.load_model",
    "vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata",
    "vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS",
    "vllm.v1.sample.logits_processor:_load_logitsprocs_plugins",
    "vllm.v1.sample.logits_processor:_load_logitsprocs_by_fqcns",
    "vllm.v1.sample.logits_processor.builtin:LogitBiasLogitsProcessor",
    "vllm.v1.sample.logits_processor.builtin:MinPLogitsProcessor",
    "vllm.v1.core.sched.output:SchedulerOutput",
    "vllm.v1.spec_decode.custom_class_proposer:create_custom_proposer",
    "vllm.v1.spec_decode.ngram_proposer:_find_longest_matched_ngram_and_propose_tokens",
    "vllm.engine.arg_utils:EngineArgs.__post_init__",
    "vllm.config.speculative:SpeculativeConfig",
    "vllm.v1.engine.input_processor:InputProcessor.__init__",
    "vllm.forward_context:set_forward_context",
    "vllm.v1.attention.backend:CommonAttentionMetadata",
    "vllm.v1.worker.utils:AttentionGroup.build_metadata",
    "vllm.model_executor.layers.attention.attention:unified_kv_cache_update",
    "vllm.model_executor.models.llama:LlamaDecoderLayer.__init__",
    "vllm.model_executor.models.llama:LlamaModel.embed_input_ids",
    "vllm.distributed.parallel_state:get_tp_group",
    "vllm.v1.sample.rejection_sampler:apply_sampling_constraints",
    # AWRS (logits_processors/awrs.py) replays the sampler's draw
    # (tests/test_bridge_pins_processors.py::test_sampler_draws_as_awrs_replays_them).
    "vllm.v1.sample.sampler:Sampler.greedy_sample",
    "vllm.v1.sample.ops.topk_topp_sampler:TopKTopPSampler.forward_cpu",
    "vllm.v1.sample.ops.topk_topp_sampler:random_sample",
    "vllm.v1.sample.ops.topk_topp_sampler:apply_top_k_top_p",
    "vllm.sampling_params:_SAMPLING_EPS",
    "vllm.v1.worker.block_table:BlockTable.compute_slot_mapping",
    # AWRS weights reach the output (bridge/grammar_weights.py;
    # tests/test_asap_e2e.py::test_smc_over_awrs_weights_follows_the_grammar_conditioned_distribution).
    "vllm.v1.request:Request.num_output_tokens",
    # AWRS reads back the rows vLLM drew from (bridge/v1/grammar_awrs.py;
    # tests/test_bridge_pins_processors.py::test_sampler_divides_the_processors_rows_in_place).
    "vllm.v1.sample.sampler:Sampler.apply_temperature",
    "vllm.v1.engine:EngineCoreOutput",
    "vllm.distributed.parallel_state:GroupCoordinator.first_rank",
    "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding.__init__",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadata",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.build",
    "vllm._custom_ops:cpu_attn_get_scheduler_metadata",
    "vllm.v1.attention.backends.cpu_attn:_get_attn_isa",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder.__init__",
    # Which runner serves an engine (bridge/v2/gate.py).
    "vllm.config.vllm:VllmConfig.use_v2_model_runner",
    # The V2 drafter's interface and what it reads (bridge/v2/).
    "vllm.v1.worker.gpu.spec_decode.speculator:BaseSpeculator",
    "vllm.v1.worker.gpu.states:RequestState",
    "vllm.v1.worker.gpu.input_batch:InputBatch",
    _V2_RUNNER + ":GPUModelRunner.sample",
)


def named(name: str) -> Patch:
    """The patch of ``PATCHES`` called ``name``."""
    for patch in PATCHES:
        if patch.name == name:
            return patch
    raise KeyError(f"the bridge has no patch {name!r}")


def vllm_names() -> list[str]:
    """Every vLLM name we patch or rely on, as ``module:qualname``."""
    return [p.target for p in PATCHES] + list(RELIED_ON)


# On a vLLM the bridge was not checked against (``vllm_plugins.register``),
# this alone: a config naming one of our methods is refused with the reason
# and the supported versions; every other config reaches vLLM unchanged.
UNSUPPORTED_VLLM_PATCHES: tuple[Patch, ...] = (
    Patch("config.unsupported_vllm",
          "vllm.engine.arg_utils:EngineArgs.create_speculative_config",
          "on a vLLM the bridge was not checked against, a speculative config "
          "naming one of our methods is refused with the reason, before a model "
          "loads; nothing else of ours is installed",
          _PINS + "test_engine_args_builds_speculative_config_after_plugins",
          config.wrap_refuse_our_methods),
)
