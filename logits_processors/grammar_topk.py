"""The target's top-k after our grammar's mask, for a drafter that learns
from the target.

Token Recycling learns each verified row's top-k (the bridge takes it in
``_sample``). vLLM's own structured output masks the logits before that
(the runner applies the grammar bitmask before ``_sample``), so for those
requests the tables learn grammatical successors, with probabilities
renormalised over what the grammar allows; our processor masks inside the
sampler, after the top-k was taken, so the tables would learn tokens the
grammar forbids and lower probabilities, which stop Token Recycling's walk
sooner. Recorded here as the processor masks each row, the masked top-k
replaces the raw one for the processor's requests
(``proposers.grammar.GrammarProposer``): what native gets.

One recorder per grammar processor (``GrammarLogitsProcessor.masked_topk``).
Off (``k == 0``) unless the engine's drafter learns it
(``Drafter.masked_topk_wanted``): then the bridge asks the recorder for
that many ids a row and hands each step's recording to the drafter in its
``StepContext.masked_topk``; the drafter checks the drafts it was made for.
"""

from __future__ import annotations

import numpy as np
import torch

Key = tuple[int, int]  # (batch index, position: row j follows drafts[:j])


class MaskedTopk:
    """Masked rows' top-k by (batch index, position), for one step."""

    def __init__(self) -> None:
        self.k = 0
        self.rows: dict[Key, tuple[np.ndarray, np.ndarray]] = {}
        self.drafts: dict[int, list[int]] = {}  # batch index -> the drafts verified
        self._where = self._plain

    def want(self, k: int) -> None:
        """A drafter in this process learns ``k`` ids per row."""
        self.k = max(self.k, int(k))

    # ------------------------------------------ where a logits row sits
    @staticmethod
    def _plain(row: int) -> tuple[Key, list[int]]:
        return (row, 0), []

    def plain_rows(self) -> None:
        """Logits row i is request i's only row (plain sampling)."""
        self._where = self._plain

    def bonus_rows(self, drafts: list[list[int]]) -> None:
        """Logits row i is request i's row after all its drafts."""
        def where(row: int) -> tuple[Key, list[int]]:
            d = list(drafts[row]) if row < len(drafts) else []
            return (row, len(d)), d
        self._where = where

    def target_rows(self, num_draft: list[int], drafts: list[list[int]]) -> None:
        """Request i owns ``num_draft[i]`` consecutive rows; its row j
        follows drafts[i][:j]."""
        index: dict[int, Key] = {}
        start = 0
        for i, n in enumerate(num_draft):
            for j in range(n):
                index[start + j] = (i, j)
            start += n

        def where(row: int) -> tuple[Key, list[int]]:
            key = index[row]
            return key, list(drafts[key[0]]) if key[0] < len(drafts) else []
        self._where = where

    # ------------------------------------------ recording and taking
    def record(self, logits: torch.Tensor, rows: list[int]) -> None:
        """Top-k of ``logits[rows]`` as they are now (masked)."""
        if not self.k or not rows:
            return
        from vllm_plugins.topk import topk_logprobs

        with torch.no_grad():
            lps, ids = topk_logprobs(logits[rows], self.k)
        ids = ids.cpu().numpy().astype(np.int64)
        lps = lps.cpu().numpy()
        for n, row in enumerate(rows):
            key, drafts = self._where(row)
            self.rows[key] = (ids[n], lps[n])
            self.drafts[key[0]] = drafts

    def take(self) -> "MaskedTopk":
        """This step's recording; the recorder starts empty."""
        out = MaskedTopk()
        out.k, out.rows, out.drafts = self.k, self.rows, self.drafts
        self.rows, self.drafts = {}, {}
        return out

    def for_request(self, index: int, verified: np.ndarray, k: int
                    ) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, logprobs), ``[len(verified), k]``, for the request at batch
        ``index`` whose verified rows followed ``verified`` (the token
        before the drafts, then the drafts); None unless every row was
        recorded for exactly these drafts."""
        n = len(verified)
        if k > self.k or self.drafts.get(index) != [int(t) for t in verified[1:]]:
            return None
        got = [self.rows.get((index, j)) for j in range(n)]
        if any(g is None for g in got):
            return None
        return (np.stack([g[0][:k] for g in got]), np.stack([g[1][:k] for g in got]))

