"""STAND's n-gram store, as flat arrays walked by numba loops.

Every verified position of every request updates up to ``max_order`` entries
and every drafted token looks up to ``max_order`` keys, so the store is the
proposer's per-token work. An ``OrderedDict`` index and a Python merge per
entry made that work most of a step; here the index, the LRU order, the
merge and the greedy walk are plain arrays and ``@njit`` loops, the shape of
vLLM's ``v1/spec_decode/ngram_proposer.py``. Behaviour is the dict
version's, entry for entry (tests/test_stand.py keeps that version as a
reference and compares).

Layout of one store:

* slots: ``ids[slot, width]`` (int32, -1 empty), ``probs[slot, width]``
  (float32), ``weight[slot]`` (float32) and ``keys[slot]`` (int64, -1 free);
* index: open addressing with linear probing over ``table`` (slot + 1;
  0 empty), a power of two at least twice the slots, deleted by backward
  shift, so no tombstones;
* LRU order: a doubly linked list through ``prev`` / ``next``, head the
  least recently used;
* free slots: a stack; ``meta`` holds the list ends and the counters.

Arrays grow by doubling up to ``capacity``. A loop that needs a slot while
none is free and the arrays can still grow stops and returns where it
stopped; the caller grows the arrays and calls again from there.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import Option, integer, number
from vllm_plugins.proposers.jit import cached_njit

# The store's options, shared by the ``stand`` method and the hybrid's
# ``stand`` source.
STORE_OPTIONS = (
    number("prompt_prob", 0.5, 0.0, 1.0, lo_open=True),
    integer("history", 16, 1, 1 << 16),
    # An entry at most: topk (int32, float32) pairs and a weight, twice
    # over while its arrays double, plus its LRU index node (module doc).
    integer("max_entries", 1 << 18, 256, 1 << 26,
            table_bytes=lambda o: o["max_entries"] * (2 * (8 * o["topk"] + 4) + 200)),
    integer("max_stores", 64, 1, 1 << 16),
    Option("share", "prompt", str, choices=("prompt", "group", "request")),
)

_MASK = (1 << 63) - 1
_P1 = 0x100000001B3
_P2 = 0x9E3779B97F4A7C15
_OFFSET = 0xCBF29CE484222325

# meta[] fields
_HEAD, _TAIL, _COUNT, _NFREE, _EVICTED = range(5)
_GROW = -2  # a loop's "grow the arrays and call again" answer


def context_keys(seq, max_order: int) -> list[int]:
    """Keys of the contexts ending seq: orders 1..max_order (shorter if seq is)."""
    keys = []
    h = _OFFSET
    n = len(seq)
    for i in range(1, min(max_order, n) + 1):
        h = ((h ^ int(seq[n - i])) * _P1) & _MASK
        keys.append(((h ^ (i * _P2)) * _P1) & _MASK)
    return keys


# ------------------------------------------------------------------ kernels
# uint64 products wrap modulo 2**64 and the mask keeps the low 63 bits, which
# the wrap leaves as the exact product has them: the keys equal context_keys.

@cached_njit
def _key(seq, end, order):
    """context_keys(seq[:end], order)[order - 1]."""
    h = np.uint64(_OFFSET)
    key = np.uint64(0)
    for i in range(1, order + 1):
        h = ((h ^ np.uint64(seq[end - i])) * np.uint64(_P1)) & np.uint64(_MASK)
        key = ((h ^ (np.uint64(i) * np.uint64(_P2))) * np.uint64(_P1)) & np.uint64(_MASK)
    return np.int64(key)


@cached_njit
def _bucket(key, size):
    x = np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)
    x ^= x >> np.uint64(32)
    return np.int64(x & np.uint64(size - 1))


@cached_njit
def _lookup(table, keys, key):
    size = len(table)
    i = _bucket(key, size)
    while True:
        s = table[i]
        if s == 0:
            return -1
        if keys[s - 1] == key:
            return s - 1
        i = (i + 1) & (size - 1)


@cached_njit
def _table_insert(table, keys, slot):
    size = len(table)
    i = _bucket(keys[slot], size)
    while table[i] != 0:
        i = (i + 1) & (size - 1)
    table[i] = slot + 1


@cached_njit
def _table_remove(table, keys, key):
    size = len(table)
    m = size - 1
    i = _bucket(key, size)
    while keys[table[i] - 1] != key:  # the key is present
        i = (i + 1) & m
    j = i
    while True:  # backward shift: keep every later entry reachable
        j = (j + 1) & m
        s = table[j]
        if s == 0:
            break
        home = _bucket(keys[s - 1], size)
        if (i <= j and (home <= i or home > j)) or (i > j and home <= i and home > j):
            table[i] = s
            i = j
    table[i] = 0


@cached_njit
def _rebuild_table(table, keys):
    table[:] = 0
    for s in range(len(keys)):
        if keys[s] >= 0:
            _table_insert(table, keys, s)


@cached_njit
def _unlink(prev, nxt, meta, s):
    p, n = prev[s], nxt[s]
    if p >= 0:
        nxt[p] = n
    else:
        meta[_HEAD] = n
    if n >= 0:
        prev[n] = p
    else:
        meta[_TAIL] = p


@cached_njit
def _append(prev, nxt, meta, s):
    t = meta[_TAIL]
    prev[s] = t
    nxt[s] = -1
    if t >= 0:
        nxt[t] = s
    else:
        meta[_HEAD] = s
    meta[_TAIL] = s


@cached_njit
def _touch(prev, nxt, meta, s):
    if meta[_TAIL] != s:
        _unlink(prev, nxt, meta, s)
        _append(prev, nxt, meta, s)


@cached_njit
def _evict_lru(keys, table, prev, nxt, free, meta, count):
    """Drop the ``count`` least recently used entries."""
    for _ in range(min(count, meta[_COUNT])):
        s = meta[_HEAD]
        _table_remove(table, keys, keys[s])
        keys[s] = -1
        _unlink(prev, nxt, meta, s)
        free[meta[_NFREE]] = s
        meta[_NFREE] += 1
        meta[_COUNT] -= 1
        meta[_EVICTED] += 1


@cached_njit
def _slot_for(ids, probs, weight, keys, table, prev, nxt, free, meta, capacity, key):
    """The key's slot (most recently used now), a new empty one, or _GROW."""
    s = _lookup(table, keys, key)
    if s >= 0:
        _touch(prev, nxt, meta, s)
        return s
    if meta[_NFREE] == 0:
        if len(weight) < capacity:
            return _GROW
        _evict_lru(keys, table, prev, nxt, free, meta, 1)
    meta[_NFREE] -= 1
    s = free[meta[_NFREE]]
    keys[s] = key
    _table_insert(table, keys, s)
    _append(prev, nxt, meta, s)
    meta[_COUNT] += 1
    ids[s, :] = -1
    probs[s, :] = 0.0
    weight[s] = 0.0
    return s


