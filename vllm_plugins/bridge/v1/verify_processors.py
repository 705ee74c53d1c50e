"""Logits processors under speculative decoding on the V1 runner, for
engines that draft with our proposers.

vLLM 0.32's V1 runner builds only ``min_tokens`` when speculation is on
(``build_logitsprocs``), refuses ``min_p`` and ``logit_bias`` per request
(``SamplingParams._validate_spec_decode``, which ``bridge.config`` lets
through for our engines on either runner) and runs no custom processor: its
rejection sampler has no notion of "the processor's state at draft position
j". For engines whose drafter is ours, the bridge applies at every verified
row what plain decoding applies at that position, in plain decoding's order:

* the bonus rows (one per request, after all its drafts) go through vLLM's
  plain ``Sampler``, which runs every processor there: ``logit_bias`` and
  ``min_p`` as in plain decoding, and, told the step's drafts
  (``RejectionSampler.forward``), our grammar processor masks each after
  the drafts and ``min_tokens`` counts them (vLLM's ``apply`` counts only
  the committed output, so a bonus row whose drafts reach ``min_tokens``
  would keep its stop tokens masked where plain decoding may stop);
* the target rows (row j of a request: after its drafts[:j]) get, in
  the plain sampler's order, ``allowed_token_ids``, bad words and
  ``min_tokens`` (vLLM's per-position versions, before our grammar
  processor, whose aligned requests normalise the row they receive), then
  ``logit_bias`` and our grammar processor's per-position mask, then vLLM's
  penalties (vLLM's own pass runs those masks again: they are idempotent),
  and ``min_p`` after them, on the rows divided by the temperature exactly
  as the sampler divides them, so the rejection sampler's temperature and
  top-k/top-p follow as in plain decoding
  (``RejectionSampler.apply_logits_processors``).

Engines with vLLM's own drafters, or none, keep vLLM's behaviour. Our
grammar processor's ``"aligned"`` (ASAp) requests are reweighted per
position by the processor itself, as their masks are, told before the bonus
rows are sampled where a drafted row arrives fully masked
(``masked_row_cuts``). Other custom logits
processors cannot be applied per position: given explicitly they are
refused at start-up, as vLLM refuses them; loaded from an entry point they
stay off, as in vLLM.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_plugins.bridge.processors import grammar_class, grammar_processors
from vllm_plugins.registry import applies_processors
from vllm_plugins.tree.sampling import SAMPLING_EPS

logger = logging.getLogger("vllm_plugins")

# On vLLM's MinTokensLogitsProcessor of an engine drafting with our proposers
# (set at build), and, while its rejection sampler samples the bonus rows,
# the step's draft counts by batch index (wrap_min_tokens_apply).
COUNTS_DRAFTS = "_vllm_plugins_counts_drafts"
BONUS_DRAFTS = "_vllm_plugins_bonus_drafts"


# ------------------------------------------------------------- start-up
def wrap_build_logitsprocs(original):
    # vllm.v1.worker.gpu_model_runner.build_logitsprocs(vllm_config, device,
    #     is_pin_memory, is_pooling_model, custom_logitsprocs=()) ->
    #     LogitsProcessors (the runner's input batch holds them).
    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        if is_pooling_model or not applies_processors(vllm_config):
            return original(vllm_config, device, is_pin_memory, is_pooling_model,
                            custom_logitsprocs)
        from vllm.v1.sample import logits_processor as lp

        grammar = grammar_class()
        explicit = lp._load_logitsprocs_by_fqcns(custom_logitsprocs)
        refused = [c.__name__ for c in explicit if not issubclass(c, grammar)]
        if refused:
            raise ValueError(
                f"logits_processors {refused} cannot be applied per draft "
                "position under speculative decoding; with vllm-plugins "
                "speculation only min_p, logit_bias, min_tokens and "
                f"{grammar.__name__} are served. Remove them from "
                "logits_processors or turn speculative_config off")
        plugins = lp._load_logitsprocs_plugins()
        dropped = [c.__name__ for c in plugins if not issubclass(c, grammar)]
        if dropped:
            logger.warning("logits processors %s (entry points) stay off under "
                           "speculative decoding, as in vLLM", dropped)
        ours = [c for c in plugins + explicit if issubclass(c, grammar)]
        built = lp.LogitsProcessors(
            ctor(vllm_config, device, is_pin_memory)
            for ctor in [*lp.BUILTIN_LOGITS_PROCESSORS, *ours])
        for p in built.all:
            if isinstance(p, lp.MinTokensLogitsProcessor):
                setattr(p, COUNTS_DRAFTS, True)  # this engine's: wrap_min_tokens_apply
        return built

    return build_logitsprocs


# ------------------------------------------------------------- each step
def _split_drafts(metadata) -> list[list[int]]:
    flat = metadata.draft_token_ids.tolist()
    out, start = [], 0
    for n in metadata.num_draft_tokens:
        out.append(flat[start:start + n])
        start += n
    return out


def _grammar_processors(sampling_metadata) -> list:
    return [p for p in grammar_processors(sampling_metadata.logitsprocs) if p._reqs]


def _min_tokens_processors(sampling_metadata) -> list:
    return [p for p in sampling_metadata.logitsprocs.non_argmax_invariant
            if getattr(p, COUNTS_DRAFTS, False) and p.min_toks]


def wrap_rejection_forward(original):
    # vllm.v1.sample.rejection_sampler.RejectionSampler.forward(self, metadata,
    #     draft_probs, logits, sampling_metadata): samples the bonus rows with
    #     the plain Sampler first, then calls apply_logits_processors on the
    #     target rows. Our grammar processors hold the step's drafts meanwhile,
    #     and min_tokens the step's draft counts.
    @functools.wraps(original)
    def forward(self, metadata, draft_probs, logits, sampling_metadata):
        procs = _grammar_processors(sampling_metadata)
        mins = _min_tokens_processors(sampling_metadata)
        if not procs and not mins:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        drafts = _split_drafts(metadata) if procs else None
        cuts = (masked_row_cuts(self, logits, sampling_metadata, metadata)
                if any(_has_aligned(p) for p in procs) else None)
        for p in procs:
            p.begin_verification(drafts, cuts)
        for p in mins:
            setattr(p, BONUS_DRAFTS, list(metadata.num_draft_tokens))
        try:
            return original(self, metadata, draft_probs, logits, sampling_metadata)
        finally:
            for p in procs:
                p.end_verification()
            for p in mins:
                setattr(p, BONUS_DRAFTS, None)

    return forward


def _has_aligned(processor) -> bool:
    return any(r.asap is not None and not r.asap.done for r in processor._reqs.values())


def masked_row_cuts(sampler, logits: torch.Tensor, sampling_metadata,
                    metadata) -> list[int | None]:
    """Per request, the number of drafts before its first target row that
    vLLM's masks (``vllm_masks``) leave fully masked, or None. Aligned
    grammar requests stop reweighting there, as plain decoding's cursor
    leaves the trie at such a row; the bonus rows are sampled before the
    target rows are processed, so this is worked out first, on a copy."""
    rows = logits[metadata.target_logits_indices].to(torch.float32)
    vllm_masks(sampler, rows, sampling_metadata, metadata)
    dead = (~torch.isfinite(rows).any(dim=1)).tolist()
    cuts: list[int | None] = []
    start = 0
    for n in metadata.num_draft_tokens:
        cuts.append(next((j for j in range(n) if dead[start + j]), None))
        start += n
    return cuts


def wrap_min_tokens_apply(original):
    # vllm.v1.sample.logits_processor.builtin.MinTokensLogitsProcessor.apply(
    #     self, logits) -> logits: one row per request (batch index); masks
    #     the stop tokens of requests whose committed output is shorter than
    #     min_tokens (self.min_toks: index -> (min_tokens, output list, stop
    #     ids, uses vLLM's structured outputs)). On the bonus rows of a step
    #     verified by our engines (BONUS_DRAFTS set by the forward above), the
    #     drafts before the row count, as apply_with_spec_decode counts them
    #     on the target rows and plain decoding at that position.
    @functools.wraps(original)
    def apply(self, logits):
        num_draft = getattr(self, BONUS_DRAFTS, None)
        if num_draft is None or not self.min_toks:
            return original(self, logits)
        return bonus_min_tokens(self, logits, num_draft)

    return apply


def bonus_min_tokens(processor, logits: torch.Tensor, num_draft: list[int]) -> torch.Tensor:
    """vLLM's min_tokens masking of one row per request, each row after its
    request's committed output and ``num_draft`` drafts: stop tokens are
    masked where fewer than ``min_tokens`` tokens precede the row (with
    vLLM's restoring of the stop tokens of a structured-output row that
    would be left all masked, as ``apply`` does)."""
    rows: list[int] = []
    toks: list[int] = []
    restore_rows: list[int] = []
    restore_toks: list[int] = []
    for index, (min_tok, output, stop, structured) in processor.min_toks.items():
        before = len(output) + (num_draft[index] if index < len(num_draft) else 0)
        if before >= min_tok or not stop:
            continue
        rows.extend([index] * len(stop))
        toks.extend(stop)
        if structured:
            restore_rows.extend([index] * len(stop))
            restore_toks.extend(stop)
    if not rows:
        return logits
    mask = (processor._device_tensor(rows, torch.int32),
            processor._device_tensor(toks, torch.int32))
    if not restore_rows:
        logits.index_put_(mask, processor.neg_inf_tensor)
    else:
        processor._mask_stop_token_logits(
            logits, mask, (processor._device_tensor(restore_rows, torch.int32),
                           processor._device_tensor(restore_toks, torch.int32)))
    return logits


def wrap_apply_logits_processors(original):
    # vllm.v1.sample.rejection_sampler.RejectionSampler.apply_logits_processors(
    #     self, logits, sampling_metadata, metadata) -> logits: the target rows
    #     (float32, a copy), before temperature and top-k/top-p.
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor,
                                                         MinPLogitsProcessor)

    @functools.wraps(original)
    def apply_logits_processors(self, logits, sampling_metadata, metadata):
        procs = sampling_metadata.logitsprocs
        num_draft = list(metadata.num_draft_tokens)
        grammar = grammar_class()
        if any(p._reqs for p in grammar_processors(procs)):
            vllm_masks(self, logits, sampling_metadata, metadata)
        for p in procs.non_argmax_invariant:  # plain order: builtins, then ours
            if isinstance(p, LogitBiasLogitsProcessor) and p.biases:
                apply_per_position(p, logits, num_draft)
            elif isinstance(p, grammar) and p._reqs:
                p.apply_drafted(logits, num_draft)
        logits = original(self, logits, sampling_metadata, metadata)
        if not sampling_metadata.all_greedy:
            for p in procs.argmax_invariant:
                if isinstance(p, MinPLogitsProcessor) and p.min_p_count:
                    apply_per_position(p, logits, num_draft,
                                       temperature=sampling_metadata.temperature)
        return logits

    return apply_logits_processors


def vllm_masks(sampler, logits: torch.Tensor, sampling_metadata, metadata) -> None:
    """vLLM's masks of the target rows that the plain sampler applies before
    the logits processors, in its order: ``allowed_token_ids``, bad words
    (after the drafts before each row), ``min_tokens`` (counting them), as
    vLLM's ``apply_logits_processors`` applies them after the penalties."""
    from vllm.v1.sample.logits_processor import MinTokensLogitsProcessor
    from vllm.v1.sample.ops.bad_words import apply_bad_words_with_drafts

    num_draft = list(metadata.num_draft_tokens)
    allowed = sampling_metadata.allowed_token_ids_mask
    if allowed is not None:
        repeat = torch.arange(len(num_draft)).repeat_interleave(
            torch.tensor(num_draft, dtype=torch.int64)).to(allowed.device)
        logits.masked_fill_(allowed[repeat], float("-inf"))
    if sampling_metadata.bad_words_token_ids:
        apply_bad_words_with_drafts(
            logits, sampling_metadata.bad_words_token_ids,
            sampler._combine_outputs_with_spec_tokens(sampling_metadata.output_token_ids,
                                                      sampling_metadata.spec_token_ids),
            num_draft)
    for p in sampling_metadata.logitsprocs.non_argmax_invariant:
        if isinstance(p, MinTokensLogitsProcessor):
            p.apply_with_spec_decode(logits, num_draft)


