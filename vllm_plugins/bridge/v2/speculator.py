"""Our proposers as a Model Runner V2 drafter.

``PluginSpeculator`` is the ``BaseSpeculator`` V2's ``init_speculator``
builds for our methods (patch ``v2.init_speculator``). Each step, after V2
has sampled and appended the step's tokens, ``propose`` builds the
``StepContext`` (``context``), calls the same ``PluginProposer.step`` the V1
runner calls, checks the drafts where they enter (``vllm_plugins.tree.checked``)
and returns them as V2 wants them: ``[num_reqs, k]`` token ids.

V2 verifies k tokens of every request every step (its scheduler reserves
them and sees placeholders), so a request's shorter draft is padded: with
its last token, repeated. Any token is an exact draft (verification is
vLLM's), and the padding is verified at no extra cost to the step. The k
is batch-wide: the engine's ``num_speculative_tokens``, or the step's where
vLLM picks one by batch size (``num_speculative_tokens_per_batch_size``).
The step's k is the context's ``max_draft``, so the controllers choose
within it and the proposer sends (and remembers sending) no more than V2
verifies; the ``goodput`` controller also chooses the next step's k, which
reaches the scheduler through ``step_k``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from vllm_plugins.bridge import ranks
from vllm_plugins.bridge.v2.context import (RequestBook, StepTimes, VerifiedTopk,
                                            build_context)
from vllm_plugins.bridge.v2.drafter_base import V2Drafter
from vllm_plugins.topk import topk_logprobs

logger = logging.getLogger("vllm_plugins")


def _base():
    from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator

    return BaseSpeculator


class PluginSpeculator(V2Drafter):
    """The host route: our proposer's ``step(StepContext)``."""

    def __init__(self, vllm_config, device, req_states, proposer):
        super().__init__(vllm_config, device, req_states, proposer)
        # Set to ``_draft_logit_rows`` for the next step where the step's
        # drafts carry probabilities (STAND's).
        self._draft_logit_rows: torch.Tensor | None = None
        self.book = RequestBook()
        self._topk: VerifiedTopk | None = None
        self._topk_seconds = 0.0
        self._propose_end: float | None = None
        self._propose_seconds: float | None = None

    def observe_logits(self, logits: torch.Tensor, input_batch) -> None:
        k = self.proposer.topk_wanted()
        self._topk = None
        self._topk_seconds = 0.0
        if k <= 0 or logits is None or logits.shape[0] == 0:
            return
        start = time.perf_counter()
        with torch.no_grad():
            lps, ids = topk_logprobs(logits, k)
        self._topk = VerifiedTopk(ids, lps)
        self._topk_seconds = time.perf_counter() - start

    def observe_params(self, req_index: int, sampling_params) -> None:
        self.book.params_by_index[int(req_index)] = sampling_params

    def draft(self, input_batch, num_reqs: int, num_sampled: torch.Tensor,
              last_sampled: torch.Tensor, step_k: int) -> torch.Tensor:
        # The step's seconds: from our last proposal to this one (V2's
        # scheduling and output handling included: V1 reports those apart).
        now = time.perf_counter()
        step_seconds = None if self._propose_end is None else now - self._propose_end
        step_seconds, propose_seconds, topk_seconds = ranks.first_rank_values(
            step_seconds, self._propose_seconds, self._topk_seconds)
        topk, self._topk = self._topk, None
        ctx = build_context(self.req_states, input_batch, num_sampled, topk, self.book,
                            self.proposer.max_draft,
                            StepTimes(step_seconds, propose_seconds, topk_seconds),
                            step_max_draft=step_k, steers_step_k=self.steers_step_k)
        self.state.counters.count([list(r.accepted) for r in ctx.requests],
                                  [r.num_draft for r in ctx.requests])
        start = time.perf_counter()
        drafts = self.proposer.step(ctx)
        self._propose_seconds = time.perf_counter() - start
        # A drafter that does not read ctx.max_draft still sends no draft V2
        # would not verify.
        tokens = [t[:step_k] for t in self._checked_chains(ctx, drafts)]
        if self.state.digest is not None:
            self.state.digest.add(ctx, tokens, drafts.probs)
        out = self._padded(ctx, tokens, self.num_speculative_steps)
        self.draft_logits = self._draft_logits(ctx, input_batch, drafts, tokens, out)
        self._propose_end = time.perf_counter()
        return torch.from_numpy(out).to(self.device)

    # ------------------------------------------------------------ drafts out
    def _checked_chains(self, ctx, drafts) -> list[list[int]]:
        """Each request's draft as a chain (a tree's first path: V2 verifies
        chains), a malformed one dropped and counted."""
        from vllm_plugins.tree.checked import drop_malformed
        from vllm_plugins.tree.draft import chain_length

        req_ids = [r.req_id for r in ctx.requests]
        drafts, bad = drop_malformed(drafts, req_ids, self.proposer.vocab_size,
                                     self.proposer.max_draft)
        if bad:
            self.state.counters.malformed_drafts += len(bad)
            logger.error("%s proposed a malformed draft for request %s (%s); such "
                         "drafts are dropped", type(self.proposer).__name__, *bad[0])
        parents = drafts.parents or [None] * len(drafts.tokens)
        return [list(t) if p is None else list(t[:chain_length(p)])
                for t, p in zip(drafts.tokens, parents)]

    def _draft_logits(self, ctx, input_batch, drafts, tokens, out) -> torch.Tensor | None:
        """The rows V2's rejection sampler reads next step, by request state
        index (``draft_logits_block``); None when no draft of the step has
        probabilities, as on the V1 route."""
        probs = drafts.probs
        if probs is None or not any(p is not None and len(p) for p in probs[:len(tokens)]):
            return None
        rows = self._draft_logit_rows
        if rows is None:
            rows = self._draft_logit_rows = torch.empty(
                self.max_num_reqs, out.shape[1], int(self.proposer.vocab_size),
                dtype=torch.float32, device=self.device)
        index = torch.as_tensor(input_batch.idx_mapping_np[:len(tokens)], dtype=torch.int64)
        lengths = [len(t) for t in tokens]
        temperatures = [r.temperature for r in ctx.requests]
        block = draft_logits_block(out, list(probs[:len(tokens)]), lengths, temperatures,
                                   rows.shape[2])
        rows[index.to(self.device)] = block.to(self.device)
        return rows

    @staticmethod
    def _padded(ctx, tokens: list[list[int]], k: int) -> np.ndarray:
        """``[requests, k]``: each draft, then its last token (the request's
        last token where it drafted nothing) to the end of the row."""
        out = np.empty((len(ctx.requests), k), dtype=np.int64)
        for b, (req, draft) in enumerate(zip(ctx.requests, tokens)):
            draft = draft[:k]
            last = draft[-1] if draft else (int(req.context[-1]) if len(req.context) else 0)
            out[b, :len(draft)] = draft
            out[b, len(draft):] = last
        return out


