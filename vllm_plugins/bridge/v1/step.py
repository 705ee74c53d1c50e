"""One engine step as our proposers see it, built from the runner's arrays.

These functions read vLLM's runner objects (named field by field, pinned in
tests/test_bridge_pins.py) but replace nothing: the patches in
``vllm_plugins.bridge.v1.runner`` call them, and tests call them on stand-in
runners without an engine.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_plugins.bridge import ranks
from vllm_plugins.bridge.groups import group_of
from vllm_plugins.bridge.state import RunnerState, TopkStash
from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.topk import topk_logprobs_numpy

logger = logging.getLogger("vllm_plugins")


def verifies_nothing(spec_decode_metadata) -> bool:
    """SpecDecodeMetadata.max_spec_len: the most drafts of any request."""
    return spec_decode_metadata is not None and spec_decode_metadata.max_spec_len == 0


def stash_topk(state: RunnerState, logits: torch.Tensor, spec_decode_metadata) -> None:
    """The target's top-k per verified row, for the next proposal to learn from.

    No ``torch.no_grad`` here: ``GPUModelRunner.sample_tokens``, which calls
    ``_sample``, runs under inference mode already, and entering the context
    costs tens of microseconds after a forward has evicted its code."""
    k = state.proposer.topk_wanted()
    draft_ids = None
    if spec_decode_metadata is not None:
        # SpecDecodeMetadata.num_draft_tokens: list[int] per request in batch
        # order; logits has num_draft + 1 rows per request in that order.
        num_draft = list(spec_decode_metadata.num_draft_tokens)
        draft_ids = spec_decode_metadata.draft_token_ids
        draft_ids = (draft_ids if draft_ids.is_cpu else draft_ids.cpu()).numpy()
    else:
        num_draft = [0] * logits.shape[0]
    ids = lps = None
    start = time.perf_counter()
    if k > 0:
        lps, ids = topk_logprobs_numpy(logits, k)
    seconds = time.perf_counter() - start if k > 0 else 0.0
    state.topk = TopkStash(num_draft, draft_ids, ids, lps, seconds)


def take_finished(state: RunnerState, scheduler_output) -> set[str]:
    """Finished ids held since the last proposal plus this step's own."""
    finished = state.finished
    state.finished = set()
    finished.update(getattr(scheduler_output, "finished_req_ids", ()) or ())
    return finished


def build_context(runner, state: RunnerState, scheduler_output,
                  sampled_token_ids) -> StepContext:
    """Re-keys the runner's batch arrays by request id and adds the target's
    top-k at each verified position.

    Reads InputBatch.req_ids / num_tokens_no_spec / token_ids_cpu /
    num_prompt_tokens (this step's accepted tokens already counted: vLLM's
    _bookkeeping_sync runs first) and runner.requests[req_id].sampling_params.
    """
    batch = runner.input_batch
    req_ids = batch.req_ids
    topk, state.topk = state.topk, None
    if topk is not None and len(topk.num_draft) != len(req_ids):
        topk = None  # rows do not line up with this batch: learn nothing
    num_draft_all = topk.num_draft if topk else [0] * len(req_ids)
    draft_ids_flat = topk.draft_ids if topk else None
    row = 0
    draft_off = 0
    requests = []
    finished = take_finished(state, scheduler_output)
    parsed = state.speculation
    for req_id in finished:
        parsed.pop(req_id, None)
    for i, req_id in enumerate(req_ids):
        accepted = np.asarray(sampled_token_ids[i] if i < len(sampled_token_ids)
                              else [], dtype=np.int64)
        n = int(batch.num_tokens_no_spec[i])
        context = batch.token_ids_cpu[i, :n]
        num_draft = int(num_draft_all[i])
        base = n - len(accepted)  # tokens before this step's output
        # The last token before this step's output (none at the first), then
        # the drafts, written into one array: no array is made to be joined.
        first = 1 if base > 0 else 0
        drafts = (draft_ids_flat[draft_off:draft_off + num_draft]
                  if draft_ids_flat is not None else ())
        draft_off += num_draft
        verified = np.empty(first + len(drafts), np.int64)
        if first:
            verified[0] = context[base - 1]
        verified[first:] = drafts
        rows = slice(row, row + num_draft + 1)
        row += num_draft + 1
        ids = lps = None
        if topk is not None and topk.ids is not None and len(accepted) > 0:
            ids, lps = topk.ids[rows], topk.logprobs[rows]
        req_state = runner.requests.get(req_id)
        params = getattr(req_state, "sampling_params", None)
        temperature = float(getattr(params, "temperature", 0.0) or 0.0)
        if req_id not in parsed:
            # Imported here: the bridge's modules load without numba (which
            # the proposers' package imports), as plain vLLM needs on a vLLM
            # the bridge was not checked against (vllm_plugins.register).
            from vllm_plugins.proposers.sources.request import worker_speculation

            parsed[req_id] = worker_speculation(params, state.proposer.max_draft)
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
            group_id=group_of(req_id, params),
            speculation=parsed[req_id],
        ))
    gap, state.gap_seconds = state.gap_seconds, None
    # Controllers decide from these seconds: under tensor parallel every rank
    # takes the first rank's (one broadcast per step), on one rank its own.
    step_seconds, propose_seconds, topk_seconds, gap = ranks.first_rank_values(
        time.perf_counter() - state.step_start if state.step_start else None,
        state.propose_seconds,
        topk.seconds if topk is not None else None,
        gap)
    return StepContext(
        requests=requests,
        finished=finished,
        max_draft=state.proposer.max_draft,
        last_step_seconds=step_seconds,
        last_step_tokens=int(scheduler_output.total_num_scheduled_tokens),
        last_propose_seconds=propose_seconds,
        last_topk_seconds=topk_seconds,
        last_gap_seconds=gap,
        masked_topk=take_masked_topk(runner, state.proposer),
    )


