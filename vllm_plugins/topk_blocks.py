"""``topk``'s compiled half: block maxima, the top-k of the best blocks, and
the log-probabilities at those ids.

After a forward has run, each torch call of the stash starts with its
dispatch code and buffers out of cache, which costs more than the few rows'
arithmetic: a small batch's block maxima cost as much through ``amax`` as
reading the rows. So everything but ``log_softmax`` (whose float32 values
the stash must keep) runs here, in one call per chunk of rows.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.jit import cached_njit

LANES = 16  # one AVX-512 register of float32; two AVX2 ones
BLOCK = 4 * LANES


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
def topk_rows(logits, maxima, fill, k, ids):
    """The ids of the k largest logits of every row into ``ids``, largest
    first (more than k blocks a row): a block whose maximum is not among
    the k largest maxima holds none of them. The block maxima are made
    here when ``fill``, else taken from ``maxima``."""
    rows, vocab = logits.shape
    own = np.empty(vocab // BLOCK, np.float32)
    lanes = np.empty(LANES, np.float32)
    best_values = np.empty(k, np.float32)
    best_blocks = np.empty(k, np.int64)
    values = np.empty(k, np.float32)
    for r in range(rows):
        if fill:
            _block_maxima(logits[r], own, lanes)
            row_maxima = own
        else:
            row_maxima = maxima[r]
        _row_topk(logits[r], row_maxima, k, best_values, best_blocks, values, ids[r])


@cached_njit
def gather_rows(values, ids, out):
    """``out[r, j] = values[r, ids[r, j]]``."""
    for r in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            out[r, j] = values[r, ids[r, j]]


@cached_njit
def topk_rows_gathered(logits, maxima, fill, logprobs, k, ids, out):
    """``topk_rows``, then the ``logprobs`` at those ids: one call where
    the log-probabilities are ready first."""
    topk_rows(logits, maxima, fill, k, ids)
    gather_rows(logprobs, ids, out)
