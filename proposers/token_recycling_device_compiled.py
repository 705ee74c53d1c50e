"""The device route's step (``DeviceRecyclingDrafter.device_step``) as one
compiled call, where the device tables are CPU tensors; and V1's learning
and drafting on such tables (``DeviceChains``), one call each.

On a GPU the route's torch ops are kernel launches that a CUDA graph
replays as one; on a CPU each is its own dispatch, a few µs with the caches
a forward left, and a step of about a hundred of them costs more than the
work they do. Here the same step is one numba call over the tables'
memory (``Tensor.numpy()`` shares it; nothing is copied), so that the
device tables cost a CPU what the host tables do.

The torch ops (``token_recycling_device_learn``, ``_walk``) are the twin:
the same writes, in the same order, and the same drafts
(tests/test_token_recycling_device_compiled.py runs both on random steps).
One difference is allowed for: the trash entry, which the torch ops write
with every write that loses and this loop never writes (drafting never reads
it). A chain's running probability is computed alike (float64 products of
``exp`` of the stored float32), but numba's ``exp`` and torch's vectorised
one may differ in the last bit, which moves a stop only where the product
lands within a rounding of ``min_confidence``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.drafter import DeviceStep
from vllm_plugins.proposers.token_recycling_device import SEED_LOGP, DeviceRecyclingTables


@cached_njit
def _step(kt, lp, hist1, constants, prime, min_confidence, slots, cu_num_logits,
          input_ids, logits_indices, top1_ids, top1_logprobs, num_sampled, last_sampled,
          drafts):
    """learn (every request's verified rows, request by request, row by
    row, order by order: the torch route's write order) then, from each
    request's moved history, its chain into ``drafts`` [R, k]."""
    num_rows = logits_indices.shape[0]
    r_count, k = drafts.shape
    o = constants.shape[1]
    h = o - 1
    n = k + 1
    seq = np.zeros(h + n + 1, np.int64)
    # Pass 1: learning, all requests before any chain (as the twin).
    for r in range(r_count):
        if num_sampled[r] <= 0:
            continue
        slot = slots[r]
        start = cu_num_logits[r]
        rows = min(cu_num_logits[r + 1] - start, n)
        for t in range(h):
            seq[t] = hist1[slot, t]
        for j in range(rows):
            seq[h + j] = input_ids[logits_indices[start + j]] + 1
        for j in range(rows):
            _write_row(kt, lp, constants, seq, h + j, top1_ids[start + j, 0] + 1,
                       top1_logprobs[start + j, 0])
    # Pass 2: each request's history moves on, then its chain.
    window = np.zeros(o, np.int64)
    keys = np.zeros(o + 1, np.int64)
    entries = np.zeros(o, np.int64)
    no_probs = np.zeros(k, np.float32)
    for r in range(r_count):
        slot = slots[r]
        start = cu_num_logits[r]
        shift = num_sampled[r] if num_sampled[r] > 0 else 0
        newest1 = last_sampled[slot, 0] + 1
        for t in range(h):
            if shift == 0:
                window[t] = hist1[slot, t]
            elif t + shift < h:
                window[t] = hist1[slot, t + shift]
            else:
                # seq[t + shift]: a verified row's input (rows past the
                # step's logits clamp to its last, as the twin's do).
                row = min(start + t + shift - h, num_rows - 1)
                window[t] = input_ids[logits_indices[row]] + 1
        window[h] = newest1
        for t in range(h):
            hist1[slot, t] = window[t]
        _chain(kt, lp, constants, prime, min_confidence, window, keys, entries,
               newest1 - 1, drafts[r], no_probs)


@cached_njit
def _write_row(kt, lp, constants, seq, newest, tok1, logp):
    """One verified row into the tables: its contexts of orders 1..O, the
    newest token ``seq[newest]`` (tokens plus one) and those before it,
    shortest first, each to ``tok1`` with ``logp``."""
    powers, modulus, offset = constants[0], constants[1], constants[2]
    key = np.int64(0)
    for m in range(powers.shape[0]):
        key += seq[newest - m] * powers[m]
        entry = key % modulus[m] + offset[m]
        kt[entry, 0] = key
        kt[entry, 1] = tok1
        lp[entry] = logp


@cached_njit
def _chain(kt, lp, constants, prime, min_confidence, window, keys, entries, pad, drafts,
           probs):
    """One chain after ``window`` [O] (its last tokens plus one, oldest
    first) into ``drafts`` [k], ``pad`` from where it stops, and each
    drafted token's stored probability into ``probs`` [k], 0 from there
    (``keys`` [O + 1] and ``entries`` [O]: scratch). Column c of ``keys``
    is the context of order O - c, the longest probed first."""
    powers, modulus, offset = constants[0], constants[1], constants[2]
    o = powers.shape[0]
    for c in range(o):
        acc = np.int64(0)
        for t in range(c, o):
            acc += window[t] * powers[o - 1 - t]
        keys[c] = acc
    keys[o] = 0
    p = 1.0
    for j in range(drafts.shape[0]):
        for c in range(o):
            entries[c] = keys[c] % modulus[o - 1 - c] + offset[o - 1 - c]
        col = o - 1
        for c in range(o - 1):
            if kt[entries[c], 0] == keys[c]:
                col = c
                break
        best = entries[col]
        tok = kt[best, 1]
        prob = math.exp(np.float64(lp[best]))
        p *= prob
        if p < min_confidence or (min_confidence <= 0 and tok == 0):
            drafts[j:] = pad
            probs[j:] = 0.0
            return
        drafts[j] = tok - 1
        probs[j] = prob
        for c in range(o - 1):
            keys[c] = tok + keys[c + 1] * prime
        keys[o - 1] = tok


@cached_njit
def _seed(kt, lp, hist1, marks, constants, seed_logp, slots, tokens, lengths, tables,
          vocab_size, context_slots):
    """``DeviceRecyclingTables.seed``, sequentially (the matrix's entries
    start at ``context_slots``): the histories; with ``tables`` the matrix
    entries empty before the call (across requests the first request,
    within one its last occurrence wins), then the contexts whose key the
    table does not hold before the call, each context's first occurrence,
    the last of those to a slot winning. ``marks`` (the tables' ``winner``
    scratch, -1 between calls) notes the entries this call wrote."""
    r_count, p = tokens.shape
    powers = constants[0]
    o = powers.shape[0]
    h = o - 1
    trash = kt.shape[0] - 1
    for i in range(r_count):
        for t in range(h):
            pos = lengths[i] - 1 - h + t
            hist1[slots[i], t] = tokens[i, max(pos, 0)] + 1 if pos >= 0 else 0
    if not tables or p < 2:
        return
    # Matrix: the latest request first, so that the earliest writes last;
    # "empty before the call" for an entry this call already wrote (-2).
    written = np.empty(r_count * p, np.int64)
    num_written = 0
    for i in range(r_count - 1, -1, -1):
        for c in range(1, min(lengths[i], p)):
            prev = min(max(tokens[i, c - 1], 0), vocab_size)
            entry = prev + context_slots
            if entry == trash or (kt[entry, 1] != 0 and marks[entry] != -2):
                continue
            if marks[entry] != -2:
                marks[entry] = -2
                written[num_written] = entry
                num_written += 1
            kt[entry, 0] = prev + 1
            kt[entry, 1] = tokens[i, c] + 1
            lp[entry] = seed_logp
    for j in range(num_written):
        marks[written[j]] = -1
    if o < 2 or p < 3:
        return
    # Contexts of orders 2..o ending before token e, in (request, e, order)
    # order: a key's first valid occurrence, into a slot whose key before
    # the call differs; the last such write to a slot wins. ``marks`` of a
    # slot written here points at its key before the call.
    seen_keys, seen_used, seen_shift = _key_set(r_count * p * (o - 1))
    held_before = np.empty(r_count * p * (o - 1), np.int64)
    touched = np.empty(r_count * p * (o - 1), np.int64)
    num_touched = 0
    for i in range(r_count):
        for e in range(2, min(lengths[i], p)):
            key = np.int64(tokens[i, e - 1] + 1)
            for m in range(2, o + 1):
                back = e - m
                key += (tokens[i, back] + 1 if back >= 0 else 0) * powers[m - 1]
                if not _add_key(seen_keys, seen_used, seen_shift, key):
                    continue
                entry = key % context_slots
                mark = marks[entry]
                if (held_before[mark] if mark >= 0 else kt[entry, 0]) == key:
                    continue
                if mark < 0:
                    marks[entry] = num_touched
                    held_before[num_touched] = kt[entry, 0]
                    touched[num_touched] = entry
                    num_touched += 1
                kt[entry, 0] = key
                kt[entry, 1] = tokens[i, e] + 1
                lp[entry] = seed_logp
    for j in range(num_touched):
        marks[touched[j]] = -1


@cached_njit
def _learn(kt, lp, hist1, constants, slots, verified, top1_ids, top1_logprobs,
           num_verified, num_accepted):
    """``DeviceRecyclingTables.learn`` for V1's rows (verified [R, N],
    top1_ids and top1_logprobs [R, N]: each row's top-1): the entries in
    the twin's write order (request, row, context order), then each slot's
    history moved past the committed tokens."""
    r_count, n = verified.shape
    o = constants.shape[1]
    h = o - 1
    seq = np.zeros(h + n, np.int64)
    for r in range(r_count):
        rows = min(num_verified[r], n)
        if rows <= 0:
            continue
        slot = slots[r]
        for t in range(h):
            seq[t] = hist1[slot, t]
        for j in range(rows):
            seq[h + j] = verified[r, j] + 1
        for j in range(rows):
            _write_row(kt, lp, constants, seq, h + j, top1_ids[r, j] + 1, top1_logprobs[r, j])
    for r in range(r_count):
        if num_verified[r] <= 0:
            continue
        slot = slots[r]
        shift = num_accepted[r] + 1
        for t in range(h):   # reads ahead of what it writes
            src = t + shift
            hist1[slot, t] = hist1[slot, src] if src < h else verified[r, src - h] + 1


@cached_njit
def _propose(kt, lp, hist1, constants, prime, min_confidence, slots, last_tokens,
             drafts, probs):
    """``DeviceRecyclingTables.propose``: each slot's chain into ``drafts``
    [R, k] (-1 from where it stops) and each drafted token's stored
    probability into ``probs`` (0 where -1), walked as ``_step`` walks."""
    r_count = drafts.shape[0]
    o = constants.shape[1]
    h = o - 1
    window = np.zeros(o, np.int64)
    keys = np.zeros(o + 1, np.int64)
    entries = np.zeros(o, np.int64)
    for r in range(r_count):
        slot = slots[r]
        for t in range(h):
            window[t] = hist1[slot, t]
        window[h] = last_tokens[r] + 1
        _chain(kt, lp, constants, prime, min_confidence, window, keys, entries, -1,
               drafts[r], probs[r])


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@cached_njit
def _key_set(most):
    """An empty set of int64 keys, open addressing, room for ``most``: its
    slots' keys, whether each is used, and the hash's shift (a typed dict's
    calls would be most of seeding a batch of prompts)."""
    bits = 4
    while (1 << bits) < 2 * most:
        bits += 1
    return np.empty(1 << bits, np.int64), np.zeros(1 << bits, np.bool_), np.uint64(64 - bits)


@cached_njit
def _add_key(keys, used, shift, key):
    """Whether ``key`` was not in the set (it is now)."""
    mask = keys.shape[0] - 1
    at = np.int64((np.uint64(key) * _GOLDEN) >> shift)
    while used[at]:
        if keys[at] == key:
            return False
        at = (at + 1) & mask
    used[at] = True
    keys[at] = key
    return True


def compiled_seed(tables, slots: torch.Tensor, tokens: torch.Tensor, lengths: torch.Tensor,
                  seed_tables: bool) -> None:
    """``DeviceRecyclingTables.seed`` for CPU tensors, one compiled call."""
    kt, lp, hist1, winner, constants = tables.compiled_arrays()
    _seed(kt, lp, hist1, winner, constants, SEED_LOGP, slots.numpy(),
          tokens.numpy(), lengths.numpy(), seed_tables, tables.vocab_size, tables.slots)


def compiled_learn(tables, slots: np.ndarray, verified: np.ndarray, top1_ids: np.ndarray,
                   top1_logprobs: np.ndarray, num_verified: np.ndarray,
                   num_accepted: np.ndarray) -> None:
    """``DeviceRecyclingTables.learn`` for CPU tables, from host arrays
    (V1's rows): top1_ids and top1_logprobs [R, N], each row's top-1."""
    kt, lp, hist1, _, constants = tables.compiled_arrays()
    if top1_logprobs.dtype != lp.dtype:
        top1_logprobs = top1_logprobs.astype(lp.dtype)
    _learn(kt, lp, hist1, constants, slots, verified, top1_ids, top1_logprobs,
           num_verified, num_accepted)


def compiled_propose(tables, slots: np.ndarray, last_tokens: np.ndarray, num_tokens: int
                     ) -> tuple[np.ndarray, np.ndarray]:
    """``DeviceRecyclingTables.propose`` for CPU tables, as host arrays:
    drafts [R, num_tokens] int64 (-1 where the chain stopped) and float32
    probabilities."""
    r, k = slots.shape[0], max(num_tokens, 0)
    drafts = np.empty((r, k), np.int64)
    probs = np.empty((r, k), np.float32)
    if k:
        kt, lp, hist1, _, constants = tables.compiled_arrays()
        _propose(kt, lp, hist1, constants, tables.prime, tables.min_confidence, slots,
                 last_tokens, drafts, probs)
    return drafts, probs


def compiled_step(tables, step) -> torch.Tensor:
    """``DeviceRecyclingTables``' learn then draft for a ``DeviceStep``
    (its requests in distinct slots, CPU tensors): drafts [R, num_tokens]
    int64, padded with the request's newest token where the chain stops,
    in a buffer the next step of this shape overwrites."""
    r, k = step.slots.shape[0], max(step.num_tokens, 0)
    drafts, drafts_np = tables.per_shape(("drafts", r, k), lambda: _drafts_buffer(r, k))
    lps = step.top1_logprobs
    if lps.dtype != tables.lp.dtype:
        lps = lps.to(tables.lp.dtype)
    kt, lp, hist1, _, constants = tables.compiled_arrays()
    # Each call here costs a step more than the loop's own work once a
    # forward has evicted it: the [rows, 1] and [slots, 1] columns are read
    # as they are, not flattened first.
    _step(kt, lp, hist1, constants, tables.prime, tables.min_confidence, step.slots.numpy(),
          step.cu_num_logits.numpy(), step.input_ids.numpy(), step.logits_indices.numpy(),
          step.top1_ids.numpy(), lps.numpy(), step.num_sampled.numpy(),
          step.last_sampled.numpy(), drafts_np)
    return drafts


def _drafts_buffer(r: int, k: int) -> tuple[torch.Tensor, np.ndarray]:
    """The step's drafts, kept per shape: the runner copies a step's drafts
    before its next step (``DeviceDrafter.device_step``), and a fresh
    tensor costs a step more than the loop."""
    with torch.inference_mode(False):
        drafts = torch.zeros(r, k, dtype=torch.int64)
    return drafts, drafts.numpy()


def warm_up() -> None:
    """Compile (or load from numba's cache) the step and the seeding for
    the dtypes V2 hands them (int32 ids and counts, int64 slots), and V1's
    learning and drafting, before any engine step."""
    for order in (1, 3):
        t = DeviceRecyclingTables(16, order, 8, 2, 0.02, "cpu")
        compiled_seed(t, torch.tensor([0]), torch.tensor([[1, 2, 3]]), torch.tensor([3]), True)
        one = np.array([1], np.int64)
        compiled_learn(t, one - 1, np.array([[1, 2]]), np.array([[2, 3]]),
                       np.array([[-0.1, -0.1]], np.float32), one * 2, one)
        compiled_propose(t, one - 1, one, 2)
        for ids in (torch.int32, torch.int64):
            compiled_step(t, DeviceStep(
                torch.tensor([0]), torch.tensor([0, 2], dtype=torch.int32),
                torch.tensor([1, 2], dtype=ids), torch.tensor([0, 1], dtype=ids),
                torch.tensor([[2], [3]]), torch.tensor([[-0.1], [-0.1]]),
                torch.tensor([2], dtype=torch.int32), torch.tensor([[3], [4]]), 2))
