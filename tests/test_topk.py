"""The bridge's blocked top-k gives torch.topk's values and ids, and
logsumexp's normaliser, on every shape the engine hands it."""

import pytest
import torch

from vllm_plugins.topk import BLOCK, topk_logprobs


def reference(logits, k):
    vals, ids = torch.topk(logits.float(), k, dim=-1)
    return vals - torch.logsumexp(logits.float(), -1, keepdim=True), ids


@pytest.mark.parametrize("rows,vocab,k", [
    (1, 49152, 8),        # SmolLM2's vocabulary, one row
    (37, 49152, 8),       # a batch of verified rows
    (5, 32000 + 37, 8),   # a partial last block
    (3, 49152, 64),       # STAND's largest top-k
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
