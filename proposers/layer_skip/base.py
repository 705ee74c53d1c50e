"""What SWIFT and DEL share: drafting with the target's own layers.

The bridge hands these proposers ``ctx.target`` (vllm_plugins.bridge
.v1.target_layers.TargetLayers): partial forwards of the loaded target over vLLM's paged KV
cache. A subclass says, per request, which plan (sublayers to run) and how
many tokens to draft; this base groups requests by plan, drafts each group in
one batched loop, and applies the confidence stop: drafting ends at the first
token whose draft probability is below ``stop_below`` (Kangaroo / SWIFT).

Draft vocabulary. On a small model the LM head is a large share of a draft
step (SmolLM2-135M: 49152 x 576, a quarter of the model's multiply-adds), so
``draft_vocab`` > 0 computes draft logits over a shortlist only: the tokens
this engine has seen most (prompts, outputs, the target's top-k at verified
positions). Drafts stay exact token ids; a token outside the shortlist is
simply never drafted.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from vllm_plugins import clock
from vllm_plugins.options import integer, unit_float
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.self_draft import DraftRows, LayerPlan
from vllm_plugins.step_context import Drafts, StepContext


class DraftVocab:
    """A frequency-ranked shortlist of token ids for the draft LM head."""

    def __init__(self, vocab_size: int, size: int):
        self.size = min(size, vocab_size)
        self.counts = np.zeros(vocab_size, dtype=np.float64)
        self.ids: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self._since_refresh = 0

    def observe(self, tokens: np.ndarray) -> None:
        tokens = tokens[(tokens >= 0) & (tokens < len(self.counts))]
        np.add.at(self.counts, tokens, 1.0)
        self._since_refresh += len(tokens)

    def logits(self, target, hidden: torch.Tensor):
        """(logits over the shortlist, their token ids); the full head's
        (logits, None) when the model's head is not a plain product."""
        weight = _head_weight(target)
        if weight is None:
            return target.logits(hidden), None
        if self.ids is None or self._since_refresh > 4 * self.size:
            top = np.argsort(-self.counts, kind="stable")[: self.size]
            self.ids = torch.as_tensor(np.sort(top), device=hidden.device)
            self.weight = weight.index_select(0, self.ids)
            self._since_refresh = 0
        return torch.nn.functional.linear(hidden, self.weight), self.ids


def _head_weight(target) -> torch.Tensor | None:
    """The LM head matrix when logits are a plain product with it."""
    lp = getattr(target.model, "logits_processor", None)
    head = getattr(target.model, "lm_head", None)
    if lp is None or head is None or getattr(lp, "soft_cap", None):
        return None
    if getattr(lp, "scale", 1.0) != 1.0 or not hasattr(head, "weight"):
        return None
    if _vocab_shard(head):
        return None
    return head.weight


def _vocab_shard(head) -> bool:
    """Under tensor parallel the LM head's weight is this rank's vocabulary
    shard (ParallelLMHead.tp_size ranks hold one each): a shortlist indexes
    the full vocabulary, so the full head (compute_logits, all-gathered)
    drafts instead."""
    return int(getattr(head, "tp_size", 1) or 1) > 1