@cached_njit
def _merge(ids, probs, weight, slot, new_ids, new_p, history, cand_t, cand_p):
    """Average one observation (the target's top-k) into an entry.

    As the dict merge did: candidates in insertion order (the entry's tokens,
    then new ones), a stable sort by descending probability, the top ``width``
    kept. New entries and prompt seeds (weight 0) are replaced outright."""
    width = ids.shape[1]
    w = np.float64(weight[slot])
    nc = 0
    if w == 0.0:
        for c in range(len(new_ids)):
            p = new_p[c]
            if p > 0.0:
                t = new_ids[c]
                at = -1
                for e in range(nc):
                    if cand_t[e] == t:
                        at = e
                if at >= 0:
                    cand_p[at] = p
                else:
                    cand_t[nc] = t
                    cand_p[nc] = p
                    nc += 1
    else:
        a = w / (w + 1.0)
        b = 1.0 / (w + 1.0)
        for c in range(width):
            t = ids[slot, c]
            if t >= 0:
                cand_t[nc] = t
                cand_p[nc] = a * np.float64(probs[slot, c])
                nc += 1
        for c in range(len(new_ids)):
            p = new_p[c]
            if p > 0.0:
                t = new_ids[c]
                at = -1
                for e in range(nc):
                    if cand_t[e] == t:
                        at = e
                if at >= 0:
                    cand_p[at] = cand_p[at] + b * p
                else:
                    cand_t[nc] = t
                    cand_p[nc] = b * p
                    nc += 1
    for i in range(1, nc):  # stable insertion sort, descending
        t, p = cand_t[i], cand_p[i]
        j = i
        while j > 0 and cand_p[j - 1] < p:
            cand_t[j] = cand_t[j - 1]
            cand_p[j] = cand_p[j - 1]
            j -= 1
        cand_t[j] = t
        cand_p[j] = p
    ids[slot, :] = -1
    probs[slot, :] = 0.0
    for c in range(min(nc, width)):
        ids[slot, c] = cand_t[c]
        probs[slot, c] = np.float32(cand_p[c])
    weight[slot] = min(w + 1.0, history)


