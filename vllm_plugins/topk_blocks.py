"""``topk``'s compiled half: block maxima, the top-k of the best blocks, each
row's normaliser, and the log-probabilities at those ids.

After a forward has run, each torch call of the stash starts with its
dispatch code and buffers out of cache, which costs more than the few rows'
arithmetic: a small batch's block maxima cost as much through ``amax`` as
reading the rows. So one call does a row's all: its block maxima, its top-k,
then its normaliser, a pass of ``exp`` over the row that writes nothing
(``log_softmax`` writes a row it is read from only at k places, and after a
forward that write-allocate costs as much as its arithmetic).

The ``exp`` is a polynomial here, vectorised: numba has no vector ``exp`` to
call without Intel's SVML, and calls libm's one element at a time (ten
times slower than ``log_softmax``). ``exp(x - max)`` is ``2**y`` with
``y = (x - max) * log2(e)``, split as ``y = n + r``, ``n`` an integer, ``|r| <=
1/2``: ``2**r`` by its Taylor series to degree 7 (relative error under 1e-8,
below float32's resolution) and ``2**n`` by its float32 bits, cast in a
register (``_f32_from_bits``), their product summed in the same pass: one
loop that the compiler vectorises whole and that stores nothing (buffers
for the two halves, read back to be summed, cost more than the arithmetic).
Its float32 partial sums go into a float64 total every ``SUM_CHUNK`` terms,
so the normaliser is within 1e-6 of float64's ``log_softmax`` (float32's
own can be 1e-5 away).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from vllm_plugins.proposers.jit import cached_njit

LANES = 16  # one AVX-512 register of float32; two AVX2 ones
BLOCK = 4 * LANES
# Vector arithmetic in any order; NaN and infinities kept as IEEE has them.
_FAST = {"reassoc", "contract", "arcp", "nsz", "afn"}
_LOG2E = np.float32(1.4426950408889634)
_FLOOR = np.float32(-125.0)   # 2**-125: the smallest term summed
# Terms summed in float32 before their sum joins a float64 total: a float32
# sum of a whole row drifts where its terms are alike (a row of tied
# logits), since their rounding errors add up instead of cancelling.
SUM_CHUNK = 256
# 2**r = sum (r ln 2)**j / j!, j = 0..7: ln(2)**j / j!, highest first.
_C7, _C6, _C5, _C4 = (np.float32(1.525273380405984e-05), np.float32(1.5403530393381606e-04),
                      np.float32(1.3333558146428443e-03), np.float32(9.618129107628477e-03))
_C3, _C2, _C1 = (np.float32(5.550410866482158e-02), np.float32(2.402265069591007e-01),
                 np.float32(6.931471805599453e-01))


@cached_njit
def _insert(values, ids, filled, k, value, index):
    """Put ``value`` into the descending top-k ``values`` (``filled`` of
    them so far); an equal value stays behind the ones before it."""
    if filled < k:
        j = filled
    elif value > values[k - 1]:
        j = k - 1
    else:
        return filled
    while j > 0 and values[j - 1] < value:
        values[j] = values[j - 1]
        ids[j] = ids[j - 1]
        j -= 1
    values[j] = value
    ids[j] = index
    return min(filled + 1, k)


@cached_njit
def _block_maxima(row, maxima, lanes):
    """Each ``BLOCK``'s maximum, as four vectors of lanes: written so, the
    compiler keeps them in vector registers (a running maximum over the
    block, or over a block length known only at run time, was vectorised
    across blocks with gathers, or not at all: two to four times slower)."""
    for b in range(maxima.shape[0]):
        base = b * BLOCK
        for lane in range(LANES):
            lanes[lane] = max(max(row[base + lane], row[base + LANES + lane]),
                              max(row[base + 2 * LANES + lane], row[base + 3 * LANES + lane]))
        m = lanes[0]
        for lane in range(1, LANES):
            m = max(m, lanes[lane])
        maxima[b] = m


@cached_njit
def _row_topk(row, maxima, k, best_values, best_blocks, values, out):
    """The k best blocks by their maxima, then the top-k of their logits
    and of the last, partial block (ties: the lower index first)."""
    blocks = maxima.shape[0]
    filled = 0
    for b in range(blocks):
        filled = _insert(best_values, best_blocks, filled, k, maxima[b], b)
    chosen = np.sort(best_blocks[:filled])
    filled = 0
    for b in chosen:
        for i in range(b * BLOCK, (b + 1) * BLOCK):
            filled = _insert(values, out, filled, k, row[i], i)
    for i in range(blocks * BLOCK, row.shape[0]):
        filled = _insert(values, out, filled, k, row[i], i)


@cached_njit
def topk_rows(logits, maxima, k, ids):
    """The ids of the k largest logits of every row into ``ids``, largest
    first (more than k blocks a row), given the rows' block ``maxima``: a
    block whose maximum is not among the k largest maxima holds none of
    them."""
    best_values = np.empty(k, np.float32)
    best_blocks = np.empty(k, np.int64)
    values = np.empty(k, np.float32)
    for r in range(logits.shape[0]):
        _row_topk(logits[r], maxima[r], k, best_values, best_blocks, values, ids[r])


@cached_njit
def gather_rows(values, ids, out):
    """``out[r, j] = values[r, ids[r, j]]``."""
    for r in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            out[r, j] = values[r, ids[r, j]]


@cached_njit
def topk_rows_gathered(logits, maxima, logprobs, k, ids, out):
    """``topk_rows``, then the ``logprobs`` at those ids: one call where
    the log-probabilities are ready first."""
    topk_rows(logits, maxima, k, ids)
    gather_rows(logprobs, ids, out)


@intrinsic
def _f32_from_bits(typingctx, bits):
    """The float32 whose bits are ``bits`` (an int32): ``2**n`` from its
    exponent field, in a vector register."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(types.float32))

    return types.float32(types.int32), codegen


