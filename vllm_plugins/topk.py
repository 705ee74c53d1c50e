"""The target's top-k per logits row, with log-probabilities, cheaply on CPU.

The bridge extracts the top-k of every verified row each awake step for the
proposers that learn from the target (Token Recycling, STAND). Both halves
of that work grow with the vocabulary, and on CPU they are most of the
bridge's own work on an awake step:

- The ids. ``torch.topk`` over the whole row is slow on CPU. Here the
  vocabulary is cut into blocks of ``BLOCK`` logits: one pass (torch's)
  takes every block's maximum, the k best blocks are the only ones that can
  hold a top-k logit (each holds at least one logit at or above the k-th
  largest, and there are at most k such blocks), and the exact top-k is
  taken among their ``k * BLOCK`` logits, in one compiled loop.
- The log-probabilities need each row's normaliser, a pass of ``exp`` over
  the whole row that nothing avoids. A ``log_softmax`` of all rows at once
  writes a fresh [rows, vocab] float32 tensor only to read k values of each
  row: at a 262k vocabulary and 112 verified rows, 112 MiB allocated and
  faulted in every step, which costs as much as the arithmetic. So
  ``log_softmax`` (one fused kernel) goes a chunk of rows at a time, block
  maxima first, into one buffer of
  ``CHUNK_BYTES``, at least a row per thread so that a multi-threaded engine
  still spreads the rows over its cores. Smaller chunks gain little on an
  idle core and lose much on a busy host, where every chunk's parallel
  region waits for its slowest thread. The buffer is kept for the next
  call, one per calling thread (at most ``CHUNK_BYTES`` or a row per
  thread): a fresh one is faulted in again every step.

Logits in bfloat16 or float16 are converted to float32 a chunk at a time
in the same buffer, never whole.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

BLOCK = 64
# log_softmax output per chunk of rows (at least one row per thread).
CHUNK_BYTES = 8 << 20
_kept = threading.local()  # .buffer: the calling thread's float32 log_softmax chunk


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log-probabilities, int64 token ids) of the k largest logits
    of every row, largest first; the same values and ids as ``torch.topk``
    plus ``logsumexp`` on the float32 logits (ids of exactly tied logits may
    come in another order)."""
    rows, vocab = logits.shape
    k = min(k, vocab)
    if logits.device.type != "cpu" or rows == 0:
        x = logits.float()
        vals, ids = torch.topk(x, k, dim=-1)
        return vals - torch.logsumexp(x, dim=-1, keepdim=True), ids
    logits = logits.contiguous()
    per = max(CHUNK_BYTES // (4 * vocab), torch.get_num_threads(), 1)
    buf = chunk_buffer(min(per, rows), vocab)
    ids = torch.empty(rows, k, dtype=torch.int64)
    lps = torch.empty(rows, k, dtype=torch.float32)
    for start in range(0, rows, per):
        stop = min(start + per, rows)
        chunk, x = buf[:stop - start], logits[start:stop]
        if x.dtype != torch.float32:
            # The same values in float32, converted into the buffer, where
            # log_softmax then runs in place (CPU's kernel reads each row
            # whole before writing it).
            x = chunk.copy_(x)
        ids[start:stop] = topk_ids(x, k)
        torch.log_softmax(x, -1, out=chunk)
        torch.gather(chunk, 1, ids[start:stop], out=lps[start:stop])
    return lps, ids


def topk_ids(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k largest logits of every row of a contiguous float32
    CPU tensor, largest first, by the block maxima."""
    rows, vocab = logits.shape
    blocks = vocab // BLOCK
    if blocks <= k:
        return torch.topk(logits, k, dim=-1).indices
    # Block j holds columns j * BLOCK .. (j + 1) * BLOCK - 1: any partition
    # is exact, and at a 262k vocabulary contiguous blocks reduce faster
    # than strided ones (every blocks-th column).
    # Compiled loops load with the first call: importing numba where no
    # engine of ours runs would trip vLLM's CPU build (patch cpu.kernel_scan_vars).
    from vllm_plugins.topk_blocks import topk_of_best_blocks

    maxima = logits[:, :blocks * BLOCK].view(rows, blocks, BLOCK).amax(2)
    ids = np.empty((rows, k), dtype=np.int64)
    topk_of_best_blocks(logits.numpy(), maxima.numpy(), k, BLOCK, ids)
    return torch.from_numpy(ids)


def chunk_buffer(rows: int, vocab: int) -> torch.Tensor:
    """A [rows, vocab] float32 view of this thread's kept buffer, grown
    when a call needs more."""
    kept = getattr(_kept, "buffer", None)
    if kept is None or kept.numel() < rows * vocab:
        # A normal tensor, even when allocated in an engine step: one made
        # under inference mode could not be written outside it (a process
        # that also calls this outside an engine: tests, benchmarks).
        with torch.inference_mode(False):
            kept = _kept.buffer = torch.empty(rows * vocab, dtype=torch.float32)
    return kept[:rows * vocab].view(rows, vocab)
