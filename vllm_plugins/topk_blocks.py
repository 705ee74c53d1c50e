"""``topk.topk_ids``'s compiled half: the top-k of the best blocks."""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.jit import cached_njit


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
def topk_of_best_blocks(logits, maxima, k, block, out):
    """Per row, the k best blocks by their maxima, then the top-k of their
    logits and of the last, partial block: one compiled pass where torch
    took a dozen small ops (their dispatch, not the arithmetic, was the
    cost at the few rows of a small batch)."""
    rows, vocab = logits.shape
    blocks = maxima.shape[1]
    best_values = np.empty(k, np.float32)
    best_blocks = np.empty(k, np.int64)
    values = np.empty(k, np.float32)
    for r in range(rows):
        filled = 0
        for b in range(blocks):
            filled = _insert(best_values, best_blocks, filled, k, maxima[r, b], b)
        chosen = np.sort(best_blocks[:filled])   # ties: the lower index first
        filled = 0
        for b in chosen:
            for i in range(b * block, (b + 1) * block):
                filled = _insert(values, out[r], filled, k, logits[r, i], i)
        for i in range(blocks * block, vocab):
            filled = _insert(values, out[r], filled, k, logits[r, i], i)
