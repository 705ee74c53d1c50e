"""Token Recycling's tables as tensors on the target's device, with learning
and chain drafting that never read a value back to the host.

The host version (``token_recycling_tables``) walks numpy tables with numba
and needs the target's top-k copied to the host every step. Here the same
method is a fixed sequence of torch ops whose shapes depend only on the
padded batch size ``R`` and the draft length, so a step can run while the
host prepares the next one, or be captured in a CUDA graph:

- no ``.item()``/``.tolist()``/``.cpu()``, no Python branch on a tensor's
  value, no boolean-mask indexing or ``nonzero``;
- rows that must write nowhere (a row past a request's verified count, a
  padded request) are sent to a trash entry that drafting never reads;
- where several rows write one entry, the winner is chosen by a
  ``scatter_reduce(amax)`` over write order, not by the scatter's own
  (on CUDA, unordered) resolution: every tensor-parallel rank, learning
  from the same rows, holds the same tables.

What the tables hold (``E = context_slots + vocab``), each token stored
plus one (0: none), so that a missing token adds nothing to a key:

- ``key``, ``tok1``, ``lp`` ``[E + 1]``: one entry per context, the key,
  the target's top-1 after the context (plus one) and its log-probability.
  Entries ``[0, context_slots)`` are the direct-mapped context table
  (contexts of 2..``context_order`` tokens); entry ``context_slots + t`` is
  the adjacency matrix's top-1 for token ``t``, so a drafted token is one
  probe of one table; entry ``E`` is trash. The chain reads a matrix row's
  top-1 only, so the other k - 1 columns the host keeps (for its trees) are
  not kept here. ``key`` and ``tok1`` are the columns of one ``kt``
  ``[E + 1, 2]``: a probe reads both in one row (one call, one cache line);
- ``hist1`` ``[max_slots + 1, context_order - 1]``: per request slot, the
  tokens before its newest committed one (0 where the request has none);
  row ``max_slots`` is the padding slot;
- ``winner`` ``[E + 1]``: scratch for the write-order resolution, kept at -1
  between calls.

A context's key is a polynomial hash of its tokens (each plus one, so a
token the request does not have, -1, adds nothing: a context that reaches
before the request's start has the key of its known part, which is the
entry the host's walk backs off to). The polynomial rolls: appending a
token to the chain updates every order's key with one multiply-add, which
keeps a drafted token at eight torch calls (``token_recycling_device_walk``;
learning: ``token_recycling_device_learn``). The host version hashes
differently, so the two place entries in different slots; with no two
contexts in one slot they draft alike (tests/test_token_recycling_device.py).

Memory: ``(E + 1) * 28 + (max_slots + 1) * (context_order - 1) * 8`` bytes;
SmolLM2 (49152), 2^20 slots: 29.3 MiB (of which the write-order scratch
8.4), against the host's 19 MiB; and per batch shape a step has served,
a few small buffers (``per_shape``).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch

from vllm_plugins.proposers.token_recycling_device_learn import (LearnBuffers, learn_rows,
                                                                 move_history)
from vllm_plugins.proposers.token_recycling_device_walk import WalkBuffers, walk

# The hash's multiplier (odd: the rolling hash loses no bit of a token).
PRIME = 1000003
# Seeded (prompt-copied) entries: unknown to the target, so trusted like a
# coin flip (the host version's value).
SEED_LOGP = math.log(0.5)
EMPTY_KEY = -1
_WRAP = 1 << 64


def _int64(x: int) -> int:
    """x modulo 2**64, as the signed 64-bit value torch's int64 holds."""
    x %= _WRAP
    return x - _WRAP if x >= 1 << 63 else x


def context_key(tokens) -> int:
    """The key of a context (oldest token first): sum of (t + 1) * PRIME**i,
    i counted from the newest token, modulo 2**64 (a reference for tests)."""
    h = 0
    for t in tokens:
        h = h * PRIME + int(t) + 1
    return _int64(h)


