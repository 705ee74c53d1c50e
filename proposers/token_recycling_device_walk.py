"""Token Recycling's chain walk over the device tables
(``DeviceRecyclingTables``) in as few torch calls as the walk allows.

At the batch sizes a step serves, the walk costs what its calls cost (each
a kernel launch on a GPU, a few µs of dispatch on a CPU, a view as much as
a kernel), not what they compute; and the chain is sequential, k steps of
the same calls. So everything that depends only on the batch size and the
draft length is built once per shape (``WalkBuffers``) and each step writes
into it with ``out=``:

- each step's rolling keys are a row of one ``[R, k, O + 1]`` buffer,
  longest context first, then a zero column: the next step's keys are one
  ``add(tok1, keys[:, 1:], alpha=tables.prime)`` written into the next row;
- the longest context whose stored key matches is the first maximum of
  ``[hit_O, ..., hit_2, 1]`` (``argmax``): the constant 1 is the matrix,
  drafted from when no context matches whatever its own key says;
- a probe reads a row of the tables' ``kt`` (key and token) for every
  order at once; the chosen column and token land in ``[R, k]`` buffers,
  and the drafted entries and their log-probabilities are read once, after
  the walk.
"""

from __future__ import annotations

import torch


class WalkBuffers:
    """Scratch and constants of a walk of ``k`` steps for ``r`` chains on
    ``tables`` (built eagerly, once per shape). The buffers are normal
    tensors even when built under inference mode, so that a later call
    outside it may still write them."""

    def __init__(self, tables, r: int, k: int):
        o, dev, i64 = tables.order, tables.device, torch.int64
        with torch.inference_mode(False):
            self.keys = torch.zeros(r, k, o + 1, dtype=i64, device=dev)
            self.entry = torch.zeros(k, r, o, dtype=i64, device=dev)
            self.probed = torch.zeros(r * o, 2, dtype=i64, device=dev)  # rows of kt
            self.col = torch.zeros(r, k, dtype=i64, device=dev)
            self.tok1 = torch.zeros(r, k, dtype=i64, device=dev)
            self.hit = torch.ones(r, o, dtype=i64, device=dev)
            # ``propose``'s window: each chain's history, then its newest token.
            self.window = torch.zeros(r, 1, o, dtype=i64, device=dev)
            # Order 1: the entry is the matrix's, no choice to make.
            self.best = self.entry.view(k, r).t() if o == 1 else torch.zeros(
                r, k, dtype=i64, device=dev)
            # Per-column constants, longest context first.
            self.modulus = tables.modulus.flip(0)
            self.offset = tables.offset.flip(0)
            # The window (oldest token first) to its keys: column c sums
            # window[t] * PRIME**(O - 1 - t) over t >= c.
            t = torch.arange(o, device=dev)
            self.mix = tables.powers.flip(0).expand(o, o) * (t >= t.unsqueeze(1))
        self.window_history = self.window[:, 0, :o - 1]
        self.window_newest = self.window[:, 0, o - 1]
        probed = self.probed.view(r, o, 2)
        self.probed_key = probed[:, :o - 1, 0]
        self.probed_tok1 = probed[:, :, 1]
        self.hit_ctx = self.hit[:, :o - 1]
        self.keys0 = self.keys[:, 0, :o]
        self.entry_by_chain = self.entry.permute(1, 0, 2)
        self.col_by_chain = self.col.unsqueeze(2)
        self.best_by_chain = self.best.unsqueeze(2)
        self.steps = []
        for j in range(k):
            keys = self.keys[:, j, :o]
            self.steps.append((
                keys, self.keys[:, j + 1, :o] if j + 1 < k else None, self.keys[:, j, 1:],
                keys[:, :o - 1], self.entry[j], self.entry[j].view(-1), self.col[:, j:j + 1],
                self.tok1[:, j:j + 1]))


def walk(tables, b: WalkBuffers, window1: torch.Tensor, min_confidence: float
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The chains after ``window1`` [R, 1, O] (each chain's last tokens
    plus one, oldest first; 0: none): the stored token plus one of each step
    [R, k] (``b.tok1``, overwritten by the next walk of this shape), its
    probability [R, k] float64, and whether it is drafted [R, k] bool (up
    to the first unknown token or the first running product of
    probabilities below ``min_confidence``)."""
    contexts = tables.order > 1
    torch.sum(window1 * b.mix, 2, out=b.keys0)
    for keys, nxt, shifted, keys_ctx, entry, entry_flat, col, tok in b.steps:
        torch.remainder(keys, b.modulus, out=entry)
        entry.add_(b.offset)
        if contexts:
            torch.index_select(tables.kt, 0, entry_flat, out=b.probed)
            torch.eq(b.probed_key, keys_ctx, out=b.hit_ctx)
            torch.gather(b.probed_tok1, 1, torch.argmax(b.hit, 1, keepdim=True, out=col),
                         out=tok)
        else:
            torch.take(tables.tok1, entry, out=tok)
        if nxt is not None:
            torch.add(tok, shifted, alpha=tables.prime, out=nxt)
    if contexts:
        torch.gather(b.entry_by_chain, 2, b.col_by_chain, out=b.best_by_chain)
    prob = tables.lp.take(b.best).double().exp()
    stop = prob.cumprod(1) < min_confidence
    if min_confidence <= 0:
        stop.logical_or_(b.tok1 == 0)
    # Else an unknown token stops the chain by its probability alone: an
    # entry whose token is 0 was never written, so its log-probability is
    # still -inf (every write stores a token of at least 1 with its
    # log-probability), and the running product is 0 from there on.
    return b.tok1, prob, stop.cumsum(1) == 0