def draft_logits_block(padded: np.ndarray, probs: list, lengths: list[int],
                       temperatures: list[float], vocab: int) -> torch.Tensor:
    """``[requests, k, vocab]`` pre-temperature draft logits, as V2's
    rejection sampler reads them: it takes a draft's distribution as
    ``softmax(logits / T)`` with the request's temperature T, so a
    proposer's probability row p becomes ``T log p`` (zeros: -inf).
    Deterministic drafts, padding and greedy requests (which V2 verifies by
    argmax, never reading these) are one-hot: 0 at the token, -inf elsewhere.
    """
    block = torch.full((padded.shape[0], padded.shape[1], vocab), float("-inf"))
    block.scatter_(2, torch.from_numpy(np.ascontiguousarray(padded)).unsqueeze(-1), 0.0)
    for b, p in enumerate(probs):
        n = min(lengths[b], padded.shape[1], 0 if p is None else len(p))
        if n == 0 or temperatures[b] <= 0:
            continue
        with np.errstate(divide="ignore"):
            logp = np.log(np.asarray(p[:n], dtype=np.float64))
        block[b, :n] = torch.from_numpy(temperatures[b] * logp).to(torch.float32)
    return block


_SUBCLASS = None
_DEVICE_SUBCLASS = None


def make_speculator(vllm_config, device, req_states):
    """Our proposer (built as vLLM's custom_class route builds it) inside a
    V2 drafter."""
    global _SUBCLASS, _DEVICE_SUBCLASS
    if _SUBCLASS is None:
        _SUBCLASS = type("PluginSpeculatorV2", (PluginSpeculator, _base()), {})
    from vllm_plugins.registry import METHODS, PLUGIN_OPTIONS_ATTR

    options = getattr(vllm_config.speculative_config, PLUGIN_OPTIONS_ATTR)
    proposer = METHODS[options["method"]].proposer_class()(vllm_config)
    if proposer.device_drafter() is not None:  # the device route
        from vllm_plugins.bridge.v2.device_speculator import DeviceSpeculator

        if _DEVICE_SUBCLASS is None:
            _DEVICE_SUBCLASS = type("DeviceSpeculatorV2", (DeviceSpeculator, _base()), {})
        return _DEVICE_SUBCLASS(vllm_config, device, req_states, proposer)
    return _SUBCLASS(vllm_config, device, req_states, proposer)


def wrap_init_speculator(original):
    # vllm.v1.worker.gpu.model_runner.init_speculator(vllm_config, device,
    #     req_states): imported by name into V2's model_runner, called from
    #     GPUModelRunner.__init__ on the last pipeline stage.
    def init_speculator(vllm_config, device, req_states):
        from vllm_plugins.bridge.v2.gate import plugin_options

        if plugin_options(vllm_config) is None:
            return original(vllm_config, device, req_states)
        return make_speculator(vllm_config, device, req_states)

    init_speculator.__wrapped__ = original
    return init_speculator


def wrap_load_model(original):
    # vllm.v1.worker.gpu.model_runner.GPUModelRunner.load_model(self, ...):
    # builds self.model, self.sampler and self.rejection_sampler.
    def load_model(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        speculator = getattr(self, "speculator", None)
        if isinstance(speculator, V2Drafter):
            speculator.attach(self)
        return out

    load_model.__wrapped__ = original
    return load_model
