"""The bridge's blocked top-k gives torch.topk's values and ids, and
logsumexp's normaliser, on every shape the engine hands it."""

import numpy as np
import pytest
import torch

from vllm_plugins.topk import BLOCK, CHUNK_BYTES, topk_logprobs


def reference(logits, k):
    vals, ids = torch.topk(logits.float(), k, dim=-1)
    return vals - torch.logsumexp(logits.float(), -1, keepdim=True), ids


@pytest.mark.parametrize("rows,vocab,k", [
    (1, 49152, 8),        # SmolLM2's vocabulary, one row
    (37, 49152, 8),       # a batch of verified rows
    (5, 32000 + 37, 8),   # a partial last block
    (3, 49152, 64),       # STAND's largest top-k
    (9, 262144, 8),       # a 262k vocabulary: rows in several chunks
    (4, BLOCK * 9 + 5, 8),  # barely more blocks than k: the tail matters
    (2, 100, 8),          # fewer blocks than k: plain torch.topk
    (0, 49152, 8),        # no rows
])
def test_same_as_torch_topk(rows, vocab, k):
    g = torch.Generator().manual_seed(rows * 7919 + vocab + k)
    logits = torch.randn(rows, vocab, generator=g) * 4
    if rows and vocab > 64:
        # Peaked rows, as real logits are; one row's maximum in the tail.
        logits[0, 11] += 30
        logits[-1, vocab - 1] += 25
    lp, ids = topk_logprobs(logits, k)
    ref_lp, ref_ids = reference(logits, k)
    assert ids.dtype == ref_ids.dtype and ids.shape == ref_ids.shape == (rows, k)
    assert torch.equal(ids, ref_ids)
    # The normaliser sums 49152 float32 terms in another order than
    # logsumexp (and vector width differs by CPU): about 1e-5 of its size.
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-4)


