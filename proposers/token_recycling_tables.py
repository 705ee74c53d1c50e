"""Token Recycling's tables: the adjacency matrix of recycled top-k
successors and the higher-order context tables, with the chain walk that
drafts from them compiled by numba.

The walk is per drafted token: up to ``context_order - 1`` context hashes
and table probes, then the matrix. As a Python loop it was most of a
drafting step at batch 16, so it is an ``@njit`` loop over the tables and
preallocated output rows, the shape of vLLM's
``v1/spec_decode/ngram_proposer.py``. Learning is vectorised numpy, a
handful of array operations per step whatever the batch, or for a step of
a few requests one compiled call each (``learn_chain``): after a forward
has evicted the caches, each library call costs more than its work.

Memory (stated, fixed at start): matrix vocab*k*(4+4) bytes (SmolLM2, k=8:
3.0 MiB); context table context_slots*(8+4+4) bytes (default 2^20: 16 MiB).
"""

from __future__ import annotations

import math
import os

import numpy as np

from vllm_plugins.options import integer, positive_int
from vllm_plugins.proposers.jit import cached_njit

# The tables' options, shared by the ``token_recycling`` method and the
# hybrid's ``token_recycling`` source.
TABLE_OPTIONS = (
    positive_int("topk", 8, 64),
    integer("context_order", 3, 1, 8),
    # A context slot is a key, a token and a log-probability: 16 bytes.
    integer("context_slots", 1 << 20, 1024, 1 << 30,
            table_bytes=lambda o: 16 * o["context_slots"] if o["context_order"] >= 2
            else 16),
)

_MASK = (1 << 63) - 1
_PRIME = 1000003
# Seeded (prompt-copied) entries carry this log-probability: unknown to the
# target, so drafting trusts them like a coin flip.
SEED_LOGP = math.log(0.5)


def context_hash(tokens, order: int) -> int:
    h = 0x9E3779B97F4A7C15 ^ order
    for t in tokens:
        h = ((h * _PRIME) ^ int(t)) & _MASK
    return h