class SelfDraftProposer(PluginProposer):
    """Base for proposers that draft by running (part of) the target."""

    SELF_DRAFT = True
    DEFAULT_NUM_SPECULATIVE_TOKENS = 5
    COMMON_SELF_DRAFT_OPTIONS = (
        *PluginProposer.OPTIONS,
        unit_float("stop_below", 0.6),
        integer("draft_vocab", 8192, 0, 1 << 20,
                "0 (full vocabulary) or a shortlist size in [1, 1048576]"),
    )

    @classmethod
    def runner_v2_refusal(cls, options: dict) -> str | None:
        return ("drafts with the target's own layers over its paged KV cache, "
                "which the bridge reaches through the V1 runner's attention "
                "metadata only")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        size = self.options["draft_vocab"]
        self.draft_vocab = (DraftVocab(self.vocab_size, size)
                            if size and self.vocab_size else None)
        self._seen_prompt: set[str] = set()
        self.steps = 0
        self.drafted = 0
        self.seconds = {"learn": 0.0, "draft": 0.0}
        # Draft forwards each request ran last step (a forward whose token
        # fell below stop_below was run and thrown away: it counts).
        self.attempts: dict[str, int] = {}
        # Measured costs: seconds of a target step (forward + sampling, from
        # the bridge) and of one batched draft forward per plan, as EMAs.
        self.step_seconds: float | None = None
        self.forward_seconds: dict[LayerPlan, float] = {}

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        inner = getattr(target_model, "model", None)
        layers = getattr(inner, "layers", None)
        parts = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
        if (layers is None or not hasattr(inner, "norm")
                or not hasattr(inner, "embed_input_ids")
                or not all(hasattr(layers[inner.start_layer], p) for p in parts)):
            raise ValueError(
                f"{type(self).__name__} drafts with the target's own decoder "
                f"layers and needs a Llama-style model (model.layers[i]."
                f"{{{', '.join(parts)}}}, model.norm); "
                f"{type(target_model).__name__} is not one")
        if self.draft_vocab is not None and _vocab_shard(
                getattr(target_model, "lm_head", None)):
            self.draft_vocab = None  # the full head drafts (see _head_weight)

    # ------------------------------------------------------ subclass hooks
    def learn(self, ctx: StepContext) -> None:
        """Update acceptance statistics from this step's verification."""

    def plan_for(self, ctx: StepContext, i: int) -> tuple[LayerPlan, int] | None:
        """(plan, draft length) for request i of the batch, or None: no draft."""
        raise NotImplementedError

    # ---------------------------------------------------------------- step
    def draft(self, ctx: StepContext) -> Drafts:
        self.steps += 1
        if ctx.last_step_seconds:
            self.step_seconds = _ema(self.step_seconds, ctx.last_step_seconds)
        start = time.perf_counter()  # learn / draft seconds: metrics only
        self._observe_vocab(ctx)
        self.learn(ctx)
        mid = time.perf_counter()
        try:
            return self._draft_groups(ctx)
        finally:
            self.seconds["learn"] += mid - start
            self.seconds["draft"] += time.perf_counter() - mid

    def _draft_groups(self, ctx: StepContext) -> Drafts:
        tokens: list[list[int]] = [[] for _ in ctx.requests]
        conf: list[np.ndarray | None] = [None] * len(ctx.requests)
        target = ctx.target
        if target is None:
            return Drafts(tokens)
        max_len = int(getattr(target.runner, "max_model_len", 0) or 0) or None
        groups: dict[LayerPlan, list[tuple[int, int]]] = {}
        for i, req in enumerate(ctx.requests):
            if req.in_prefill:
                continue
            choice = self.plan_for(ctx, i)
            if choice is None:
                continue
            plan, length = choice
            length = min(length, self.draft_budget(ctx, req.req_id))
            if max_len is not None:
                length = min(length, max_len - len(req.context))
            if length > 0:
                groups.setdefault(plan, []).append((i, length))
        for plan, members in groups.items():
            idx = np.array([i for i, _ in members])
            lengths = np.array([n for _, n in members])
            rows = DraftRows(
                rows=idx,
                last_tokens=np.array([ctx.requests[i].context[-1] for i in idx]),
                positions=np.array([len(ctx.requests[i].context) - 1 for i in idx]))
            began = clock.now()  # forward_seconds choose plans: rank-identical
            out = target.draft(rows, int(lengths.max()), plan,
                               stop_below=self.options["stop_below"],
                               head=self._head(target), max_lengths=lengths)
            forwards = 0
            for r, i in enumerate(idx):
                n = int(min(out.lengths[r], lengths[r]))
                tokens[i] = out.tokens[r, :n].tolist()
                conf[i] = out.top1_prob[r, :n]
                self.drafted += n
                attempts = n + (1 if n < lengths[r] else 0)
                self.attempts[ctx.requests[i].req_id] = attempts
                forwards = max(forwards, attempts)
            if forwards:
                self.forward_seconds[plan] = _ema(
                    self.forward_seconds.get(plan),
                    (clock.now() - began) / forwards)
        return Drafts(tokens, confidence=conf)

    def _head(self, target):
        if self.draft_vocab is None:
            return None
        vocab = self.draft_vocab
        return lambda hidden: vocab.logits(target, hidden)

    def _observe_vocab(self, ctx: StepContext) -> None:
        if self.draft_vocab is None:
            return
        for req in ctx.requests:
            if req.req_id not in self._seen_prompt:
                self._seen_prompt.add(req.req_id)
                self.draft_vocab.observe(np.asarray(req.context, dtype=np.int64))
            else:
                self.draft_vocab.observe(np.asarray(req.accepted, dtype=np.int64))
            if req.topk_ids is not None:
                self.draft_vocab.observe(req.topk_ids[:, :4].reshape(-1))

    def free(self, req_id: str) -> None:
        self._seen_prompt.discard(req_id)
        self.attempts.pop(req_id, None)

    def metrics(self) -> dict:
        out = super().metrics()
        from vllm_plugins.self_draft import SECONDS

        seconds = {**self.seconds, **{f"draft_{k}": v for k, v in SECONDS.items()}}
        out.update(steps=self.steps, drafted=self.drafted,
                   seconds={k: round(v, 3) for k, v in seconds.items()})
        return out


def _ema(old: float | None, new: float, weight: float = 0.1) -> float:
    return new if old is None else (1 - weight) * old + weight * new
