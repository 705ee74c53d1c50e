"""The draws behind ``"sampling": "awrs"`` (``logits_processors.awrs_draw``).

The greedy index must be vLLM's own (its CPU ``greedy_argmax``), ties and
NaN included; an unseeded row's inverse-CDF draws must follow
softmax(row / T), before and after tokens are taken out (chi-square, with
a control at the wrong temperature that must fail).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.test_stand import chi2_pvalue

pytest.importorskip("vllm")

from vllm_plugins.logits_processors.awrs_draw import (  # noqa: E402
    BLOCK, argmax_rows, race, row_weights)


def test_greedy_index_is_vllms_with_ties_and_nan():
    import vllm._custom_ops  # noqa: F401 - registers torch.ops._C
    from vllm.v1.sample.sampler import Sampler

    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 0.0], [nan, 1.0, 2.0, nan], [-inf] * 4,
                         [2.0, 2.0, 2.0, 2.0], [1.0, nan, 5.0, 5.0], [inf, 1.0, inf, 0.0]])
    rows = torch.cat([rows, torch.randn(4, 4)])
    want = Sampler.greedy_sample(rows.clone()).tolist()
    assert argmax_rows(rows, list(range(len(rows)))) == want
    assert argmax_rows(rows, [3, 1, 7]) == [want[3], want[1], want[7]]
    assert [race(r, None) for r in rows] == want


@pytest.mark.parametrize("width", [3 * BLOCK, 3 * BLOCK + 37])
def test_inverse_cdf_draws_follow_the_softmax(width):
    """Two rows at T = 0.7 and 1.3 drawn in one call; one row also with its
    top token taken out (the draw must renormalise over the rest)."""
    g = torch.Generator().manual_seed(width)
    logits = torch.randn(2, width, generator=g) * 2.0
    logits[:, 5] = -float("inf")  # a banned entry is never drawn
    temps = [0.7, 1.3]
    n = 4000
    counts = [Counter(), Counter(), Counter()]
    top = int(logits[0].argmax())
    # The draws read torch's global generator: seeded here (and put back
    # after), so the test's outcome does not depend on the tests before it.
    with torch.random.fork_rng():
        torch.manual_seed(width)
        for _ in range(n):
            draws = row_weights(logits, [0, 1], temps)
            counts[0][draws[0].draw()] += 1
            counts[1][draws[1].draw()] += 1
            draws[0].remove(top)
            counts[2][draws[0].draw()] += 1
    for i, (row, t) in enumerate([(0, 0.7), (1, 1.3), (0, 0.7)]):
        p = torch.softmax(logits[row].double() / t, 0)
        if i == 2:
            p[top] = 0.0
            p /= p.sum()
        obs = [counts[i][k] for k in range(width)]
        assert counts[i][5] == 0
        assert chi2_pvalue(obs, p.numpy()) > 1e-3, (i, width)
        q = torch.softmax(logits[row].double() / (t * 1.25), 0)  # biased control
        if i == 2:
            q[top] = 0.0
            q /= q.sum()
        qexp = q.numpy()
        assert chi2_pvalue(obs, qexp) < 1e-6, (i, width)


def test_the_compiled_search_lands_on_weight_only():
    """The search behind a draw: the first token whose running sum passes u,
    blocks without weight skipped, u past the end (rounding between block
    sums and weights) on the last token with weight, nothing left: -1."""
    import numpy as np

    from vllm_plugins.logits_processors.awrs_draw import warm_up

    search = warm_up()
    w = np.zeros(3 * BLOCK, dtype=np.float32)
    w[[3, BLOCK + 7, BLOCK + 9]] = [1.0, 2.0, 0.5]
    blocks = w.reshape(-1, BLOCK).sum(axis=1, dtype=np.float64)
    assert [search(w, blocks, u) for u in (0.0, 0.99, 1.0, 2.99, 3.0, 3.49)] == [
        3, 3, BLOCK + 7, BLOCK + 7, BLOCK + 9, BLOCK + 9]
    assert search(w, blocks, 3.5) == BLOCK + 9        # past the end
    assert search(w, blocks + [0.0, 0.1, 0.0], 3.55) == BLOCK + 9  # sums above the weights
    assert search(np.zeros_like(w), np.zeros(3), 0.0) == -1
