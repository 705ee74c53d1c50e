"""The V1 model runner's step, extended for our proposers only.

Each wrapper below first looks for our ``RunnerState`` on the runner and,
where there is none (plain decoding, vLLM's own drafters), calls vLLM's code
and does nothing else. The tree step's wrappers (``_prepare_inputs``,
``_model_forward``, each attention layer's forward) are not even there
until the runner's proposer drafts its first tree (``route_trees``), and
the attention wrapper is on the layers only during a tree step's forward.
Data flow inside one step of a runner that drafts with one of our proposers:

  execute_model           -> note the step's start (the cost model's clock)
  _prepare_inputs         -> a tree step: rotary positions by depth, the
                             ancestry masks for attention (tree_step.py)
  _model_forward          -> a tree step: its plan enters vLLM's forward
                             context, where attention reads it, and the
                             attention wrapper goes on every layer for
                             that forward alone
  _sample                 -> take the target's top-k per verified row
                             before vLLM samples (grammar masks applied);
                             a tree step: accept paths, move their K/V
  propose_draft_token_ids -> build a StepContext keyed by request id and
                             call proposer.step(ctx) instead of vLLM's call
"""

from __future__ import annotations

import functools
import time

import torch

from vllm_plugins.bridge import ranks
from vllm_plugins.bridge.state import attach, state_of
from vllm_plugins.bridge.v1 import grammar_awrs, step, tree_step
from vllm_plugins.topk import first_is_argmax


def is_ours(drafter) -> bool:
    from vllm_plugins.drafter import Drafter

    return isinstance(drafter, Drafter)


def wrap_after_load(original):
    # GPUModelRunner._setup_eagle3_aux_hidden_state_outputs(self) is called
    # once, at the end of load_model (GPU and CPU runners), right after
    # drafter.load_model(model): where a runner whose drafter is ours gets its
    # state, a self-drafting proposer's target is checked, and a proposer that
    # learns from the verification pass's intermediate layers (DEL) asks for
    # them through vLLM's EAGLE-3 route (the model then returns
    # (hidden, [residual stream after each of model.aux_hidden_state_layers])).
    @functools.wraps(original)
    def after_load(self):
        drafter = getattr(self, "drafter", None)
        if not is_ours(drafter):
            return original(self)
        state = attach(self, drafter)
        ranks.join_tensor_parallel()
        state.tree_refusal = runner_tree_refusal(self)
        if drafter.SELF_DRAFT:
            from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR
            from vllm_plugins.bridge.v1.target_layers import check_target

            options = getattr(self.vllm_config.speculative_config,
                              PLUGIN_OPTIONS_ATTR, None) or {}
            check_target(self, options.get("method", type(drafter).__name__))
        layers = tuple(drafter.aux_layers)
        if not layers:
            return original(self)
        model = self.get_model()
        if not hasattr(model, "set_aux_hidden_state_layers"):
            raise ValueError(
                f"{type(drafter).__name__} needs the verification pass's "
                "per-layer hidden states, which this model "
                f"({type(model).__name__}) cannot return (it lacks vLLM's "
                "SupportsEagle3 interface)")
        model.set_aux_hidden_state_layers(layers)
        self.use_aux_hidden_state_outputs = True
        return None

    return after_load


def wrap_execute_model(original):
    # GPUModelRunner.execute_model(self, scheduler_output, intermediate_tensors=None)
    @functools.wraps(original)
    def execute_model(self, *args, **kwargs):
        state = state_of(self)
        if state is None or state.proposer is None:
            return original(self, *args, **kwargs)
        state.step_start = now = time.perf_counter()
        if state.propose_end is not None:
            state.gap_seconds = now - state.propose_end
            state.propose_end = None
        # A step that schedules no tokens returns before drafting, so finish
        # notices are held here and handed over at the next proposal.
        scheduler_output = args[0] if args else kwargs.get("scheduler_output")
        finished = getattr(scheduler_output, "finished_req_ids", None)
        if finished:
            state.finished.update(finished)
        return original(self, *args, **kwargs)

    return execute_model


