"""The target's top-k per logits row, with log-probabilities, cheaply on CPU.

The bridge extracts the top-k of every verified row each awake step for the
proposers that learn from the target (Token Recycling, STAND). Both halves
of that work grow with the vocabulary, and on CPU they are most of the
bridge's own work on an awake step:

- The ids. ``torch.topk`` over the whole row is slow on CPU. Here the
  vocabulary is cut into blocks of ``BLOCK`` logits: the k blocks with the
  largest maxima are the only ones that can hold a top-k logit (each holds
  at least one logit at or above the k-th largest, and there are at most k
  such blocks), and the exact top-k is taken among their ``k * BLOCK``
  logits.
- The log-probabilities need each row's normaliser, a pass of ``exp`` over
  the whole row that nothing avoids. ``log_softmax`` makes it and then
  writes a whole row only to have k values of it read: after a forward,
  whose weights evicted the buffer, that write costs as much as the
  arithmetic. So a few rows (fewer than ``PARALLEL_ROWS``), or an engine
  on fewer than ``PARALLEL_THREADS`` threads, go through one compiled
  call, which takes a row's block maxima, top-k and normaliser (a
  vectorised ``exp`` that writes nothing: ``topk_blocks``) and never makes
  a tensor. Its log-probabilities are ``log_softmax``'s but for the last
  bits of the normaliser (about 1e-6 of it: another summation order).
- Many rows on many threads go to torch, whose threads share them:
  block maxima by ``amax`` and ``log_softmax`` into a kept buffer, a chunk
  of rows (``CHUNK_BYTES``, at least a row per thread) at a time, the top-k
  and gather compiled. A ``log_softmax`` of all rows at once would write a
  fresh [rows, vocab] float32 tensor: at a 262k vocabulary and 112
  verified rows, 112 MiB allocated and faulted in every step. Smaller
  chunks gain little on an idle core and lose much on a busy host, where
  every chunk's parallel region waits for its slowest thread. The buffer
  is kept for the next call, one per calling thread, with its views.

``topk_logprobs_numpy`` hands a host caller the arrays without tensors
around them: after a forward each torch call (a view, ``.numpy()``, a
tensor of the results) costs tens of microseconds. Logits in bfloat16 or
float16 are converted to float32 a chunk at a time in the kept buffer,
never whole.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

BLOCK = 64  # topk_blocks.BLOCK, named here so that importing this loads no numba
# A chunk of rows in float32: log_softmax's output, or half-precision rows
# converted (at least one row per thread).
CHUNK_BYTES = 8 << 20
# From this many rows on, on this many threads or more, torch's block maxima
# and log_softmax (its threads share them); else the compiled loop's all,
# which on two threads still takes less wall time (it writes nothing).
PARALLEL_ROWS = 8
PARALLEL_THREADS = 4
# .buffer: the calling thread's float32 chunk; .views: that buffer and its
# (tensor, array) views by shape.
_kept = threading.local()
_blocks = None  # vllm_plugins.topk_blocks once loaded (compiled())


def topk_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 log-probabilities, int64 token ids) of the k largest logits
    of every row, largest first, on the logits' device; the same values and
    ids as ``torch.topk`` plus ``logsumexp`` on the float32 logits (ids of
    exactly tied logits may come in another order: on CPU the lower id
    first)."""
    if blocked(logits, k):
        lps, ids = host_topk(logits, k)
        return torch.from_numpy(lps), torch.from_numpy(ids)
    k = min(k, logits.shape[1])
    x = logits.float()
    if logits.is_cpu:   # a handful of blocks or no rows
        ids = torch.topk(x, k, dim=-1).indices
        return torch.log_softmax(x, -1).gather(1, ids), ids
    vals, ids = torch.topk(x, k, dim=-1)
    return vals - torch.logsumexp(x, dim=-1, keepdim=True), ids