@cached_njit(fastmath=_FAST)
def _log_normaliser(row, m):
    """``log(sum(exp(row - m)))`` for a row whose maximum is ``m`` (finite),
    or NaN where the row holds a NaN. ``x - m`` below -87 (``exp`` under
    2**-125) counts as 2**-125: a masked logit's share of the sum is nothing
    in float32. The floor is written so that a NaN passes it, and the sum.
    Each ``SUM_CHUNK`` terms are summed in float32, their sum in float64."""
    total = 0.0
    size = row.shape[0]
    for start in range(0, size, SUM_CHUNK):
        part = np.float32(0.0)
        for i in range(start, min(start + SUM_CHUNK, size)):
            y = (row[i] - m) * _LOG2E
            y = _FLOOR if _FLOOR > y else y
            n = np.rint(y)
            r = y - n
            p = _C7 * r + _C6
            p = p * r + _C5
            p = p * r + _C4
            p = p * r + _C3
            p = p * r + _C2
            p = p * r + _C1
            p = p * r + np.float32(1.0)
            part += p * _f32_from_bits(np.int32((n + np.float32(127.0)) * np.float32(8388608.0)))
        total += np.float64(part)
    return np.float32(np.log(total))


@cached_njit
def topk_logprobs_rows(logits, k, ids, out):
    """``topk_rows`` (block maxima made here, a row at a time), then each row's
    log-probabilities at those ids, ``x - max - log(sum(exp(x - max)))``
    as ``log_softmax`` computes them: NaN throughout a row that holds a NaN
    or whose maximum is not finite (an infinite logit, or every one -inf),
    as ``log_softmax`` gives."""
    rows, vocab = logits.shape
    own = np.empty(vocab // BLOCK, np.float32)
    lanes = np.empty(LANES, np.float32)
    best_values = np.empty(k, np.float32)
    best_blocks = np.empty(k, np.int64)
    values = np.empty(k, np.float32)
    for r in range(rows):
        row = logits[r]
        _block_maxima(row, own, lanes)
        _row_topk(row, own, k, best_values, best_blocks, values, ids[r])
        m = row[ids[r, 0]]
        log_sum = np.float32(np.nan)
        if np.isfinite(m):
            log_sum = _log_normaliser(row, m)
        for j in range(k):
            out[r, j] = (row[ids[r, j]] - m) - log_sum