def context_hashes(seq: np.ndarray, ends: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """``context_hash(seq[e - n:e], n)`` for every pair (e, n), at once.

    The same values: uint64 products wrap modulo 2**64, and the mask keeps
    the low 63 bits, which the wrap leaves as the exact product has them.
    """
    h = np.uint64(0x9E3779B97F4A7C15) ^ orders.astype(np.uint64)
    prime, mask = np.uint64(_PRIME), np.uint64(_MASK)
    for i in range(int(orders.max(initial=0))):
        live = i < orders
        t = seq[np.where(live, ends - orders + i, 0)].astype(np.uint64)
        h = np.where(live, ((h * prime) ^ t) & mask, h)
    return h


class RecyclingTables:
    """The adjacency matrix plus the higher-order context tables."""

    def __init__(self, vocab_size: int, k: int, context_order: int, slots: int):
        self.vocab_size = vocab_size
        self.k = k
        self.context_order = context_order
        self.ids = np.full((vocab_size, k), -1, dtype=np.int32)
        self.logp = np.full((vocab_size, k), -np.inf, dtype=np.float32)
        self.slots = slots if context_order >= 2 else 1
        self.ctx_key = np.full(self.slots, -1, dtype=np.int64)
        self.ctx_tok = np.full(self.slots, -1, dtype=np.int32)
        self.ctx_logp = np.full(self.slots, -np.inf, dtype=np.float32)

    # ------------------------------------------------------------- learning
    def learn_rows(self, inputs: np.ndarray, topk_ids: np.ndarray,
                   topk_logprobs: np.ndarray) -> None:
        """Matrix rows of the verified input tokens <- the target's top-k."""
        k = min(self.k, topk_ids.shape[1])
        self.ids[inputs, :k] = topk_ids[:, :k]
        self.logp[inputs, :k] = topk_logprobs[:, :k]

    def learn_chain(self, context: np.ndarray, base: int, verified: np.ndarray,
                    topk_ids: np.ndarray, topk_logprobs: np.ndarray) -> None:
        """One request's verified chain in one compiled call: what
        ``learn_rows`` of its verified tokens and then ``learn_contexts`` of
        its rows' ends do (``context[:base]`` the tokens before the step's
        output, ``verified`` the last of them then the drafts). A step of a
        few requests makes a dozen small arrays to batch them, each a
        library call that costs more than the work after a forward has
        evicted the caches."""
        _learn_chain(self.ids, self.logp, self.ctx_key, self.ctx_tok, self.ctx_logp,
                     self.context_order, context, base, verified, topk_ids, topk_logprobs)

    def learn_context(self, seq: np.ndarray, end: int, tok: int, logp: float,
                      only_if_empty: bool = False) -> None:
        """Context tables: the last n tokens of seq[:end] -> tok, n = 2..order."""
        self.learn_contexts(np.asarray(seq), np.array([end]), np.array([tok]),
                            np.array([logp], np.float32), only_if_empty=only_if_empty)

    def learn_contexts(self, seq: np.ndarray, ends: np.ndarray, toks: np.ndarray,
                       logps: np.ndarray, starts: np.ndarray | None = None,
                       only_if_empty: bool = False) -> None:
        """``learn_context`` for many ends of ``seq`` in one pass, as if
        called for each in order (a later end overwrites an earlier one's
        slot). A context reaches back no further than its ``starts`` entry
        (default 0): several requests' sequences may share ``seq``. With
        ``only_if_empty`` (prompt seeding) a context already in the table
        keeps its entry, and within the call its first occurrence wins."""
        if self.context_order < 2 or len(ends) == 0:
            return
        if not only_if_empty:  # every pair written in order: one loop
            _learn_contexts(self.ctx_key, self.ctx_tok, self.ctx_logp, self.context_order,
                            np.ascontiguousarray(seq, np.int64),
                            np.ascontiguousarray(ends, np.int64),
                            np.zeros(len(ends), np.int64) if starts is None
                            else np.ascontiguousarray(starts, np.int64),
                            np.ascontiguousarray(toks, np.int64),
                            np.ascontiguousarray(logps, np.float32))
            return
        orders = np.arange(2, self.context_order + 1)
        e = np.repeat(np.asarray(ends, np.int64), len(orders))
        n = np.tile(orders, len(ends))
        lo = 0 if starts is None else np.repeat(np.asarray(starts, np.int64), len(orders))
        ok = e - n >= lo
        pick = np.repeat(np.arange(len(ends)), len(orders))[ok]
        e, n = e[ok], n[ok]
        keys = context_hashes(seq, e, n).astype(np.int64)
        slots = keys % self.slots
        fresh = self.ctx_key[slots] != keys
        first = np.zeros(len(keys), bool)
        first[np.unique(keys, return_index=True)[1]] = True
        fresh &= first
        keys, slots, pick = keys[fresh], slots[fresh], pick[fresh]
        # Repeated slots: numpy's advanced assignment keeps the last value.
        self.ctx_key[slots] = keys
        self.ctx_tok[slots] = np.asarray(toks)[pick]
        self.ctx_logp[slots] = np.asarray(logps)[pick]

    def seed_matrix(self, tokens: np.ndarray) -> None:
        """Prompt bigrams fill matrix rows the target has not filled yet."""
        if len(tokens) < 2:
            return
        prev, nxt = tokens[:-1], tokens[1:]
        empty = self.ids[prev, 0] < 0
        self.ids[prev[empty], 0] = nxt[empty]
        self.logp[prev[empty], 0] = SEED_LOGP

    # ------------------------------------------------------------- drafting
    def next_token(self, seq) -> tuple[int, float]:
        """The stored successor of seq (longest context with an entry, else
        the matrix) and its log-probability."""
        tok, lp = _next_token(self.ids, self.logp, self.ctx_key, self.ctx_tok,
                              self.ctx_logp, np.asarray(seq, np.int64), len(seq),
                              self.context_order)
        return int(tok), float(lp)

    def chain(self, tail, length: int, min_confidence: float
              ) -> tuple[list[int], list[float]]:
        """Most probable chain from the context ``tail``; stops when the
        running product of the stored top-1 probabilities (the chain's
        estimated acceptance) falls below min_confidence."""
        tails = np.asarray(tail, np.int64)[None, -max(self.context_order, 1):]
        if tails.shape[1] == 0:
            return [], []
        tok = np.empty((1, max(length, 0)), np.int64)
        conf = np.empty((1, max(length, 0)), np.float64)
        n = np.zeros(1, np.int64)
        self.walk(tails, np.array([tails.shape[1]]), np.array([length]),
                  min_confidence, tok, conf, n)
        return tok[0, :n[0]].tolist(), conf[0, :n[0]].tolist()

    def walk(self, tails: np.ndarray, tail_lens: np.ndarray, lengths: np.ndarray,
             min_confidence: float, out_tok: np.ndarray, out_conf: np.ndarray,
             out_len: np.ndarray) -> None:
        """``chain`` for many contexts in one loop: row i of ``tails`` holds
        a context in its first ``tail_lens[i]`` entries (at least one token);
        row i of the outputs gets its chain, ``out_len[i]`` tokens long."""
        _walk_chains(self.ids, self.logp, self.ctx_key, self.ctx_tok, self.ctx_logp,
                     self.context_order, tails, tail_lens, lengths,
                     float(min_confidence), out_tok, out_conf, out_len)

    # ------------------------------------------------------------- persistence
    def save(self, path: str) -> None:
        tmp = path + ".tmp.npz"
        np.savez(tmp, ids=self.ids, logp=self.logp, ctx_key=self.ctx_key,
                 ctx_tok=self.ctx_tok, ctx_logp=self.ctx_logp,
                 meta=np.array([self.vocab_size, self.k, self.context_order,
                                self.slots]))
        os.replace(tmp, path)

    def load(self, path: str) -> None:
        with np.load(path) as f:
            meta = [int(x) for x in f["meta"]]
            mine = [self.vocab_size, self.k, self.context_order, self.slots]
            if meta != mine:
                raise ValueError(
                    f"token_recycling warm_start_path {path!r} holds tables for "
                    f"(vocab, topk, context_order, context_slots)={tuple(meta)}, "
                    f"but this engine uses {tuple(mine)}")
            self.ids[...] = f["ids"]
            self.logp[...] = f["logp"]
            self.ctx_key[...] = f["ctx_key"]
            self.ctx_tok[...] = f["ctx_tok"]
            self.ctx_logp[...] = f["ctx_logp"]


# ------------------------------------------------------------------ kernels
# The hash is context_hash's: uint64 products wrap modulo 2**64 and the mask
# keeps the low 63 bits, which the wrap leaves as the exact product has them.

@cached_njit
def _hash(seq, end, n):
    """context_hash(seq[end - n:end], n)."""
    h = np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(n)
    for i in range(end - n, end):
        h = ((h * np.uint64(_PRIME)) ^ np.uint64(seq[i])) & np.uint64(_MASK)
    return np.int64(h)


@cached_njit
def _learn_contexts(ctx_key, ctx_tok, ctx_logp, order, seq, ends, starts, toks, logps):
    """learn_contexts without only_if_empty: each end's contexts, orders
    2..order, written in that order, so a later pair overwrites an earlier
    one's slot."""
    slots = len(ctx_key)
    for i in range(len(ends)):
        for n in range(2, order + 1):
            if ends[i] - n < starts[i]:
                break
            h = _hash(seq, ends[i], n)
            slot = h % slots
            ctx_key[slot] = h
            ctx_tok[slot] = toks[i]
            ctx_logp[slot] = logps[i]


@cached_njit
def _learn_chain(ids, logp, ctx_key, ctx_tok, ctx_logp, order, context, base, verified,
                 topk_ids, topk_lps):
    """RecyclingTables.learn_chain: matrix rows in row order, then each
    row's contexts (orders 2..order, none reaching before the context's
    start), row by row, as ``learn_rows`` then ``_learn_contexts`` write
    them."""
    rows = len(verified)
    k = min(ids.shape[1], topk_ids.shape[1])
    for j in range(rows):
        for c in range(k):
            ids[verified[j], c] = topk_ids[j, c]
            logp[verified[j], c] = topk_lps[j, c]
    if order < 2:
        return
    lo = max(0, base - order)
    seq = np.empty(base - lo + rows - 1, np.int64)
    for i in range(base - lo):
        seq[i] = context[lo + i]
    for j in range(1, rows):
        seq[base - lo + j - 1] = verified[j]
    _learn_contexts(ctx_key, ctx_tok, ctx_logp, order, seq,
                    np.arange(base - lo, base - lo + rows), np.zeros(rows, np.int64),
                    topk_ids[:rows, 0], topk_lps[:rows, 0])


@cached_njit
def _next_token(ids, logp, ctx_key, ctx_tok, ctx_logp, seq, n_seq, order):
    """RecyclingTables.next_token of seq[:n_seq]."""
    slots = len(ctx_key)
    for n in range(min(order, n_seq), 1, -1):
        h = _hash(seq, n_seq, n)
        slot = h % slots
        if ctx_key[slot] == h:
            return np.int64(ctx_tok[slot]), np.float64(ctx_logp[slot])
    last = seq[n_seq - 1]
    return np.int64(ids[last, 0]), np.float64(logp[last, 0])


@cached_njit
def _walk_chains(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tails, tail_lens,
                 lengths, min_confidence, out_tok, out_conf, out_len):
    seq = np.empty(tails.shape[1] + out_tok.shape[1], np.int64)
    for r in range(len(lengths)):
        n_seq = tail_lens[r]
        seq[:n_seq] = tails[r, :n_seq]
        running = 1.0
        n = 0
        if n_seq == 0:
            out_len[r] = 0
            continue
        for _ in range(lengths[r]):
            tok, lp = _next_token(ids, logp, ctx_key, ctx_tok, ctx_logp, seq, n_seq, order)
            if tok < 0:
                break
            p = math.exp(lp)
            running *= p
            if running < min_confidence:
                break
            out_tok[r, n] = tok
            out_conf[r, n] = p
            n += 1
            seq[n_seq] = tok
            n_seq += 1
        out_len[r] = n


def warm_up() -> None:
    """Compile (or load from numba's cache) the walk on toy tables, so that
    an engine's first step does not wait for the JIT."""
    t = RecyclingTables(4, 1, 2, 16)
    t.learn_context(np.array([1, 2, 3]), 2, 3, 0.0)
    for context in (np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.int64)):
        # The runner's token rows are int32; tests and tools pass int64.
        t.learn_chain(context, 2, np.array([2, 3]), np.zeros((2, 1), np.int64),
                      np.zeros((2, 1), np.float32))
    t.chain([1, 2], 2, 0.0)
    t.next_token([1, 2])
