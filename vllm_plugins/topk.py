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

BLOCK = 64  # topk_blocks.BLOCK, named here so that importing this loads no numba
# log_softmax output per chunk of rows (at least one row per thread).
CHUNK_BYTES = 8 << 20
# From this many rows on, and on several threads, torch's block maxima (its
# threads share them); below, the compiled loop's (one call, no dispatch).
PARALLEL_ROWS = 8
_kept = threading.local()  # .buffer: the calling thread's float32 log_softmax chunk


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log-probabilities, int64 token ids) of the k largest logits
    of every row, largest first; the same values and ids as ``torch.topk``
    plus ``logsumexp`` on the float32 logits (ids of exactly tied logits may
    come in another order: on CPU the lower id first)."""
    rows, vocab = logits.shape
    k = min(k, vocab)
    if logits.device.type != "cpu" or rows == 0:
        x = logits.float()
        vals, ids = torch.topk(x, k, dim=-1)
        return vals - torch.logsumexp(x, dim=-1, keepdim=True), ids
    if vocab // BLOCK <= k:
        x = logits.float()
        ids = torch.topk(x, k, dim=-1).indices
        return torch.log_softmax(x, -1).gather(1, ids), ids
    # Compiled loops load with the first call: importing numba where no
    # engine of ours runs would trip vLLM's CPU build (patch cpu.kernel_scan_vars).
    from vllm_plugins.topk_blocks import gather_rows, topk_rows, topk_rows_gathered

    logits = logits.contiguous()
    per = max(CHUNK_BYTES // (4 * vocab), torch.get_num_threads(), 1)
    fill = rows < PARALLEL_ROWS or torch.get_num_threads() == 1
    buf = chunk_buffer(min(per, rows), vocab)
    ids = np.empty((rows, k), dtype=np.int64)
    lps = np.empty((rows, k), dtype=np.float32)
    for start in range(0, rows, per):
        stop = min(start + per, rows)
        chunk, x = (buf, logits) if stop - start == rows else (buf[:stop - start], logits[start:stop])
        out_ids, out_lps = ids[start:stop], lps[start:stop]
        if x.dtype == torch.float32:
            torch.log_softmax(x, -1, out=chunk)
            topk_rows_gathered(x.numpy(), block_maxima(x, fill), fill, chunk.numpy(),
                               k, out_ids, out_lps)
        else:
            # The same values in float32, converted into the buffer, where
            # log_softmax then runs in place (CPU's kernel reads each row
            # whole before writing it) once the ids are taken.
            values = chunk.copy_(x).numpy()
            topk_rows(values, block_maxima(chunk, fill), fill, k, out_ids)
            torch.log_softmax(chunk, -1, out=chunk)
            gather_rows(values, out_ids, out_lps)
    return torch.from_numpy(lps), torch.from_numpy(ids)


def block_maxima(x: torch.Tensor, fill: bool) -> np.ndarray:
    """Room for the compiled loop's block maxima when it fills them, else
    torch's."""
    rows, vocab = x.shape
    blocks = vocab // BLOCK
    if fill:
        return np.empty((rows, blocks), dtype=np.float32)
    return x[:, :blocks * BLOCK].view(rows, blocks, BLOCK).amax(2).numpy()


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