def apply_per_position(processor, logits: torch.Tensor, num_draft: list[int],
                       temperature: torch.Tensor | None = None) -> None:
    """Run a position-independent V1 processor on the target rows in place.

    Its ``apply`` takes one row per request in batch order; target row j of
    every request with more than j drafts is gathered into such a batch,
    processed, and written back. With ``temperature`` (``min_p``, which the
    sampler runs after dividing by it), the processor sees the rows divided
    as the sampler divides them (greedy rows by 1), and what it masks is
    masked in ``logits``.
    """
    num_reqs = len(num_draft)
    starts = [0] * num_reqs
    for i in range(1, num_reqs):
        starts[i] = starts[i - 1] + num_draft[i - 1]
    temp = None
    if temperature is not None:
        temp = torch.where(temperature < SAMPLING_EPS,
                           torch.ones_like(temperature), temperature).unsqueeze(1)
    for j in range(max(num_draft, default=0)):
        reqs = [i for i in range(num_reqs) if num_draft[i] > j]
        rows = torch.tensor([starts[i] + j for i in reqs], device=logits.device)
        index = torch.tensor(reqs, device=logits.device)
        batch = logits.new_zeros((num_reqs, logits.shape[1]))
        batch[index] = logits[rows]
        if temp is None:
            logits[rows] = processor.apply(batch)[index]
        else:
            scaled = processor.apply(batch.div_(temp))
            masked = torch.isneginf(scaled[index])
            logits[rows] = logits[rows].masked_fill(masked, float("-inf"))
