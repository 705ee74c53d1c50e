"""The target's top-k per logits row, with log-probabilities, cheaply on CPU.

The bridge extracts the top-k of every verified row each awake step for the
proposers that learn from the target (Token Recycling, STAND). On CPU,
``torch.topk`` over a 49k vocabulary was most of the bridge's own work on
an awake step. Here the vocabulary is cut into blocks of
``BLOCK`` logits: one pass takes every block's maximum, the k best blocks
are the only ones that can hold a top-k logit (each holds at least one logit
at or above the k-th largest, and there are at most k such blocks), and the
exact top-k is taken among their ``k * BLOCK`` logits. The log-probabilities
come from one fused ``log_softmax`` pass.
"""

from __future__ import annotations

import torch

BLOCK = 64


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities, token ids) of the k largest logits of every row,
    largest first; the same values and ids as ``torch.topk`` plus
    ``logsumexp`` (ids of exactly tied logits may come in another order)."""
    logits = logits.float()
    rows, vocab = logits.shape
    k = min(k, vocab)
    blocks = vocab // BLOCK
    if logits.device.type != "cpu" or rows == 0 or blocks <= k:
        vals, ids = torch.topk(logits, k, dim=-1)
        return vals - torch.logsumexp(logits, dim=-1, keepdim=True), ids
    # Block j holds columns j, j + blocks, j + 2 * blocks, ...: any
    # partition is exact, and this one reduces with contiguous strides.
    body = logits[:, :blocks * BLOCK].view(rows, BLOCK, blocks)
    best = torch.topk(body.amax(1), k, dim=-1).indices                # (rows, k)
    cand = torch.gather(body, 2, best[:, None, :].expand(rows, BLOCK, k))
    cand_ids = (torch.arange(BLOCK, device=logits.device)[None, :, None] * blocks
                + best[:, None, :])
    cand, cand_ids = cand.reshape(rows, -1), cand_ids.reshape(rows, -1)
    if vocab > blocks * BLOCK:  # the last, partial block: always a candidate
        cand = torch.cat([cand, logits[:, blocks * BLOCK:]], 1)
        cand_ids = torch.cat([cand_ids, torch.arange(
            blocks * BLOCK, vocab, device=logits.device).expand(rows, -1)], 1)
    ids = cand_ids.gather(1, torch.topk(cand, k, dim=-1).indices)
    # log_softmax is one fused pass; logsumexp and exp-then-sum cost more.
    return torch.log_softmax(logits, dim=-1).gather(1, ids), ids