class DeviceRecyclingTables:
    """The adjacency matrix's top-1 and the context table, learned and
    walked on one device. ``learn``, ``propose`` and ``walk`` run the same
    ops whatever the values; so does ``seed`` (a request's start, eager)."""

    def __init__(self, vocab_size: int, context_order: int, context_slots: int,
                 max_slots: int, min_confidence: float = 0.02,
                 device: torch.device | str = "cpu", compiled: bool = True):
        if context_order < 1:
            raise ValueError(f"context_order must be >= 1, got {context_order}")
        if max_slots < 1:
            raise ValueError(f"max_slots must be >= 1, got {max_slots}")
        self.vocab_size, self.order = vocab_size, context_order
        self.hist_len = context_order - 1
        self.slots = context_slots if context_order >= 2 else 0
        self.min_confidence = float(min_confidence)
        self.device = torch.device(device)
        self.entries = self.slots + vocab_size     # the trash entry's index
        self.max_slots = max_slots
        self.prime = PRIME
        # On a CPU the device route's step is one compiled call
        # (``token_recycling_device_compiled``); False keeps its torch twin.
        self.compile_on_cpu = compiled
        self._compiled_arrays = None
        # Constants and scratch of a step, per batch shape (``per_shape``).
        self._shapes: OrderedDict = OrderedDict()
        dev, i64 = self.device, torch.int64
        self.kt = torch.zeros(self.entries + 1, 2, dtype=i64, device=dev)
        self.kt[:, 0] = EMPTY_KEY
        self._columns()
        self.lp = torch.full((self.entries + 1,), -math.inf, device=dev)
        self.winner = torch.full((self.entries + 1,), -1, dtype=i64, device=dev)
        self.hist1 = torch.zeros(max_slots + 1, self.hist_len, dtype=i64, device=dev)
        self.trash = torch.tensor(self.entries, device=dev)
        # Per order n = 1..O (column n - 1): PRIME**(n-1), the remainder that
        # maps a key to its entry and the offset added after it. Order 1 is
        # the matrix: key t + 1, entry context_slots + t (a token id outside
        # the vocabulary wraps to some entry: never an index out of range).
        o = context_order
        self.pow = [_int64(PRIME ** i) for i in range(o)]
        self.powers = torch.tensor(self.pow, dtype=i64, device=dev)
        self.modulus = torch.tensor([vocab_size + 1] + [max(self.slots, 1)] * (o - 1),
                                    dtype=i64, device=dev)
        self.offset = torch.tensor([self.slots - 1] + [0] * (o - 1), dtype=i64, device=dev)
        self.hist_cols = torch.arange(self.hist_len, dtype=i64, device=dev)

    # A batch size of 256 requests takes about 0.3 MB (its learning, rows
    # and walk shapes): 192 shapes, 64 batch sizes, stay near 20 MB.
    SHAPES_KEPT = 192

    _TENSORS = ("kt", "lp", "winner", "hist1", "trash", "powers", "modulus", "offset",
                "hist_cols")

    def _columns(self) -> None:
        self.key, self.tok1 = self.kt[:, 0], self.kt[:, 1]

    @property
    def compiled(self) -> bool:
        """Whether the device route's step runs compiled: tables on a CPU."""
        return self.compile_on_cpu and self.device.type == "cpu"

    def compiled_arrays(self):
        """(kt, lp, hist1, winner, constants) as numpy arrays sharing the
        tables' memory, for the compiled step; constants [3, O]: the powers,
        the moduli and the offsets. Kept until the tables move or resize."""
        if self._compiled_arrays is None:
            constants = torch.stack((self.powers, self.modulus, self.offset)).numpy()
            self._compiled_arrays = (self.kt.numpy(), self.lp.numpy(), self.hist1.numpy(),
                                     self.winner.numpy(), constants)
        return self._compiled_arrays

    def nbytes(self) -> int:
        return sum(getattr(self, n).numel() * getattr(self, n).element_size()
                   for n in self._TENSORS)

    def to(self, device: torch.device | str) -> None:
        """Move the tables (eager; not inside a step)."""
        self.device = torch.device(device)
        for n in self._TENSORS:
            setattr(self, n, getattr(self, n).to(self.device))
        self._columns()
        self._shapes.clear()
        self._compiled_arrays = None

    def resize_slots(self, max_slots: int) -> None:
        """Room for ``max_slots`` request slots, histories kept (eager; the
        padding slot moves to ``max_slots``)."""
        hist1 = torch.zeros(max_slots + 1, self.hist_len, dtype=torch.int64,
                            device=self.device)
        keep = min(max_slots, self.max_slots)
        hist1[:keep] = self.hist1[:keep]
        self.hist1, self.max_slots = hist1, max_slots
        self._compiled_arrays = None

    def next_token(self, tokens: torch.Tensor) -> torch.Tensor:
        """The matrix's top-1 after each of ``tokens`` (-1: none); for tests
        and inspection."""
        return self.tok1.take(tokens + self.slots) - 1

    # ------------------------------------------------------------- learning
    def learn(self, slots: torch.Tensor, verified_tokens: torch.Tensor,
              topk_ids: torch.Tensor, topk_logprobs: torch.Tensor,
              num_verified: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """Tables <- one step's verified rows; each slot's history moves on
        past the tokens the step committed.

        slots [R] int64: each request's slot (``max_slots``: padding).
        verified_tokens [R, N] int64: the token before the drafts, then the
          drafts; row j of topk_* is the target's distribution after
          verified_tokens[r, j]. Rows j >= num_verified[r] write nowhere.
        topk_ids [R, N, K] int64, topk_logprobs [R, N, K] float32, K >= 1:
          ids by descending log-probability (only the first is kept).
        num_verified [R] int64: valid rows (0: the request learns nothing
          and its history stays).
        num_accepted [R] int64: drafts accepted this step (< num_verified
          where that is > 0): verified_tokens[r, 1:1 + a] are committed.
        """
        r, n = verified_tokens.shape
        h = self.hist_len
        b = self._learn_buffers(r, n)
        if h:
            torch.index_select(self.hist1, 0, slots, out=b.history_seq)
        torch.add(verified_tokens.t(), 1, out=b.verified_seq)
        top1 = b.top1_index(topk_ids)
        lp = topk_logprobs.take(top1)
        torch.add(topk_ids.take(top1), 1, out=b.tok1)
        learn_rows(self, b, lp if lp.dtype == self.lp.dtype else lp.to(self.lp.dtype),
                   b.row < num_verified)
        if h:
            move_history(self, b, slots, (num_accepted + 1) * (num_verified > 0))

    def _last_write_wins(self, entry: torch.Tensor) -> torch.Tensor:
        """``entry`` with every write but the last to each entry sent to the
        trash entry: a scatter then writes each entry once, in any order."""
        return self._highest_priority_wins(
            entry, torch.arange(entry.numel(), device=entry.device))

    def _highest_priority_wins(self, entry: torch.Tensor, priority: torch.Tensor
                               ) -> torch.Tensor:
        self.winner.scatter_reduce_(0, entry, priority, "amax")
        keep = self.winner.take(entry) == priority
        self.winner.index_fill_(0, entry, -1)
        return entry.where(keep, self.trash)

    # ------------------------------------------------------------- seeding
    def seed(self, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
             tables: bool = True) -> None:
        """New requests in their slots: each slot's history is the end of
        its prompt (``tokens[r, :lengths[r]]``, lengths >= 1), and with
        ``tables`` the prompt's bigrams and contexts fill entries the target
        has not filled (log-probability SEED_LOGP), as if the requests were
        seeded one after the other in row order (but for contexts that share
        a slot: see ``_seed_contexts``)."""
        r, p = tokens.shape
        dev = tokens.device
        tokens1 = tokens + 1
        if self.hist_len:
            pos = lengths.unsqueeze(1) - 1 - self.hist_len + self.hist_cols
            self.hist1.index_put_((slots,),
                                  tokens1.gather(1, pos.clamp(min=0)) * (pos >= 0))
        if not tables or p < 2:
            return
        col = torch.arange(p, device=dev)
        inside = col < lengths.unsqueeze(1)                        # [R, P]
        # Matrix: prev -> next where the entry is empty now; within a request
        # the last occurrence, across requests the first request, wins.
        prev = tokens[:, :-1].clamp(0, self.vocab_size)
        ok = inside[:, 1:] & (self.tok1.take(prev + self.slots) == 0)
        entry = (prev + self.slots).where(ok, self.trash)
        priority = (r - 1 - torch.arange(r, device=dev)).unsqueeze(1) * p + col[1:]
        dest = self._highest_priority_wins(entry.view(-1), priority.view(-1))
        self._write_seed(dest, (prev + 1).view(-1), tokens1[:, 1:].reshape(-1))
        if self.order >= 2 and p >= 3:
            self._seed_contexts(tokens1, inside)

    def _seed_contexts(self, tokens1: torch.Tensor, inside: torch.Tensor) -> None:
        """Contexts tokens[e - m:e] -> tokens[e], e >= 2, m = 2..order, into
        entries that do not hold that context: each context's first
        occurrence, and where contexts share a slot the last of those
        (within one request the host's rule; across requests, a context
        already seeded by an earlier row is not seeded again)."""
        r, p = tokens1.shape
        o = self.order
        seq1 = torch.cat((tokens1.new_zeros(r, o), tokens1), 1)    # unknown: 0
        ends = p - 2                                   # e = 2 .. p - 1
        keys = [seq1[:, o + 1:o + 1 + ends]]           # the token before e
        for m in range(2, o + 1):
            keys.append(keys[-1] + seq1[:, o + 2 - m:o + 2 - m + ends] * self.pow[m - 1])
        keys = torch.stack(keys[1:], 2).reshape(-1)    # [R * ends * (O - 1)]
        valid = inside[:, 2:].unsqueeze(2).expand(r, ends, o - 1).reshape(-1)
        entry = torch.remainder(keys, self.slots)
        fresh = valid & self._first_of_each(keys, valid) & (self.key.take(entry) != keys)
        dest = self._last_write_wins(entry.where(fresh, self.trash))
        nxt1 = tokens1[:, 2:].unsqueeze(2).expand(r, ends, o - 1).reshape(-1)
        self._write_seed(dest, keys, nxt1)

    @staticmethod
    def _first_of_each(keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """True at each valid key's first valid occurrence."""
        by_valid = torch.sort((~valid).to(torch.int8), stable=True).indices
        by_key = torch.sort(keys[by_valid], stable=True)
        perm = by_valid[by_key.indices]
        s = by_key.values
        new = torch.ones_like(valid)
        new[1:] = s[1:] != s[:-1]
        return torch.empty_like(valid).scatter_(0, perm, new)

    def _write_seed(self, dest, keys, toks1) -> None:
        self.key.index_put_((dest,), keys)
        self.tok1.index_put_((dest,), toks1)
        self.lp.index_fill_(0, dest, SEED_LOGP)

    # ------------------------------------------------------------- drafting
    def propose(self, slots: torch.Tensor, last_tokens: torch.Tensor, num_tokens: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's chain after its newest committed token ``last_tokens``
        [R] int64: drafts [R, num_tokens] int64, -1 from the first token the
        tables do not know or whose running product of stored probabilities
        (the chain's estimated acceptance) falls below min_confidence; and
        each drafted token's stored probability [R, num_tokens] float32 (0
        where the draft is -1). Reads the tables only."""
        r = slots.shape[0]
        if num_tokens <= 0:
            empty = last_tokens.new_zeros(r, 0, dtype=torch.int64)
            return empty, empty.float()
        b = self._walk_buffers(r, num_tokens)
        if self.hist_len:
            torch.index_select(self.hist1, 0, slots, out=b.window_history)
        torch.add(last_tokens, 1, out=b.window_newest)
        return self._chains(b, b.window)

    def walk(self, window: torch.Tensor, num_tokens: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """``propose`` from explicit contexts: ``window`` [R, context_order]
        holds each chain's last tokens, oldest first (-1: none)."""
        if num_tokens <= 0:
            empty = window.new_zeros(window.shape[0], 0)
            return empty, empty.float()
        return self._chains(self._walk_buffers(window.shape[0], num_tokens),
                            (window + 1).unsqueeze(1))

    def _chains(self, b: WalkBuffers, window1: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        tok1, prob, drafted = walk(self, b, window1, self.min_confidence)
        return tok1 * drafted - 1, (prob * drafted).float()

    # ---------------------------------------------- the device route's step
    def learn_and_draft(self, slots: torch.Tensor, verified_tokens: torch.Tensor,
                        top1_ids: torch.Tensor, top1_logprobs: torch.Tensor,
                        valid: torch.Tensor, shift: torch.Tensor,
                        last_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """``learn`` then ``propose`` for requests in distinct slots, as one
        step with fewer calls (the chain starts from the history ``learn``
        moved on): drafts [R, num_tokens] int64, padded with the request's
        newest token where the chain stops (the tables hold tokens plus
        one, never below 1, so a drafted token is never negative).

        The rows come requests last, as the step gathers them:
        verified_tokens [N, R] int32 or int64, top1_ids [N, O, R] int64 and
        top1_logprobs [N, O, R]: row j's top-1 and its log-probability, once
        for each context order; valid [N, O, R] bool: the rows ``learn``
        learns (j < num_verified[r]); shift [R]: the tokens the history
        moves on (``learn``'s (num_accepted + 1) * (num_verified > 0));
        last_tokens [R] int64.
        """
        n, r = verified_tokens.shape
        b = self._learn_buffers(r, n)
        if self.hist_len:
            torch.index_select(self.hist1, 0, slots, out=b.history_seq)
        torch.add(verified_tokens, 1, out=b.verified_seq)
        torch.add(last_tokens, 1, out=b.newest_seq)
        torch.add(top1_ids, 1, out=b.tok1)
        if top1_logprobs.dtype != self.lp.dtype:
            top1_logprobs = top1_logprobs.to(self.lp.dtype)
        learn_rows(self, b, top1_logprobs, valid)
        move_history(self, b, slots, shift)
        if num_tokens <= 0:
            return last_tokens.new_zeros(r, 0, dtype=torch.int64)
        tok1, _, drafted = walk(self, self._walk_buffers(r, num_tokens), b.window_rows,
                                self.min_confidence)
        return torch.where(drafted, tok1, b.newest).sub_(1)

    def _learn_buffers(self, r: int, n: int) -> LearnBuffers:
        return self.per_shape(("learn", r, n), lambda: LearnBuffers(self, r, n))

    def _walk_buffers(self, r: int, k: int) -> WalkBuffers:
        return self.per_shape(("walk", r, k), lambda: WalkBuffers(self, r, k))

    def per_shape(self, key, build):
        """What depends only on a step's shape, built once. The shapes a
        server sees come and go with its batch sizes (and, on the V1 route,
        its verified widths): the least recently used are let go past
        ``SHAPES_KEPT``, so that these buffers stay far below the tables."""
        got = self._shapes.get(key)
        if got is None:
            if len(self._shapes) >= self.SHAPES_KEPT:
                del self._shapes[next(iter(self._shapes))]
            got = self._shapes[key] = build()
        else:
            self._shapes.move_to_end(key)
        return got