@cached_njit
def _learn_rows(ids, probs, weight, keys, table, prev, nxt, free, meta, capacity,
                 history, seq, head, top_ids, top_p, max_order, start):
    """Row j of top_ids / top_p (the target's top-k after seq[:head + j])
    averaged into the entries of the contexts ending there, orders 1..max_order.
    Items are (row, order) pairs in that order; returns the item to resume
    at after growing, or the item count when done."""
    rows = top_ids.shape[0]
    total = rows * max_order
    cand_t = np.empty(ids.shape[1] + top_ids.shape[1], np.int64)
    cand_p = np.empty(ids.shape[1] + top_ids.shape[1], np.float64)
    for item in range(start, total):
        j = item // max_order
        order = item % max_order + 1
        if order > min(max_order, head + j):
            continue
        key = _key(seq, head + j, order)
        s = _slot_for(ids, probs, weight, keys, table, prev, nxt, free, meta,
                      capacity, key)
        if s == _GROW:
            return item
        _merge(ids, probs, weight, s, top_ids[j], top_p[j], history, cand_t, cand_p)
    return total


@cached_njit
def _seed_ngrams(ids, probs, weight, keys, table, prev, nxt, free, meta, capacity,
                toks, max_order, prob, start):
    """Prompt n-grams: context toks[:end] -> toks[end] with probability prob,
    only where the target has not spoken (weight 0). Items are (end, order)
    pairs; returns as _learn_rows does."""
    total = max(len(toks) - 1, 0) * max_order
    for item in range(start, total):
        end = item // max_order + 1
        order = item % max_order + 1
        if order > min(max_order, end):
            continue
        key = _key(toks, end, order)
        s = _lookup(table, keys, key)
        if s >= 0 and weight[s] > 0.0:
            continue
        s = _slot_for(ids, probs, weight, keys, table, prev, nxt, free, meta,
                      capacity, key)
        if s == _GROW:
            return item
        ids[s, :] = -1
        probs[s, :] = 0.0
        ids[s, 0] = toks[end]
        probs[s, 0] = np.float32(prob)
    return total


@cached_njit
def _find_longest(keys, table, prev, nxt, meta, seq, n, max_order, touch):
    """(slot, order) of the longest stored context ending seq[:n], or (-1, 0);
    the found entry becomes the most recently used when ``touch``."""
    for order in range(min(max_order, n), 0, -1):
        s = _lookup(table, keys, _key(seq, n, order))
        if s >= 0:
            if touch:
                _touch(prev, nxt, meta, s)
            return s, order
    return -1, 0


@cached_njit
def greedy_chain(ids, probs, weight, keys, table, prev, nxt, meta, tail, length,
                 max_order, cal_accepted, cal_trials, cal_score_sum, prior,
                 calibrate, threshold, touch, out_tok, out_conf, out_kind, out_score):
    """The most probable path from the context ``tail`` (StandProposer.chain
    at temperature 0): each token the top-1 of the longest stored context,
    its confidence that entry's top-1 probability, calibrated per kind
    (KindCalibration.confidence), stopping before the running product would
    fall under ``threshold``. Returns (tokens drafted, lookups hit, missed)."""
    seq = np.empty(len(tail) + length, np.int64)
    seq[:len(tail)] = tail
    n_seq = len(tail)
    running = 1.0
    hits = 0
    misses = 0
    out = 0
    for _ in range(length):
        s, order = _find_longest(keys, table, prev, nxt, meta, seq, n_seq, max_order, touch)
        if s < 0:
            misses += 1
            break
        hits += 1
        if ids[s, 0] < 0:
            break
        score = np.float64(probs[s, 0])
        kind = (order - 1) * 2 + (1 if weight[s] == 0.0 else 0)
        c = score
        if calibrate:
            est = (cal_accepted[kind] + 2.0 * prior) / (cal_trials[kind] + 2.0)
            if cal_trials[kind] >= 1.0 and cal_score_sum[kind] > 0:
                est *= score / (cal_score_sum[kind] / cal_trials[kind])
            c = min(max(est, 0.01), 0.99)
        if running * c < threshold:
            break
        running *= c
        out_tok[out] = ids[s, 0]
        out_conf[out] = c
        out_kind[out] = kind
        out_score[out] = score
        out += 1
        seq[n_seq] = ids[s, 0]
        n_seq += 1
    return out, hits, misses


