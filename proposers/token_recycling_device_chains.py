"""Token Recycling's chains on vLLM's V1 route from the device tables
(``"tables": "device"``).

The V1 bridge hands the proposer numpy arrays per request; this class packs
them into the padded tensors ``DeviceRecyclingTables`` takes (CPU tensors
through ``torch.from_numpy``, moved to the tables' device), keeps a request
id -> slot map, and unpacks the drafts. The tables' own ops are the ones the
V2 route runs; only this packing is V1's. Where the tables are CPU tensors,
learning and drafting are one compiled call each over the padded arrays
(``token_recycling_device_compiled``; the torch ops are their twin), as the
V2 route's step is.

Each slot's history moves with ``learn``. A step the proposer does not see
(the draft-length policy rested, or the bridge had no logits) leaves it
behind: the request's context tells, and the history is set again from it.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_plugins.proposers.token_recycling_device import DeviceRecyclingTables
from vllm_plugins.proposers.token_recycling_device_compiled import (compiled_learn,
                                                                    compiled_propose,
                                                                    compiled_seed)
from vllm_plugins.step_context import StepContext


class DeviceChains:
    """Chains for the requests of V1 steps, from tables on ``device``."""

    def __init__(self, vocab_size: int, options: dict, max_slots: int,
                 device: torch.device | str = "cpu"):
        self.options = options
        self.tables = DeviceRecyclingTables(
            vocab_size, options["context_order"], options["context_slots"], max_slots, options["min_confidence"], device)
        self._slot: dict[str, int] = {}
        self._free = list(range(max_slots - 1, -1, -1))
        # Per request, the context length its history is current for.
        self._synced: dict[str, int] = {}

    def to(self, device) -> None:
        self.tables.to(device)

    def free(self, req_id: str) -> None:
        slot = self._slot.pop(req_id, None)
        if slot is not None:
            self._free.append(slot)
        self._synced.pop(req_id, None)

    def _take_slot(self, req_id: str) -> int:
        if not self._free:  # more live requests than slots (preempted ones wait)
            old = self.tables.max_slots
            self.tables.resize_slots(2 * old)
            self._free = list(range(2 * old - 1, old - 1, -1))
        slot = self._slot[req_id] = self._free.pop()
        return slot

    # ------------------------------------------------------------- learning
    def learn(self, ctx: StepContext) -> None:
        """Seed new requests (their prompt, ``seed_from_prompt``), set the
        history of requests whose steps were missed, then learn every
        verified row of the step in one call."""
        seeds, resync = [], []
        rows = []
        for r in ctx.requests:
            if len(r.accepted) == 0:
                continue
            base = len(r.context) - len(r.accepted)
            if r.req_id not in self._slot:
                slot = self._take_slot(r.req_id)
                seeds.append((slot, r.context[:r.num_prompt_tokens]))
                if base != r.num_prompt_tokens:
                    resync.append((slot, r.context[:base]))
            elif self._synced.get(r.req_id) != base:
                resync.append((self._slot[r.req_id], r.context[:base]))
            if r.topk_ids is not None and len(r.verified_tokens) > 0:
                rows.append(r)
                self._synced[r.req_id] = len(r.context)
        if seeds:
            self._seed(seeds, self.options["seed_from_prompt"])
        if resync:
            self._seed(resync, False)
        if rows:
            self._learn_rows(rows)

    def _seed(self, items, tables: bool) -> None:
        width = max(len(t) for _, t in items)
        tokens = np.zeros((len(items), width), np.int64)
        for j, (_, t) in enumerate(items):
            tokens[j, :len(t)] = t
        t = self.tables
        args = (self._tensor(np.array([s for s, _ in items], np.int64)), self._tensor(tokens),
                self._tensor(np.array([len(x) for _, x in items], np.int64)))
        if t.compiled:
            compiled_seed(t, *args, tables)
        else:
            t.seed(*args, tables)

    def _learn_rows(self, rows) -> None:
        lens = np.array([len(r.verified_tokens) for r in rows], np.int64)
        inside = np.arange(lens.max()) < lens[:, None]     # [R, N]: row j verified
        verified = np.zeros(inside.shape, np.int64)
        ids = np.zeros(inside.shape, np.int64)             # the tables keep the top-1
        lps = np.zeros(inside.shape, np.float32)
        verified[inside] = np.concatenate([r.verified_tokens for r in rows])
        ids[inside] = np.concatenate([r.topk_ids[:m, 0] for r, m in zip(rows, lens)])
        lps[inside] = np.concatenate([r.topk_logprobs[:m, 0] for r, m in zip(rows, lens)])
        num_accepted = np.array([len(r.accepted) - 1 for r in rows], np.int64)
        slots = np.array([self._slot[r.req_id] for r in rows], np.int64)
        if self.tables.compiled:
            compiled_learn(self.tables, slots, verified, ids, lps, lens, num_accepted)
            return
        self.tables.learn(*(self._tensor(a) for a in (slots, verified, ids[:, :, None],
                                                       lps[:, :, None], lens, num_accepted)))

    # ------------------------------------------------------------- drafting
    def draft(self, drafting, tokens: list, conf: list) -> None:
        """The chain of each (row, request, length) of ``drafting``, into
        ``tokens`` and ``conf`` at its row."""
        slots = np.array([self._slot[r.req_id] for _, r, _ in drafting], np.int64)
        last = np.array([r.context[-1] for _, r, _ in drafting], np.int64)
        longest = max(length for _, _, length in drafting)
        if self.tables.compiled:
            drafts, probs = compiled_propose(self.tables, slots, last, longest)
        else:
            drafts, probs = self.tables.propose(self._tensor(slots), self._tensor(last), longest)
            drafts, probs = drafts.cpu().numpy(), probs.cpu().numpy()
        lengths = np.minimum(_drafted(drafts), [length for _, _, length in drafting])
        for j, (i, _, _) in enumerate(drafting):
            tokens[i] = drafts[j, :lengths[j]].tolist()
            conf[i] = probs[j, :lengths[j]]

    def continue_draft(self, context: np.ndarray, prefix, n: int) -> np.ndarray:
        """Up to ``n`` tokens after ``context`` + ``prefix``: the chain from
        their last tokens; reads the tables only."""
        order = self.tables.order
        tail = np.concatenate([np.asarray(context[-order:], np.int64),
                               np.asarray(prefix, np.int64)])[-order:]
        window = np.full((1, order), -1, np.int64)
        window[0, order - len(tail):] = tail
        drafts, _ = self.tables.walk(self._tensor(window), n)
        row = drafts.cpu().numpy()
        return row[0, :_drafted(row)[0]].astype(np.int64)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.tables.device)


def _drafted(drafts: np.ndarray) -> np.ndarray:
    """Each chain's tokens before its -1 padding (drafts [R, T], T may be
    0: every request of the step was given no draft)."""
    if drafts.shape[1] == 0:
        return np.zeros(drafts.shape[0], np.int64)
    pad = drafts < 0
    return np.where(pad.any(1), pad.argmax(1), drafts.shape[1])
