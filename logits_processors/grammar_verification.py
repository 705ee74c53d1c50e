"""Our grammar processor's rows under speculative decoding (V1 runner).

vLLM's rejection sampler samples the bonus rows (one per request, after all
its drafts) through the plain sampler, which calls ``apply``, then processes
the target rows (row j of a request: after its drafts[:j]). The bridge
(vllm_plugins.bridge.v1.verify_processors) hands the step's drafts over with
``begin_verification`` so that ``apply`` masks bonus rows after the drafts,
and calls ``apply_drafted`` on the target rows. Matchers only move
tentatively here and are rolled back: the next step advances them by the
tokens actually accepted (``GrammarRequest.advance_v1``).
"""

from __future__ import annotations

import torch

from .grammar_state import GrammarRequest, apply_masks
from .grammar_topk import MaskedTopk


class DraftedRows:
    """Mixed into GrammarLogitsProcessor: the per-position masks of drafted
    rows, on the processor's own requests, runtime and masking."""

    _verifying: list[list[int]] | None = None
    masked_topk: "MaskedTopk"

    def begin_verification(self, drafts: list[list[int]],
                           cuts: list[int | None] | None = None) -> None:
        """This step's drafts, by batch index, until ``end_verification``.
        ``cuts[i]``: the number of drafts before request i's first target
        row that reaches this processor fully masked (None: none), which
        aligned requests stop reweighting at, as plain decoding does."""
        self._verifying = drafts
        self.masked_topk.bonus_rows(drafts)
        for index, req in self._reqs.items():
            if req.asap is not None:
                req.asap.cut = cuts[index] if cuts and index < len(cuts) else None

    def end_verification(self) -> None:
        self._verifying = None
        self.masked_topk.plain_rows()
        for req in self._reqs.values():
            if req.asap is not None:
                req.asap.cut = None

    def _apply_bonus(self, logits: torch.Tensor) -> torch.Tensor:
        drafts = self._verifying
        rows, reqs = self._v1_requests(logits.shape[0])
        plain_rows: list[int] = []
        plain_reqs: list[GrammarRequest] = []
        plan: list[tuple[GrammarRequest, list[int], list[int | None]]] = []
        for row, req in zip(rows, reqs):
            draft = drafts[row] if row < len(drafts) else []
            if not draft:
                plain_rows.append(row)
                plain_reqs.append(req)
            else:
                plan.append((req, draft, [None] * len(draft) + [row]))
        if plain_rows:
            self._mask(logits, plain_rows, plain_reqs)
        if plan:
            self._mask_positions(logits, plan)
        return logits

    def apply_drafted(self, logits: torch.Tensor, num_draft: list[int]) -> torch.Tensor:
        """Mask the target rows: request i owns ``num_draft[i]`` consecutive
        rows in batch order; its row j follows its drafts[:j]."""
        drafts = self._verifying
        if not self._reqs or drafts is None:
            return logits
        rows, reqs = self._v1_requests(len(num_draft))
        by_row = dict(zip(rows, reqs))
        plan: list[tuple[GrammarRequest, list[int], list[int | None]]] = []
        start = 0
        for index, n in enumerate(num_draft):
            req = by_row.get(index)
            if req is not None and n:
                plan.append((req, drafts[index], list(range(start, start + n))))
            start += n
        if plan:
            self.masked_topk.target_rows(num_draft, drafts)
            self._mask_positions(logits, plan)
        return logits

    def _mask_positions(self, logits: torch.Tensor,
                        plan: list[tuple["GrammarRequest", list[int], list[int | None]]]
                        ) -> torch.Tensor:
        """Mask, for each (request, draft, rows), ``logits[rows[j]]`` with the
        request's grammar after it tentatively consumed ``draft[:j]`` (None:
        no row for that position), exactly as plain decoding would mask the
        row at that position; rows after a draft token the grammar rejects
        are never used by the rejection sampler and take EOS."""
        rt = self._runtime
        n_logits = logits.shape[0]
        failure_tokens = self._failure_text_tokens()
        mask_rows: list[int] = []
        mask_eos: list[int] = []
        force_rows: list[int] = []
        force_toks: list[int] = []
        for req, draft, rows in plan:
            if rt is None and not req.failed:
                req.fail(self._runtime_error or "grammar unavailable")
            if req.must_stop:
                for row, tok in zip(rows, req.forced(len(rows), failure_tokens)):
                    if row is not None:
                        force_rows.append(row)
                        force_toks.append(tok)
                continue
            m = req.matcher
            n_ok = 0
            for j, row in enumerate(rows):
                if j and m.try_consume_tokens([int(draft[j - 1])]) != 1:
                    rest = [r for r in rows[j:] if r is not None]
                    force_rows.extend(rest)
                    force_toks.extend([req.eos] * len(rest))
                    break
                n_ok += 1 if j else 0
                if row is None:
                    # No row here, but the matcher computes this position's
                    # mask before consuming the next draft, as plain
                    # decoding's does: consumed without it, llguidance may
                    # end in another state (a bonus row after a number
                    # allowed a comma the grammar forbids there).
                    m.compute_bitmask()
                    continue
                if m.is_stopped():  # as plain decoding: EOS forced
                    force_rows.append(row)
                    force_toks.append(req.eos)
                    continue
                rt.fill([(m, row)], n_logits)
                mask_rows.append(row)
                mask_eos.append(req.eos)
            if n_ok:
                m.rollback(n_ok)
        bitmask = rt.bitmask(n_logits) if mask_rows else None
        apply_masks(rt, logits, bitmask, mask_rows, mask_eos, force_rows, force_toks,
                    self.masked_topk)
        return logits