def test_masked_logits_and_ties():
    """Logits set to -inf (a grammar or bad-words mask) are never picked
    while finite ones remain; tied logits give the tied value k times."""
    vocab = 49152
    logits = torch.full((2, vocab), float("-inf"))
    allowed = torch.tensor([5, 700, 9000, 49151])
    logits[0, allowed] = torch.tensor([1.0, 3.0, 2.0, 0.5])
    logits[1] = 0.25  # every logit tied
    lp, ids = topk_logprobs(logits, 8)
    ref_lp, _ = reference(logits, 8)
    assert ids[0, :4].tolist() == [700, 9000, 5, 49151]
    torch.testing.assert_close(lp[0, :4], ref_lp[0, :4])
    assert torch.isneginf(lp[0, 4:]).all()
    torch.testing.assert_close(lp[1], ref_lp[1])
    assert len(set(ids[1].tolist())) == 8


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(dtype):
    """Half-precision logits (a bf16 or fp16 target) give the top-k and the
    log-probabilities of their float32 values."""
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(6, 262144, generator=g) * 4).to(dtype)
    lp, ids = topk_logprobs(logits, 8)
    ref_lp, ref_ids = reference(logits.float(), 8)
    assert lp.dtype == torch.float32
    # Half precision ties often: compare the values at the ids.
    torch.testing.assert_close(logits.float().gather(1, ids),
                               logits.float().gather(1, ref_ids), rtol=0, atol=0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_buffer_the_size_of_the_logits(dtype):
    """At a 262k vocabulary the call's largest allocation is a chunk of
    rows, not a [rows, vocab] float32 tensor (writing and faulting one in
    cost as much as the arithmetic), whatever the number of threads (on
    one, float32 rows need none); the next call allocates no row at all
    (the chunk buffer is kept)."""
    from torch.profiler import ProfilerActivity, profile

    from vllm_plugins import topk

    def largest_allocation():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            lp, ids = topk_logprobs(logits, 8)
        values = logits.float().gather(1, ids)  # ids of ties may differ
        assert torch.equal(values, logits.float().gather(1, reference(logits.float(), 8)[1]))
        return max([0] + [e.cpu_memory_usage for e in prof.events()])

    rows, vocab = 24, 262144
    logits = torch.randn(rows, vocab).to(dtype)
    threads = torch.get_num_threads()
    try:
        for n in (1, 4):
            torch.set_num_threads(n)
            topk._kept.buffer = None
            assert largest_allocation() <= max(CHUNK_BYTES, n * vocab * 4) \
                < rows * vocab * 4
            assert largest_allocation() < vocab * 4
    finally:
        torch.set_num_threads(threads)


def test_the_kept_buffer_serves_calls_inside_and_outside_inference_mode():
    """An engine step (inference mode) may grow the kept buffer first; a
    later call outside inference mode in the same thread must still write
    it."""
    from vllm_plugins import topk

    topk._kept.buffer = None
    logits = torch.randn(3, 50_000, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        inside = topk.topk_logprobs(logits, 4)
    outside = topk.topk_logprobs(logits, 4)
    for a, b in zip(inside, outside):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def stable_reference(logits, k):
    """torch's values: ids by a stable descending sort (tied logits, the
    lower id first), log-probabilities from ``log_softmax``."""
    x = logits.float()
    ids = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.log_softmax(x, -1).gather(1, ids), ids


@pytest.mark.parametrize("torch_from", [1, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 13])
def test_small_batches_as_torch(rows, dtype, torch_from, monkeypatch):
    """The few rows of a small batch (the compiled loop's all, or torch's
    block maxima and ``log_softmax`` from ``PARALLEL_ROWS`` rows on
    ``PARALLEL_THREADS`` threads) give the ids of a stable sort (among tied
    logits, the lower first) and ``log_softmax``'s values: its very bits
    where it ran, else within 2e-6 of float64's (torch's float32
    ``log_softmax`` itself is 1e-5 away on some hosts). ``torch_from``:
    the thread count from which torch's path serves (1: whatever this
    process runs on; a vLLM CPU worker fixes torch's thread count)."""
    from vllm_plugins import topk

    if torch_from is not None:
        monkeypatch.setattr(topk, "PARALLEL_THREADS", torch_from)
    g = torch.Generator().manual_seed(rows * 31 + (torch_from or 0))
    logits = torch.randn(rows, 49152 + 37, generator=g) * 4
    logits[0] = torch.round(logits[0])          # a row of many exact ties
    logits[-1, ::2] = float("-inf")             # a masked row
    logits[-1, 49152 + 30] = 40.0               # its maximum in the tail
    logits = logits.to(dtype)
    torch_ran = rows >= topk.PARALLEL_ROWS and torch.get_num_threads() >= topk.PARALLEL_THREADS
    for k in (1, 8, 64):
        lp, ids = topk.topk_logprobs(logits, k)
        ref_lp, ref_ids = stable_reference(logits, k)
        assert torch.equal(ids, ref_ids)
        if torch_ran:
            assert torch.equal(lp, ref_lp)
        else:
            exact = torch.log_softmax(logits.double(), -1).gather(1, ids)
            torch.testing.assert_close(lp.double(), exact, rtol=0, atol=2e-6)


def test_the_compiled_normaliser_is_logsumexps():
    """The compiled loop's normaliser (a polynomial ``exp``, vectorised)
    against float64 ``logsumexp``: within float32's summation error, over
    rows whose maxima stand far out or among many near it, scaled logits,
    and masked ones; a row with a NaN, an infinite logit or nothing
    finite gives NaN, as ``log_softmax`` does."""
    from vllm_plugins import topk_blocks

    g = torch.Generator().manual_seed(11)
    vocab = 49152 + 37
    logits = torch.randn(8, vocab, generator=g) * torch.tensor(
        [0.01, 1.0, 4.0, 12.0, 30.0, 4.0, 4.0, 4.0])[:, None]
    logits[1, 3] += 80.0                      # one logit far above the rest
    logits[2, ::3] = float("-inf")            # masked
    logits[5, 9] = float("nan")
    logits[6, 100] = float("inf")
    logits[7] = float("-inf")
    ids = np.empty((8, 8), np.int64)
    lps = np.empty((8, 8), np.float32)
    topk_blocks.topk_logprobs_rows(logits.numpy(), 8, ids, lps)
    x = logits.double()
    want = x.gather(1, torch.from_numpy(ids)) - torch.logsumexp(x, -1, keepdim=True)
    # atol: the normaliser's float32 sum; rtol: a float32 result's rounding.
    torch.testing.assert_close(torch.from_numpy(lps[:5]).double(), want[:5], rtol=2e-7,
                               atol=2e-6)
    assert np.isnan(lps[5:]).all()


def test_host_arrays_are_the_tensors_values_and_their_own():
    """``topk_logprobs_numpy`` gives the tensors' values as fresh arrays:
    a later call, with other rows through the kept buffer's views, leaves
    an earlier call's arrays as they were."""
    from vllm_plugins.topk import topk_logprobs_numpy

    g = torch.Generator().manual_seed(3)
    kept = []
    for rows in (3, 1, 5, 3, 2):
        logits = torch.randn(rows, 49152, generator=g) * 4
        lp, ids = topk_logprobs_numpy(logits, 8)
        want_lp, want_ids = topk_logprobs(logits, 8)
        assert isinstance(lp, np.ndarray) and isinstance(ids, np.ndarray)
        assert lp.dtype == np.float32 and ids.dtype == np.int64
        assert np.array_equal(ids, want_ids.numpy()) and np.array_equal(lp, want_lp.numpy())
        kept.append((lp, lp.copy(), ids, ids.copy()))
    for lp, lp_then, ids, ids_then in kept:
        assert np.array_equal(lp, lp_then) and np.array_equal(ids, ids_then)


def test_strided_logits():
    """Logits that are a view with a row stride wider than the vocabulary
    (a slice of a padded tensor) give what their contiguous copy gives."""
    g = torch.Generator().manual_seed(4)
    padded = torch.randn(4, 49152 + 128, generator=g) * 4
    logits = padded[:, :49152]
    for got, want in zip(topk_logprobs(logits, 8), topk_logprobs(logits.contiguous(), 8)):
        assert torch.equal(got, want)


def test_the_block_is_the_compiled_loops():
    """``topk`` names the block without loading numba; it must be the one
    the compiled loops are written for."""
    from vllm_plugins import topk_blocks

    assert BLOCK == topk_blocks.BLOCK