def take_masked_topk(runner, drafter):
    """This step's recording of the target's top-k after our grammar
    processor's mask (``logits_processors.grammar_topk``), for a drafter
    that learns it; None otherwise. The processor is asked for the
    drafter's k here, so it records from the engine's second step on."""
    k = drafter.masked_topk_wanted()
    if not k:
        return None
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    procs = getattr(getattr(runner.input_batch, "logitsprocs", None), "all", None) or ()
    taken = None
    for proc in procs:
        if isinstance(proc, GrammarLogitsProcessor):
            proc.masked_topk.want(k)
            recording = proc.masked_topk.take()
            if recording.rows:  # a duplicate processor stays idle
                taken = recording
    return taken


def add_self_draft(runner, proposer, ctx: StepContext, common_attn_metadata,
                   aux_hidden_states) -> None:
    """The target's layers, and where each request's verified rows are.

    CommonAttentionMetadata (the step's, as the runner passes it to
    propose_draft_token_ids): block_table_tensor rows follow the batch order;
    query_start_loc_cpu gives each request's scheduled token rows, whose last
    num_draft + 1 were verified.
    """
    from vllm_plugins.bridge.v1.target_layers import TargetLayers

    ctx.target = TargetLayers(runner, common_attn_metadata.block_table_tensor)
    qsl = common_attn_metadata.query_start_loc_cpu.numpy()
    for i, req in enumerate(ctx.requests):
        if i + 1 < len(qsl) and not req.in_prefill:
            end = int(qsl[i + 1])
            req.verify_rows = np.arange(end - req.num_draft - 1, end)
    if aux_hidden_states:
        # The model appends streams in layer order (set_aux_hidden_state_layers
        # stores the sorted set).
        layers = sorted(set(proposer.aux_layers))
        ctx.aux_streams = dict(zip(layers, aux_hidden_states))


class DraftProbRows:
    """The step's draft probabilities, made dense only where vLLM reads them.

    GPUModelRunner._get_spec_decode_draft_probs() reads
    ``self._draft_probs[row_idx, :num_draft]`` for each request it verifies
    next step and concatenates those rows for the rejection sampler. Holding
    the proposer's per-request arrays here, instead of a
    [requests, max_draft, vocab] tensor, keeps memory to the drafted rows
    that are actually verified: a request whose draft is deterministic gets
    its one-hot rows built then, and one without drafts costs nothing.
    """

    def __init__(self, tokens: list[list[int]], probs: list, vocab: int, device):
        self.tokens = tokens
        self.probs = probs
        self.vocab = vocab
        self.device = device

    def __getitem__(self, key) -> torch.Tensor:
        row, cols = key
        tokens = self.tokens[row][cols]
        p = self.probs[row]
        if p is None:  # a deterministic draft: all mass on the drafted token
            out = torch.zeros(len(tokens), self.vocab, dtype=torch.float32)
            out[torch.arange(len(tokens)), torch.as_tensor(tokens, dtype=torch.int64)] = 1.0
        else:
            out = torch.from_numpy(np.ascontiguousarray(
                np.asarray(p, dtype=np.float32)[cols]))
        return out.to(self.device)