# ------------------------------------------------------------------ the store
class NgramStore:
    """One prompt group's table: context key -> the target's next-token distribution.

    An entry holds up to ``width`` (token, probability) pairs sorted by
    descending probability (target probabilities at temperature 1; the rest of
    the mass is unknown) and a weight: the number of observations averaged in,
    capped at ``history`` so the entry keeps adapting. Prompt-copied entries
    have weight 0: the first observation by the target replaces them.
    """

    def __init__(self, width: int, capacity: int, history: int, initial: int = 256):
        self.width = width
        self.capacity = capacity
        self.history = float(history)
        n = min(initial, capacity)
        self.ids = np.full((n, width), -1, dtype=np.int32)
        self.probs = np.zeros((n, width), dtype=np.float32)
        self.weight = np.zeros(n, dtype=np.float32)
        self.keys = np.full(n, -1, dtype=np.int64)
        self.prev = np.full(n, -1, dtype=np.int32)
        self.next = np.full(n, -1, dtype=np.int32)
        self.free = np.arange(n - 1, -1, -1, dtype=np.int32)  # slot 0 pops first
        self.table = np.zeros(_table_size(n), dtype=np.int32)
        self.meta = np.array([-1, -1, 0, n, 0], dtype=np.int64)
        self.seeded = False

    def __len__(self) -> int:
        return int(self.meta[_COUNT])

    def __contains__(self, key: int) -> bool:
        return self.slot_of(key) >= 0

    @property
    def evicted(self) -> int:
        return int(self.meta[_EVICTED])

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.ids, self.probs, self.weight, self.keys,
                                      self.prev, self.next, self.free, self.table))

    def slot_of(self, key: int) -> int:
        """The key's slot, or -1; the LRU order is left as it is."""
        return int(_lookup(self.table, self.keys, np.int64(key)))

    def lru_keys(self) -> list[int]:
        """Keys from least to most recently used."""
        out, s = [], int(self.meta[_HEAD])
        while s >= 0:
            out.append(int(self.keys[s]))
            s = int(self.next[s])
        return out

    def touch(self, key: int) -> None:
        s = self.slot_of(key)
        if s >= 0:
            _touch(self.prev, self.next, self.meta, s)

    def evict_lru(self, count: int) -> None:
        """Drop the ``count`` least recently used entries."""
        _evict_lru(self.keys, self.table, self.prev, self.next, self.free, self.meta,
                  int(count))

    def _grow(self) -> None:
        n = len(self.weight)
        m = min(2 * n, self.capacity)
        extra = m - n
        self.ids = np.concatenate([self.ids, np.full((extra, self.width), -1, np.int32)])
        self.probs = np.concatenate([self.probs, np.zeros((extra, self.width), np.float32)])
        self.weight = np.concatenate([self.weight, np.zeros(extra, np.float32)])
        self.keys = np.concatenate([self.keys, np.full(extra, -1, np.int64)])
        self.prev = np.concatenate([self.prev, np.full(extra, -1, np.int32)])
        self.next = np.concatenate([self.next, np.full(extra, -1, np.int32)])
        nfree = int(self.meta[_NFREE])
        free = np.empty(m, np.int32)
        free[:nfree] = self.free[:nfree]
        free[nfree:nfree + extra] = np.arange(m - 1, n - 1, -1)  # slot n pops first
        self.free = free
        self.meta[_NFREE] = nfree + extra
        if len(self.table) < _table_size(m):
            self.table = np.zeros(_table_size(m), dtype=np.int32)
            _rebuild_table(self.table, self.keys)

    def _arrays(self):
        return (self.ids, self.probs, self.weight, self.keys, self.table, self.prev,
                self.next, self.free, self.meta, self.capacity)

    # ------------------------------------------------------------- learning
    def observe_rows(self, seq: np.ndarray, head: int, top_ids: np.ndarray,
                     top_p: np.ndarray, max_order: int) -> None:
        """Row j of (top_ids, top_p) is the target's distribution after
        seq[:head + j]: averaged into the entries of the contexts ending
        there, orders 1..max_order, row by row."""
        seq = np.ascontiguousarray(seq, dtype=np.int64)
        top_ids = np.ascontiguousarray(top_ids, dtype=np.int64)
        top_p = np.ascontiguousarray(top_p, dtype=np.float64)
        done, total = 0, len(top_ids) * max_order
        while done < total:
            done = _learn_rows(*self._arrays(), self.history, seq, int(head),
                                top_ids, top_p, int(max_order), done)
            if done < total:
                self._grow()

    def observe(self, key: int, ids: np.ndarray, probs: np.ndarray) -> None:
        """Average the target's distribution (top-k ids, probs) into the
        entry of one key."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        probs = np.ascontiguousarray(probs, dtype=np.float64)
        while True:
            s = _slot_for(*self._arrays(), np.int64(key))
            if s != _GROW:
                break
            self._grow()
        n = self.width + len(ids)
        _merge(self.ids, self.probs, self.weight, s, ids, probs, self.history,
               np.empty(n, np.int64), np.empty(n, np.float64))

    def seed_tokens(self, toks: np.ndarray, max_order: int, prob: float) -> None:
        """Every n-gram of toks (orders 1..max_order) -> the token after it,
        where the target has not spoken yet."""
        toks = np.ascontiguousarray(toks, dtype=np.int64)
        done, total = 0, max(len(toks) - 1, 0) * max_order
        while done < total:
            done = _seed_ngrams(*self._arrays(), toks, int(max_order), float(prob), done)
            if done < total:
                self._grow()

    def seed(self, key: int, token: int, prob: float) -> None:
        """One prompt n-gram: only where the target has not spoken yet."""
        s = self.slot_of(key)
        if s >= 0 and self.weight[s] > 0.0:
            return
        while True:
            s = _slot_for(*self._arrays(), np.int64(key))
            if s != _GROW:
                break
            self._grow()
        self.ids[s] = -1
        self.probs[s] = 0.0
        self.ids[s, 0] = token
        self.probs[s, 0] = prob

    # ------------------------------------------------------------- lookup
    def find(self, seq, max_order: int, touch: bool = True) -> tuple[int, int]:
        """(slot, order) of the longest stored context ending seq, or (-1, 0)."""
        seq = np.asarray(seq, dtype=np.int64)
        s, order = _find_longest(self.keys, self.table, self.prev, self.next, self.meta, seq,
                        len(seq), int(max_order), bool(touch))
        return int(s), int(order)

    def is_seed(self, slot: int) -> bool:
        return bool(self.weight[slot] == 0.0)

    def entry(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.ids[slot]
        n = int((ids >= 0).sum())
        return ids[:n], self.probs[slot, :n]


def _table_size(slots: int) -> int:
    """The index's size: a power of two at least twice the slots (load <= 1/2)."""
    return 1 << max(2 * slots - 1, 1).bit_length()


def warm_up() -> None:
    """Compile (or load from numba's cache) every loop on a toy store, so
    that an engine's first step does not wait for the JIT."""
    s = NgramStore(width=2, capacity=8, history=4, initial=2)
    toks = np.array([1, 2, 3, 1, 2, 4], np.int64)
    s.seed_tokens(toks, 2, 0.5)
    s.observe_rows(toks, 3, np.array([[1, 2], [3, 4]], np.int64),
                   np.array([[0.5, 0.25], [0.5, 0.25]]), 2)
    s.observe(5, np.array([1, 2], np.int64), np.array([0.5, 0.5]))
    s.find(toks, 2)
    s.evict_lru(1)
    n = 3
    greedy_chain(s.ids, s.probs, s.weight, s.keys, s.table, s.prev, s.next, s.meta,
                 toks[-2:], n, 2, np.zeros(8), np.zeros(8), np.zeros(8), 0.5, True,
                 0.1, True, np.empty(n, np.int64), np.empty(n, np.float64),
                 np.empty(n, np.int64), np.empty(n, np.float64))