def topk_logprobs_numpy(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``topk_logprobs`` as host arrays, for a caller that reads them there:
    on CPU no tensor is made around them; on a device they are copied once."""
    if blocked(logits, k):
        return host_topk(logits, k)
    lps, ids = topk_logprobs(logits, k)
    return lps.cpu().numpy(), ids.cpu().numpy()


def blocked(logits: torch.Tensor, k: int) -> bool:
    """Whether the blocked host path serves these logits: on CPU, with rows,
    and with more blocks than k (else ``torch.topk`` is as cheap)."""
    rows, vocab = logits.shape
    return logits.is_cpu and rows > 0 and vocab // BLOCK > k


def first_is_argmax(logits: torch.Tensor, k: int) -> bool:
    """Whether ``topk_logprobs(logits, k)``'s first id of a row whose first
    log-probability is finite is that row's first maximum, the index
    ``argmax`` gives: so on the blocked host path, which keeps the lower of
    tied ids first. A row holding NaN or an infinity has a NaN
    log-probability (as ``log_softmax`` gives) and must be read by ``argmax``."""
    return k > 0 and blocked(logits, k)


def host_topk(logits: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """``topk_logprobs`` of CPU logits with more than k blocks a row, as
    arrays."""
    blocks = compiled()
    rows, vocab = logits.shape
    ids = np.empty((rows, k), dtype=np.int64)
    lps = np.empty((rows, k), dtype=np.float32)
    if rows < PARALLEL_ROWS or torch.get_num_threads() < PARALLEL_THREADS:
        compiled_rows(blocks, logits, k, ids, lps)
    else:
        threads_rows(blocks, logits, k, ids, lps)
    return lps, ids


def compiled_rows(blocks, logits: torch.Tensor, k: int, ids: np.ndarray,
                  lps: np.ndarray) -> None:
    """One thread's work: every row in the compiled loop, top-k and
    normaliser; half-precision rows converted a chunk at a time first."""
    rows, vocab = logits.shape
    if logits.dtype == torch.float32:
        x = logits if logits.is_contiguous() else logits.contiguous()
        blocks.topk_logprobs_rows(x.numpy(), k, ids, lps)
        return
    per = max(CHUNK_BYTES // (4 * vocab), 1)
    for start in range(0, rows, per):
        stop = min(start + per, rows)
        chunk, chunk_np = chunk_buffer(stop - start, vocab)
        chunk.copy_(logits if stop - start == rows else logits[start:stop])
        blocks.topk_logprobs_rows(chunk_np, k, ids[start:stop], lps[start:stop])


def threads_rows(blocks, logits: torch.Tensor, k: int, ids: np.ndarray,
                 lps: np.ndarray) -> None:
    """Many rows on several threads: torch's block maxima and
    ``log_softmax`` share them out, a chunk of rows (at least one a
    thread) at a time; the compiled loop takes the top-k of the best blocks
    and gathers."""
    rows, vocab = logits.shape
    per = max(CHUNK_BYTES // (4 * vocab), torch.get_num_threads(), 1)
    half = logits.dtype != torch.float32
    for start in range(0, rows, per):
        stop = min(start + per, rows)
        chunk, chunk_np = chunk_buffer(stop - start, vocab)
        x = logits if stop - start == rows else logits[start:stop]
        out_ids, out_lps = ids[start:stop], lps[start:stop]
        if half:
            # The same values in float32, converted into the buffer, where
            # log_softmax then runs in place (CPU's kernel reads each row
            # whole before writing it) once the ids are taken.
            chunk.copy_(x)
            blocks.topk_rows(chunk_np, block_maxima(chunk), k, out_ids)
            torch.log_softmax(chunk, -1, out=chunk)
            blocks.gather_rows(chunk_np, out_ids, out_lps)
            continue
        if not x.is_contiguous():
            x = x.contiguous()
        torch.log_softmax(x, -1, out=chunk)
        blocks.topk_rows_gathered(x.numpy(), block_maxima(x), chunk_np, k,
                                  out_ids, out_lps)


def compiled():
    """``topk_blocks``, imported at the first call (importing numba where no
    engine of ours runs would trip vLLM's CPU build: patch
    cpu.kernel_scan_vars) and kept: an import statement is Python code of
    its own, run again each call."""
    global _blocks
    if _blocks is None:
        from vllm_plugins import topk_blocks

        _blocks = topk_blocks
    return _blocks


def block_maxima(x: torch.Tensor) -> np.ndarray:
    """Torch's block maxima, which its threads share out."""
    rows, vocab = x.shape
    blocks = vocab // BLOCK
    return x[:, :blocks * BLOCK].view(rows, blocks, BLOCK).amax(2).numpy()


def chunk_buffer(rows: int, vocab: int) -> tuple[torch.Tensor, np.ndarray]:
    """A [rows, vocab] float32 view of this thread's kept buffer, as a
    tensor and as an array; grown when a call needs more. A shape seen
    before costs no torch call."""
    kept = getattr(_kept, "buffer", None)
    views = getattr(_kept, "views", None)
    if views is not None and views[0] is kept:
        view = views[1].get((rows, vocab))
        if view is not None:
            return view
    if kept is None or kept.numel() < rows * vocab:
        # A normal tensor, even when allocated in an engine step: one made
        # under inference mode could not be written outside it (a process
        # that also calls this outside an engine: tests, benchmarks).
        with torch.inference_mode(False):
            kept = _kept.buffer = torch.empty(rows * vocab, dtype=torch.float32)
    if views is None or views[0] is not kept:
        views = _kept.views = (kept, {})
    with torch.inference_mode(False):
        tensor = kept[:rows * vocab].view(rows, vocab)
    view = views[1][rows, vocab] = (tensor, tensor.numpy())
    return view
