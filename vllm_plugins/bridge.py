"""The only code that touches vLLM's private internals.

Every patch below names the vLLM 0.32 function it relies on; each is pinned by
tests/test_bridge_pins.py, which fails loudly if vLLM's shape changes.

Data flow inside one worker step (V1 GPUModelRunner, also the CPU runner's base):
  execute_model   -> we note the step's start time
  _sample         -> before vLLM samples, we take the target's top-k per row
                     of the verification logits (grammar masks already applied)
  propose_draft_token_ids
                  -> for our proposers we build a StepContext (per request id)
                     and call proposer.step(ctx) instead of vLLM's raw call;
                     draft probabilities, when given, go to vLLM's rejection
                     sampler through the runner's own draft-probs slot.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import numpy as np
import torch

from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.topk import topk_logprobs

_INSTALLED = False


def install() -> None:
    """Idempotent: patches engine-args translation and the model runner."""
    global _INSTALLED
    if _INSTALLED:
        return
    _patch_engine_args()
    _patch_lookahead()
    _patch_model_runner()
    _patch_worker()
    _patch_cpu_expand()
    _INSTALLED = True


def _patch_cpu_expand() -> None:
    # vllm.v1.sample.rejection_sampler.expand_batch_to_tokens(x, cu_num_tokens,
    #     num_tokens, replace_from=0, replace_to=0) spreads per-request
    # temperature / top_k / top_p over the draft rows before verification.
    # Without Triton (the CPU build), vLLM 0.32 runs its expand_kernel as
    # vllm.utils.cpu_triton_utils._expand_kernel_impl, which casts the output
    # to int64 and writes into that copy: float32 (temperature, top_p) and
    # int32 (top_k) results stay uninitialised, so sampled requests are
    # verified against garbage target probabilities (wrong output
    # distribution, recovered token 0) with every speculative method. Only
    # where Triton is absent; the Triton kernel is correct.
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        return
    import vllm.v1.sample.rejection_sampler as rs

    if getattr(rs.expand_batch_to_tokens, "_vllm_plugins", False):
        return

    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0,
                               replace_to=0):
        counts = torch.diff(cu_num_tokens.to(torch.int64),
                            prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    expand_batch_to_tokens._vllm_plugins = True
    rs.expand_batch_to_tokens = expand_batch_to_tokens


def _patch_worker() -> None:
    # vllm.v1.worker.worker_base.WorkerBase: collective_rpc("name") calls
    # getattr(worker, name)(); string methods need no insecure pickling.
    from vllm.v1.worker.worker_base import WorkerBase

    WorkerBase.vllm_plugins_stats = read_stats


# --------------------------------------------------------------------- config
def _patch_engine_args() -> None:
    # vllm.engine.arg_utils.EngineArgs.create_speculative_config(
    #     self, target_model_config, target_parallel_config) builds
    # SpeculativeConfig(**self.speculative_config); it runs after plugins load.
    from vllm.engine.arg_utils import EngineArgs

    from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR, translate

    original = EngineArgs.create_speculative_config
    if getattr(original, "_vllm_plugins", False):
        return

    @functools.wraps(original)
    def create_speculative_config(self, *args, **kwargs):
        options = None
        if isinstance(self.speculative_config, dict):
            self.speculative_config, options = translate(self.speculative_config)
        config = original(self, *args, **kwargs)
        if config is not None and options is not None:
            # SpeculativeConfig forbids unknown fields in __init__, but the
            # instance has a __dict__, which pickles to the workers with it.
            object.__setattr__(config, PLUGIN_OPTIONS_ATTR, options)
        return config

    create_speculative_config._vllm_plugins = True
    EngineArgs.create_speculative_config = create_speculative_config

    _patch_params_validator()


def _patch_params_validator() -> None:
    # vllm.v1.engine.input_processor.InputProcessor
    #     ._build_logits_processors_params_validator(self) -> Callable[[SamplingParams], None]
    # is built once per engine in the front end. With speculative decoding the
    # V1 runner drops custom logits processors, so a grammar request would be
    # decoded unconstrained: this engine's validator refuses it instead.
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._build_logits_processors_params_validator
    if getattr(original, "_vllm_plugins", False):
        return

    @functools.wraps(original)
    def build_validator(self):
        validate = original(self)
        from vllm_plugins.logits_processors.grammar import (
            engine_drops_processors, refuse_grammar_requests)

        reason = engine_drops_processors(self.vllm_config)
        if reason is None:
            return validate

        def validate_or_refuse(params):
            # vllm.exceptions.VLLMValidationError is what the server answers
            # with HTTP 400 (vLLM converts validate_params' ValueErrors too).
            from vllm.exceptions import VLLMValidationError

            try:
                refuse_grammar_requests(params, reason)
            except ValueError as e:
                raise VLLMValidationError(str(e)) from e
            validate(params)

        return validate_or_refuse

    build_validator._vllm_plugins = True
    InputProcessor._build_logits_processors_params_validator = build_validator


def _patch_lookahead() -> None:
    # vllm.config.VllmConfig.num_lookahead_tokens (property): KV slots the
    # scheduler (allocate_slots) and the worker warmup reserve past the tokens
    # the target runs. Self-drafting methods write their drafts' K/V there,
    # as vLLM's EAGLE does.
    from vllm.config import VllmConfig

    original = VllmConfig.num_lookahead_tokens
    if getattr(original.fget, "_vllm_plugins", False):
        return

    def num_lookahead_tokens(self) -> int:
        base = original.fget(self)
        return max(base, plugin_lookahead(self.speculative_config))

    num_lookahead_tokens._vllm_plugins = True
    VllmConfig.num_lookahead_tokens = property(num_lookahead_tokens)


def plugin_lookahead(speculative_config) -> int:
    """num_speculative_tokens for our methods that draft with the target's
    own layers (they write draft K/V); 0 for every other configuration."""
    from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

    if getattr(speculative_config, PLUGIN_OPTIONS_ATTR, None) is None:
        return 0
    # custom_class: SpeculativeConfig.model holds the proposer's class path.
    import importlib

    from vllm_plugins.registry import METHODS

    module, _, name = str(speculative_config.model).rpartition(".")
    classes = [getattr(importlib.import_module(module), name)]
    # A composing method (grammar) drafts with its "inner" method's class too.
    options = getattr(speculative_config, PLUGIN_OPTIONS_ATTR)
    inner = options.get("inner") if isinstance(options, dict) else None
    inner = inner.get("method") if isinstance(inner, dict) else inner
    if isinstance(inner, str) and inner in METHODS:
        classes.append(METHODS[inner].proposer_class())
    if not any(getattr(cls, "SELF_DRAFT", False) for cls in classes):
        return 0
    return int(speculative_config.num_speculative_tokens or 0)


# ---------------------------------------------------------------- model runner
def _runner_class():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    return GPUModelRunner


def _is_ours(runner) -> bool:
    from vllm_plugins.proposers.base import PluginProposer

    return isinstance(getattr(runner, "drafter", None), PluginProposer)


def _patch_model_runner() -> None:
    cls = _runner_class()
    if getattr(cls, "_vllm_plugins_patched", False):
        return

    # GPUModelRunner.execute_model(self, scheduler_output, intermediate_tensors=None)
    original_execute = cls.execute_model

    @functools.wraps(original_execute)
    def execute_model(self, *args, **kwargs):
        self._vp_step_start = now = time.perf_counter()
        # The engine's time between our last proposal and this step
        # (scheduling, output handling): every step pays it, speculating or not.
        end = self.__dict__.pop("_vp_propose_end", None)
        if end is not None:
            self._vp_gap = now - end
        # A step that schedules no tokens returns before drafting, so finish
        # notices are collected here and handed over at the next draft call.
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            self.__dict__.setdefault("_vp_finished", set()).update(finished)
        return original_execute(self, *args, **kwargs)

    # GPUModelRunner._sample(self, logits, spec_decode_metadata) -> SamplerOutput
    original_sample = cls._sample

    @functools.wraps(original_sample)
    def _sample(self, logits, spec_decode_metadata):
        if logits is not None and _is_ours(self):
            _stash_topk(self, logits, spec_decode_metadata)
            if _verifies_nothing(spec_decode_metadata):
                # With speculation on, vLLM sends every step through the
                # rejection sampler, drafts or none. A step without drafts
                # has one logits row per request, exactly what the plain
                # sampler takes, and its [requests, 1] output is what the
                # rejection sampler gives for no drafts: the plain path is
                # the same step with less work.
                return original_sample(self, logits, None)
        return original_sample(self, logits, spec_decode_metadata)

    # GPUModelRunner.propose_draft_token_ids(self, scheduler_output,
    #     sampled_token_ids, sampling_metadata, hidden_states,
    #     sample_hidden_states, aux_hidden_states, spec_decode_metadata,
    #     common_attn_metadata, slot_mappings) -> list[list[int]]
    original_propose = cls.propose_draft_token_ids

    @functools.wraps(original_propose)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, *args, **kwargs):
        _count_step(self, sampled_token_ids, spec_decode_metadata)
        if not _is_ours(self):
            return original_propose(
                self, scheduler_output, sampled_token_ids, sampling_metadata,
                hidden_states, sample_hidden_states, aux_hidden_states,
                spec_decode_metadata, *args, **kwargs)
        common_attn_metadata = args[0] if args else kwargs.get("common_attn_metadata")
        try:
            return _propose(self, scheduler_output, sampled_token_ids,
                            spec_decode_metadata, common_attn_metadata,
                            aux_hidden_states)
        finally:
            self._vp_propose_end = time.perf_counter()

    # GPUModelRunner._setup_eagle3_aux_hidden_state_outputs(self), called at
    # the end of load_model (CPU runner too): with use_aux_hidden_state_outputs
    # the model returns (hidden, [residual stream after each layer in
    # model.aux_hidden_state_layers]) and the runner hands that list to
    # propose_draft_token_ids. Proposers that learn from the verification
    # pass's intermediate layers (DEL's shadow acceptance) ask for it.
    original_setup_aux = cls._setup_eagle3_aux_hidden_state_outputs

    @functools.wraps(original_setup_aux)
    def _setup_eagle3_aux_hidden_state_outputs(self):
        layers = tuple(getattr(getattr(self, "drafter", None), "aux_layers", ()) or ())
        if layers and _is_ours(self):
            model = self.get_model()
            if not hasattr(model, "set_aux_hidden_state_layers"):
                raise ValueError(
                    f"{type(self.drafter).__name__} needs the verification pass's "
                    "per-layer hidden states, which this model "
                    f"({type(model).__name__}) cannot return (it lacks vLLM's "
                    "SupportsEagle3 interface)")
            model.set_aux_hidden_state_layers(layers)
            self.use_aux_hidden_state_outputs = True
            return None
        return original_setup_aux(self)

    cls._setup_eagle3_aux_hidden_state_outputs = _setup_eagle3_aux_hidden_state_outputs
    cls.execute_model = execute_model
    cls._sample = _sample
    cls.propose_draft_token_ids = propose_draft_token_ids
    cls._vllm_plugins_patched = True


def _count_step(runner, sampled_token_ids, spec_decode_metadata) -> None:
    """Drafted / accepted totals for any drafter, read by the benchmark."""
    stats = runner.__dict__.setdefault(
        "_vp_stats", {"steps": 0, "drafted": 0, "accepted": 0, "tokens": 0})
    stats["steps"] += 1
    if not isinstance(sampled_token_ids, list):
        return
    num_draft = (spec_decode_metadata.num_draft_tokens
                 if spec_decode_metadata is not None else None)
    for i, toks in enumerate(sampled_token_ids):
        stats["tokens"] += len(toks)
        if num_draft is not None and i < len(num_draft) and toks:
            stats["drafted"] += num_draft[i]
            stats["accepted"] += len(toks) - 1


def read_stats(worker) -> dict:
    """collective_rpc target: the runner's counters and our proposer's metrics."""
    runner = worker.model_runner
    out = dict(getattr(runner, "_vp_stats", {}))
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "metrics"):
        out["proposer"] = drafter.metrics()
    return out


def _verifies_nothing(spec_decode_metadata) -> bool:
    """SpecDecodeMetadata.max_spec_len: the most drafts of any request."""
    return spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0


def _stash_topk(runner, logits: torch.Tensor, spec_decode_metadata) -> None:
    k = runner.drafter.topk_wanted()
    draft_ids = None
    if spec_decode_metadata is not None:
        # SpecDecodeMetadata.num_draft_tokens: list[int] per request in batch
        # order; logits has num_draft + 1 rows per request in that order.
        num_draft = list(spec_decode_metadata.num_draft_tokens)
        draft_ids = spec_decode_metadata.draft_token_ids.cpu().numpy()
    else:
        num_draft = [0] * logits.shape[0]
    ids = lps = None
    start = time.perf_counter()
    if k > 0:
        with torch.no_grad():
            lps, idx = topk_logprobs(logits, k)
        ids = idx.cpu().numpy().astype(np.int64)
        lps = lps.cpu().numpy()
    runner._vp_topk = (num_draft, draft_ids, ids, lps)
    runner._vp_topk_seconds = time.perf_counter() - start if k > 0 else 0.0


def build_context(runner, scheduler_output, sampled_token_ids) -> StepContext:
    batch = runner.input_batch
    req_ids = batch.req_ids
    topk = getattr(runner, "_vp_topk", None)
    runner._vp_topk = None
    if topk is not None and len(topk[0]) != len(req_ids):
        topk = None  # rows do not line up with this batch: learn nothing
    num_draft_all = topk[0] if topk else [0] * len(req_ids)
    draft_ids_flat = topk[1] if topk else None
    row = 0
    draft_off = 0
    requests = []
    for i, req_id in enumerate(req_ids):
        accepted = np.asarray(sampled_token_ids[i] if i < len(sampled_token_ids)
                              else [], dtype=np.int64)
        n = int(batch.num_tokens_no_spec[i])
        context = batch.token_ids_cpu[i, :n]
        num_draft = int(num_draft_all[i])
        drafts = (draft_ids_flat[draft_off:draft_off + num_draft]
                  if draft_ids_flat is not None else np.zeros(0, np.int64))
        draft_off += num_draft
        base = n - len(accepted)  # tokens before this step's output
        prev = context[base - 1:base] if base > 0 else np.zeros(0, np.int64)
        verified = np.concatenate([prev.astype(np.int64), drafts.astype(np.int64)])
        rows = slice(row, row + num_draft + 1)
        row += num_draft + 1
        ids = lps = None
        if topk is not None and topk[2] is not None and len(accepted) > 0:
            ids, lps = topk[2][rows], topk[3][rows]
        state = runner.requests.get(req_id)
        params = getattr(state, "sampling_params", None)
        temperature = float(getattr(params, "temperature", 0.0) or 0.0)
        requests.append(RequestStep(
            req_id=req_id,
            accepted=accepted,
            context=context,
            num_prompt_tokens=int(batch.num_prompt_tokens[i]),
            num_draft=num_draft if len(accepted) > 0 else 0,
            verified_tokens=verified,
            topk_ids=ids,
            topk_logprobs=lps,
            temperature=temperature,
            sampling_params=params,
            group_id=_group_of(req_id, state),
        ))
    start = getattr(runner, "_vp_step_start", None)
    ctx = StepContext(
        requests=requests,
        finished=_take_finished(runner, scheduler_output),
        max_draft=runner.drafter.max_draft,
        last_step_seconds=(time.perf_counter() - start) if start else None,
        last_step_tokens=int(scheduler_output.total_num_scheduled_tokens),
        last_topk_seconds=runner.__dict__.pop("_vp_topk_seconds", None),
        last_gap_seconds=runner.__dict__.pop("_vp_gap", None),
    )
    return ctx


def _take_finished(runner, scheduler_output) -> set[str]:
    finished = set(runner.__dict__.pop("_vp_finished", ()))
    finished.update(getattr(scheduler_output, "finished_req_ids", ()) or ())
    return finished


def _group_of(req_id: str, state) -> str:
    """Samples of one prompt share a group: vLLM names n>1 children 'i_parent'."""
    head, sep, tail = req_id.partition("_")
    if sep and head.isdigit() and getattr(getattr(state, "sampling_params", None),
                                          "n", 1) == 1 and tail:
        return tail
    return req_id


def _propose(runner, scheduler_output, sampled_token_ids, spec_decode_metadata,
             common_attn_metadata=None, aux_hidden_states=None):
    ctx = build_context(runner, scheduler_output, sampled_token_ids)
    if getattr(runner.drafter, "SELF_DRAFT", False) and common_attn_metadata is not None:
        _add_self_draft(runner, ctx, common_attn_metadata, aux_hidden_states)
    drafts: Drafts = runner.drafter.step(ctx)
    tokens = [list(map(int, t)) for t in drafts.tokens]
    _set_draft_probs(runner, drafts, ctx)
    return tokens


def _add_self_draft(runner, ctx: StepContext, common_attn_metadata,
                    aux_hidden_states) -> None:
    """The target's layers, and where each request's verified rows are.

    CommonAttentionMetadata (the step's, as the runner passes it to
    propose_draft_token_ids): block_table_tensor rows follow the batch order;
    query_start_loc_cpu gives each request's scheduled token rows, whose last
    num_draft + 1 were verified.
    """
    from vllm_plugins.self_draft import TargetLayers

    ctx.target = TargetLayers(runner, common_attn_metadata.block_table_tensor)
    qsl = common_attn_metadata.query_start_loc_cpu.numpy()
    for i, req in enumerate(ctx.requests):
        if i + 1 < len(qsl) and not req.in_prefill:
            end = int(qsl[i + 1])
            req.verify_rows = np.arange(end - req.num_draft - 1, end)
    if aux_hidden_states:
        # The model appends streams in layer order (set_aux_hidden_state_layers
        # stores the sorted set).
        layers = sorted(set(getattr(runner.drafter, "aux_layers", ())))
        ctx.aux_streams = dict(zip(layers, aux_hidden_states))


def _set_draft_probs(runner, drafts: Drafts, ctx: StepContext) -> None:
    # GPUModelRunner._draft_probs [num_reqs, max_draft, vocab] and
    # _draft_prob_req_ids: read by _get_spec_decode_draft_probs() next step and
    # handed to the rejection sampler. Only used when some request has probs.
    if drafts.probs is None or not any(p is not None and len(p) for p in drafts.probs):
        return
    vocab = runner.input_batch.vocab_size
    out = torch.zeros(len(ctx.requests), ctx.max_draft, vocab, dtype=torch.float32)
    for i, (p, t) in enumerate(zip(drafts.probs, drafts.tokens)):
        if p is None:
            # A deterministic draft: all mass on the drafted token.
            for j, tok in enumerate(t):
                out[i, j, int(tok)] = 1.0
        else:
            out[i, :len(p)] = torch.from_numpy(np.asarray(p, dtype=np.float32))
    runner._draft_probs = out.to(runner.device)
    runner._draft_prob_req_ids = list(runner.input_batch.req_ids)