def runner_tree_refusal(runner) -> str | None:
    """Why this runner cannot verify tree drafts (None: it can): its rotary
    positions, or its attention layers (``tree_step.attention_tree_refusal``,
    with the kernel ISA vLLM will pick). A proposer asked for trees (option
    ``draft_shape``) on such a runner is refused at start-up; otherwise trees
    are cut to chains, step by step."""
    from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

    why = None
    if getattr(runner, "uses_mrope", False):
        why = "tree drafts need plain rotary positions (this model uses M-RoPE)"
    if why is None:
        why = tree_step.attention_tree_refusal(runner.get_model(),
                                               start_up_isa(runner.vllm_config))
    options = getattr(runner.vllm_config.speculative_config, PLUGIN_OPTIONS_ATTR, None) or {}
    if why is not None and options.get("draft_shape") == "tree":
        raise ValueError(f"draft_shape='tree' cannot be served here: {why}; "
                         "use draft_shape='chain'")
    return why


def start_up_isa(vllm_config):
    """impl -> the kernel ISA vLLM's CPU backend will give that layer once
    the cache exists: CPUAttentionMetadataBuilder.__init__ calls
    ``_get_attn_isa(model dtype, block size, head size, cache dtype)``, the
    block size being the cache's (the backend's kernels take any multiple of
    32). Lets a tree refusal for the cache layout come at start-up."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    dtype = vllm_config.model_config.dtype
    cache = vllm_config.cache_config

    def isa_of(impl) -> str:
        return _get_attn_isa(dtype, cache.block_size, impl.head_size, cache.cache_dtype)

    return isa_of


def wrap_prepare_inputs(original):
    # GPUModelRunner._prepare_inputs(self, scheduler_output, num_scheduled_tokens)
    # computes positions, then the slot mapping from them, into the tensors
    # the forward reads (self.positions; the block table's slot_mapping).
    @functools.wraps(original)
    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        out = original(self, scheduler_output, num_scheduled_tokens)
        state = state_of(self)
        if state is None:
            return out
        state.tree_step = None  # only this step's plan may reach its forward
        if not state.trees:
            return out
        batch = self.input_batch
        total = int(scheduler_output.total_num_scheduled_tokens)
        plan = tree_step.plan(
            state.trees, batch.req_ids, num_scheduled_tokens,
            batch.num_computed_tokens_cpu,
            scheduler_output.scheduled_spec_decode_tokens,
            batch.block_table[0].slot_mapping.gpu[:total].cpu().numpy())
        state.tree_step = plan
        if plan is not None:
            plan.cache_views = state.cache_views
            tree_step.depth_positions(plan, self.positions)
        return out

    return _prepare_inputs


def wrap_model_forward(original):
    # GPUModelRunner._model_forward(self, input_ids, positions, ...): the
    # step's forward (dummy and profiling runs call self.model instead). The
    # attention route is on the runner's attention layers for a tree step's
    # forward alone, each layer's wrapper bound to this runner's state, whose
    # plan it reads (the other steps' layers run vLLM's forward with no frame
    # of ours).
    @functools.wraps(original)
    def _model_forward(self, *args, **kwargs):
        state = state_of(self)
        if state is None or state.tree_step is None or state.tree_attention is None:
            return original(self, *args, **kwargs)
        attention = state.tree_attention
        attention.on()
        try:
            return original(self, *args, **kwargs)
        finally:
            attention.off()

    return _model_forward


# Per-instance patches (bridge.patches) that make up the tree route: on the
# runner, and on each of its attention layers.
RUNNER_TREE_ROUTE = ("tree.depth_positions", "tree.forward_plan")
ATTENTION_TREE_ROUTE = "tree.cpu_attention"


def route_trees(runner, state) -> None:
    """Puts the tree route on this runner, once, when its proposer has
    drafted its first tree: that tree is verified at the next step, whose
    ``_prepare_inputs`` plans it; and holds the attention route ready for
    its attention layers (``patching.hold``), which ``_model_forward`` puts
    on them for each tree step's forward and takes off after; the accepted
    K/V's move is compiled for its caches now. An engine that
    never drafts a tree (chains, vLLM's own drafters, plain decoding) keeps
    vLLM's methods and attention as they are, at no cost per step or per
    layer, and so does a routed runner's step that verifies no tree."""
    from vllm_plugins.bridge.patches import named
    from vllm_plugins.bridge.patching import apply_to, hold

    for name in RUNNER_TREE_ROUTE:
        apply_to(named(name), runner)
    # GPUModelRunner.kv_caches: set when vLLM allocates the cache, before any step.
    tree_step.warm_up_kv_move(getattr(runner, "kv_caches", ()), state.cache_views)
    attention = named(ATTENTION_TREE_ROUTE)
    owner, _ = attention.owner_and_attr()
    state.tree_attention = hold(attention, [
        module.impl for module in runner.get_model().modules()
        if isinstance(getattr(module, "impl", None), owner)], state)
    state.trees_routed = True


def wrap_cpu_attention(original):
    # CPUAttentionBackendImpl.forward(self, layer, query, key, value, kv_cache,
    #     attn_metadata, output, ...) -> output: attention only (the backend's
    # forward_includes_kv_cache_update is False: vLLM wrote this step's K/V
    # before). Held on a runner's layers during its tree steps' forwards only
    # (route_trees), bound to that runner's state: tree requests' rows by
    # their ancestry masks, the other requests' by vLLM's forward over them
    # alone. A forward left the code cold, so each layer's call reads the plan
    # from the state it carries and makes no closure.
    @functools.wraps(original)
    def forward(self, state, layer, query, key, value, kv_cache, attn_metadata, output,
                *args, **kwargs):
        plan = state.tree_step
        if plan is None or attn_metadata is None or self.attn_type != "decoder":
            return original(self, layer, query, key, value, kv_cache, attn_metadata,
                            output, *args, **kwargs)
        tree_step.attend(plan, self, layer, query, key, value, kv_cache, attn_metadata,
                         output, original, args, kwargs)
        return output

    return forward


def wrap_sample(original):
    # GPUModelRunner._sample(self, logits, spec_decode_metadata) -> SamplerOutput
    # Our grammar processors' AWRS rows may be left to vLLM's own draw and
    # checked after it (grammar_awrs).
    @functools.wraps(original)
    def _sample(self, logits, spec_decode_metadata):
        plain = spec_decode_metadata is None or step.verifies_nothing(spec_decode_metadata)
        grammar = grammar_awrs.before_sample(self, plain)
        out = _sample_step(self, logits, spec_decode_metadata)
        grammar_awrs.after_sample(grammar, out)
        return out

    def _sample_step(self, logits, spec_decode_metadata):
        state = state_of(self)
        if state is None or state.proposer is None or logits is None:
            return original(self, logits, spec_decode_metadata)
        step.stash_topk(state, logits, spec_decode_metadata)
        plan, state.tree_step = state.tree_step, None
        if plan is not None and spec_decode_metadata is not None:
            return tree_sample(self, original, plan, logits, spec_decode_metadata)
        if step.verifies_nothing(spec_decode_metadata):
            # With speculation on, vLLM sends every step through the
            # rejection sampler, drafts or none. A step without drafts has
            # one logits row per request, exactly what the plain sampler
            # takes, and its [requests, 1] output is what the rejection
            # sampler gives for no drafts: the same step with less work.
            return original(self, logits, None)
        return original(self, logits, spec_decode_metadata)

    return _sample


def tree_sample(runner, original, plan, logits, spec_decode_metadata):
    """vLLM samples every request (chains exactly as without trees); tree
    requests' rows are then replaced by tree acceptance, and their accepted
    K/V moved to the slots chain decoding uses. A step whose requests are
    all trees skips vLLM's rejection sampler, whose every row acceptance
    would overwrite."""
    num_draft = list(spec_decode_metadata.num_draft_tokens)
    starts = tree_step.request_rows(plan, num_draft)
    counters = state_of(runner).counters
    if only_trees(runner, plan, num_draft):
        # Every row is a tree row, in order, and vLLM's sampler (which may
        # process logits in place) does not run: the rows need no copy
        # (acceptance reads them in float32: tree_step.accept).
        tree_logits = logits
        out = None   # made from the results: tree_step.trees_output
        counters.tree_only_steps += 1
    else:
        index = torch.cat([torch.arange(s, s + len(r.tokens) + 1)
                           for s, r in zip(starts, plan.requests)]).to(logits.device)
        tree_logits = logits.index_select(0, index)
        held = held_generators(plan, runner.input_batch.sampling_metadata)
        out = original(runner, logits, spec_decode_metadata)
        for generator, state in held:
            generator.set_state(state)
    params = [getattr(runner.requests.get(r.req_id), "sampling_params", None)
              for r in plan.requests]
    results = tree_step.accept(plan, params, tree_logits, num_draft,
                               runner.input_batch.sampling_metadata,
                               stash_top1(state_of(runner).topk, logits, plan, starts))
    if out is None:
        out = tree_step.trees_output(plan, results, len(num_draft),
                                     spec_decode_metadata.max_spec_len, logits.device)
    else:
        tree_step.write_output(out.sampled_token_ids, plan, results)
    src, dst = [], []
    for r, a in zip(plan.requests, results):
        s, d = tree_step.kv_moves(r, a.nodes)
        src += s
        dst += d
    tree_step.move_accepted_kv(runner.kv_caches, src, dst, plan.cache_views)
    counters.tree_steps += 1
    counters.tree_requests += len(plan.requests)
    counters.kv_moved += len(src)
    return out


def stash_top1(stash, logits, plan, starts) -> list | None:
    """The tree rows' argmax from this step's top-k stash (``stash_topk``
    ran first), where it holds the argmax's tie rule; else None."""
    if stash is None or stash.ids is None or not first_is_argmax(logits, stash.ids.shape[1]):
        return None
    return tree_step.stash_top1(stash.ids, stash.logprobs, starts, plan)


def held_generators(plan, sampling_metadata) -> list:
    """(generator, state) of each seeded tree request, to put back after
    vLLM's sampler. That sampler draws from the generator of every seeded
    request with drafts (its bonus, uniform and recovered draws), tree
    requests included, before tree acceptance draws their tokens; put back,
    a tree request's tokens are the same beside other requests as in a step
    of its own, whose sampler does not run (vLLM keeps requests without
    drafts out of those draws for the same reason)."""
    generators = getattr(sampling_metadata, "generators", None) or {}
    held = [generators.get(r.batch_index) for r in plan.requests]
    return [(g, g.get_state()) for g in held if g is not None]


def only_trees(runner, plan, num_draft) -> bool:
    """Whether vLLM's sampler has nothing to do this step: every request is
    a tree request (so none asks for logprobs: ``tree_allowed``) and nothing
    of the runner's async scheduling waits on the sampler's bookkeeping."""
    return (len(plan.requests) == len(num_draft)
            and not getattr(runner, "use_async_scheduling", False)
            and runner.input_batch.sampling_metadata.max_num_logprobs is None)


def wrap_propose(original):
    # GPUModelRunner.propose_draft_token_ids(self, scheduler_output,
    #     sampled_token_ids, sampling_metadata, hidden_states,
    #     sample_hidden_states, aux_hidden_states, spec_decode_metadata,
    #     common_attn_metadata, slot_mappings) -> list[list[int]]
    @functools.wraps(original)
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids,
                                sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states,
                                spec_decode_metadata, *args, **kwargs):
        state = state_of(self)
        if state is None:
            return original(self, scheduler_output, sampled_token_ids,
                            sampling_metadata, hidden_states, sample_hidden_states,
                            aux_hidden_states, spec_decode_metadata, *args, **kwargs)
        state.counters.count(sampled_token_ids, (
            list(spec_decode_metadata.num_draft_tokens)
            if spec_decode_metadata is not None else None))
        if state.proposer is None:  # a benchmark counting vLLM's own drafter
            return original(self, scheduler_output, sampled_token_ids,
                            sampling_metadata, hidden_states, sample_hidden_states,
                            aux_hidden_states, spec_decode_metadata, *args, **kwargs)
        common_attn_metadata = args[0] if args else kwargs.get("common_attn_metadata")
        try:
            drafts = step.propose(self, state, scheduler_output, sampled_token_ids,
                                  common_attn_metadata, aux_hidden_states)
            if state.trees and not state.trees_routed:
                route_trees(self, state)
            return drafts
        finally:
            state.propose_end = time.perf_counter()

    return propose_draft_token_ids