def set_draft_probs(runner, drafts: Drafts, tokens: list[list[int]]) -> None:
    # GPUModelRunner._draft_probs and _draft_prob_req_ids: read by
    # _get_spec_decode_draft_probs() next step and handed to the rejection
    # sampler. Only set when some request has probabilities; otherwise vLLM
    # treats every draft as deterministic, with no probability rows at all.
    if drafts.probs is None or not any(p is not None and len(p) for p in drafts.probs):
        return
    runner._draft_probs = DraftProbRows(tokens, list(drafts.probs),
                                        int(runner.input_batch.vocab_size),
                                        runner.device)
    runner._draft_prob_req_ids = list(runner.input_batch.req_ids)


def record_trees(runner, state: RunnerState, ctx: StepContext, drafts: Drafts):
    """The token lists (and probability rows) vLLM gets: trees are kept for
    the next step's verification (bridge/v1/tree_step.py), or cut to their
    chain prefix where this runner or the request cannot take a tree."""
    from vllm_plugins.bridge.v1.tree_step import record_drafts

    for req_id in ctx.finished:
        state.trees.pop(req_id, None)
    if not state.tree_layout_checked:  # the cache exists from the first step on
        from vllm_plugins.bridge.v1.tree_step import attention_tree_refusal

        state.tree_layout_checked = True
        state.tree_refusal = (state.tree_refusal
                              or attention_tree_refusal(runner.get_model()))
    drafts = check_drafts(runner, state, [r.req_id for r in ctx.requests], drafts)
    params = {r.req_id: r.sampling_params for r in ctx.requests}
    # One KV cache group: the tree step reads one slot mapping.
    groups = getattr(getattr(runner.input_batch, "block_table", None), "block_tables", ())
    capable = state.tree_refusal is None and len(groups) == 1
    return record_drafts(state.trees, [r.req_id for r in ctx.requests], drafts,
                         params.get, capable)


def check_drafts(runner, state: RunnerState, req_ids, drafts: Drafts) -> Drafts:
    """The drafts with each malformed request's draft dropped
    (``vllm_plugins.tree.checked``): logged once per proposer, counted."""
    from vllm_plugins.tree.checked import drop_malformed

    vocab = getattr(runner.input_batch, "vocab_size", None)
    drafts, bad = drop_malformed(drafts, req_ids, None if vocab is None else int(vocab),
                                 state.proposer.max_draft)
    if bad:
        state.counters.malformed_drafts += len(bad)
        if not state.malformed_logged:
            state.malformed_logged = True
            req_id, why = bad[0]
            logger.error("%s proposed a malformed draft for request %s (%s); such "
                         "drafts are dropped, the request decodes on (logged once, "
                         "counted in malformed_drafts)",
                         type(state.proposer).__name__, req_id, why)
    return drafts


def agree_across_ranks(state: RunnerState, ctx: StepContext, tokens: list[list[int]],
                       probs: list | None) -> None:
    """Under tensor parallel, each request whose draft differs between
    ranks (``ranks.differing_drafts``) drafts nothing this step, on every
    rank (in place); logged once, counted in ``rank_disagreements``."""
    if not ranks.in_tensor_parallel():
        return
    digests = []
    for i, r in enumerate(ctx.requests):
        tree = state.trees.get(r.req_id)
        digests.append(ranks.draft_digest(
            tokens[i], None if tree is None else tree.parents,
            probs[i] if probs is not None else None))
    differ = ranks.differing_drafts(digests)
    for i in differ:
        tokens[i] = []
        if probs is not None:
            probs[i] = None
        state.trees.pop(ctx.requests[i].req_id, None)
    if differ:
        state.counters.rank_disagreements += len(differ)
        if not state.rank_disagreement_logged:
            state.rank_disagreement_logged = True
            logger.warning("%s drafted differently on tensor-parallel ranks for request "
                           "%s; such drafts are dropped on every rank for that step "
                           "(logged once, counted in rank_disagreements)",
                           type(state.proposer).__name__, ctx.requests[differ[0]].req_id)


def propose(runner, state: RunnerState, scheduler_output, sampled_token_ids,
            common_attn_metadata=None, aux_hidden_states=None) -> list[list[int]]:
    """Our proposer's drafts for this step, in batch order."""
    proposer = state.proposer
    ctx = build_context(runner, state, scheduler_output, sampled_token_ids)
    if proposer.SELF_DRAFT and common_attn_metadata is not None:
        add_self_draft(runner, proposer, ctx, common_attn_metadata, aux_hidden_states)
    start = time.perf_counter()
    drafts: Drafts = proposer.step(ctx)
    state.propose_seconds = time.perf_counter() - start
    tokens, probs = record_trees(runner, state, ctx, drafts)
    agree_across_ranks(state, ctx, tokens, probs)
    set_draft_probs(runner, Drafts(tokens, probs), tokens)
    if state.digest is not None:
        state.digest.add(ctx, tokens, drafts.probs)
    return tokens
