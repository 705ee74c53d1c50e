"""Token Recycling's learning on the device tables (``DeviceRecyclingTables``)
in as few torch calls as it allows.

As for the walk (``token_recycling_device_walk``), a step at the batch
sizes it serves costs what its calls cost, a view as much as a kernel. So
what depends only on the step's shape (R requests, N rows each, O context
orders) is built once (``LearnBuffers``), and the step's arrays keep the
requests on their last axis (``[N, O, R]``, ``[positions, R]``): a
per-request vector ``[R]`` then broadcasts against them with no view, and
each gather is one ``take`` through a precomputed index.
"""

from __future__ import annotations

import torch


class LearnBuffers:
    """Scratch and constants of learning ``r`` x ``n`` rows on ``tables``
    (normal tensors even when built under inference mode, so that a call
    outside it may still write them).

    ``seq`` [h + n + 1, R]: each request's history, its verified tokens,
    then its newest token, all plus one (h = context_order - 1). ``window``
    [O, R]: after ``move_history``, each request's new history then its
    newest token: the chain's start (``window_rows`` [R, 1, O] the same,
    requests first)."""

    def __init__(self, tables, r: int, n: int):
        o, h, dev, i64 = tables.order, tables.hist_len, tables.device, torch.int64
        with torch.inference_mode(False):
            self.seq = torch.zeros(h + n + 1, r, dtype=i64, device=dev)
            req = torch.arange(r, device=dev)
            j = torch.arange(n, device=dev).view(n, 1, 1)
            m = torch.arange(o, device=dev).view(1, o, 1)
            # Row j's context of order m + 1, newest token first: seq[h + j - m].
            self.context = (h + j - m) * r + req
            self.powers = tables.powers.view(o, 1)
            self.modulus = tables.modulus.view(o, 1)
            self.offset = tables.offset.view(o, 1)
            self.row = j
            # Write order: request, row, order (the last write wins).
            self.order = ((req * n + j) * o + m).view(-1)
            # The history after a shift of s: seq[s + 0..h-1], then the
            # newest token, seq[h + n].
            t = torch.arange(o, device=dev).view(o, 1)
            self.window_base = torch.where(t < h, t, h + n) * r + req
            self.window_step = (t < h) * r
            self.window = torch.zeros(o, r, dtype=i64, device=dev)
            # The rows' writes to the tables' ``kt``, one [key, token + 1]
            # pair a row and context order: one scatter writes both.
            self.kt_rows = torch.zeros(n, o, r, 2, dtype=i64, device=dev)
        self._top1: dict[int, torch.Tensor] = {}
        self.keys, self.tok1 = self.kt_rows[..., 0], self.kt_rows[..., 1]
        self.kt_flat = self.kt_rows.view(-1, 2)
        self.history_seq = self.seq[:h].t()
        self.verified_seq = self.seq[h:h + n]
        self.newest_seq = self.seq[h + n]
        self.history = self.window[:h].t()
        self.newest = self.window[h:].t()
        self.window_rows = self.window.t().unsqueeze(1)

    def top1_index(self, ids: torch.Tensor) -> torch.Tensor:
        """[N, O, R]: where row j's top-1 is in ``ids`` [R, N, K] (flat),
        once for each context order."""
        r, n, k = ids.shape
        got = self._top1.get(k)
        if got is None:
            with torch.inference_mode(False):
                got = torch.arange(0, r * n * k, k, device=ids.device).view(r, n).t()
                got = self._top1[k] = got.unsqueeze(1).expand(n, self.powers.shape[0],
                                                              r).contiguous()
        return got


def learn_rows(tables, b: LearnBuffers, lp: torch.Tensor, valid: torch.Tensor) -> None:
    """The tables' entries <- the rows in ``b.seq``: ``b.tok1`` (the
    target's top-1 plus one, written by the caller) and lp [N, O, R], row
    j's for each of its contexts; rows where ``valid`` (broadcast to
    [N, O, R]) is false write nowhere."""
    keys = torch.cumsum(b.seq.take(b.context) * b.powers, 1, out=b.keys)  # [N, O, R]
    entry = torch.remainder(keys, b.modulus).add_(b.offset)
    entry = torch.where(valid, entry, tables.trash)
    dest = tables._highest_priority_wins(entry.view(-1), b.order)
    tables.kt.index_copy_(0, dest, b.kt_flat)
    tables.lp.put_(dest, lp)


def move_history(tables, b: LearnBuffers, slots: torch.Tensor, shift: torch.Tensor) -> None:
    """Each slot's history moves on by ``shift`` [R] tokens (``b.window``
    then holds it, and the newest token after it)."""
    torch.take(b.seq, torch.addcmul(b.window_base, b.window_step, shift), out=b.window)
    if tables.hist_len:
        tables.hist1.index_put_((slots,), b.history)
