"""The goodput rule's step-time model and its allocation, alone."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length import goodput_allocation
from vllm_plugins.proposers.draft_length.step_cost import RecentSizes, StepCostModel
from vllm_plugins.proposers.draft_length.step_cost_kernels import nnls


def test_cost_model_recovers_a_linear_curve():
    rng = np.random.default_rng(0)
    m = StepCostModel(cost_features="tokens", warmup=16)
    assert not m.warm
    for _ in range(300):
        tok = int(rng.integers(1, 400))
        m.observe(tok, 8, (0.02 + 0.001 * tok) * (1 + 0.03 * rng.normal()))
    co = m.coefficients()
    assert co["warm"]
    assert abs(co["intercept_s"] - 0.02) < 0.004, co
    assert abs(co["per_token_s"] - 0.001) / 0.001 < 0.05, co


def test_cost_model_with_batch_term_outliers_and_nonnegativity():
    rng = np.random.default_rng(1)
    m = StepCostModel(cost_features="tokens+batch", cost_window=256)
    for i in range(400):
        batch = int(rng.integers(1, 64))
        tok = batch * int(rng.integers(1, 8))
        t = 0.01 + 0.0005 * tok + 0.002 * batch
        if i % 37 == 0:
            t *= 10                                     # a stall
        m.observe(tok, batch, t * (1 + 0.02 * rng.normal()))
    co = m.coefficients()
    assert abs(co["per_token_s"] - 0.0005) / 0.0005 < 0.1, co
    assert abs(co["per_request_s"] - 0.002) / 0.002 < 0.15, co
    assert abs(co["intercept_s"] - 0.01) < 0.004, co
    assert co["outliers_dropped"] > 0
    flat = StepCostModel(cost_features="tokens")
    for i in range(100):
        tok = int(rng.integers(1, 400))
        flat.observe(tok, 1, 0.03 - 1e-6 * tok + 0.001 * rng.normal())  # falls slightly
    co = flat.coefficients()
    assert co["per_token_s"] >= 0 and co["intercept_s"] > 0.02, co


def nnls_by_subsets(x, y):
    """Reference: the plain least-squares fit of every column subset, the
    best one whose coefficients are all non-negative."""
    best, best_sse = np.zeros(x.shape[1]), float(y @ y)
    for mask in range(1, 2 ** x.shape[1]):
        idx = [i for i in range(x.shape[1]) if mask >> i & 1]
        c = np.linalg.lstsq(x[:, idx], y, rcond=None)[0]
        sse = float(np.sum((y - x[:, idx] @ c) ** 2))
        if (c >= 0).all() and sse < best_sse:
            best_sse, best = sse, np.zeros(x.shape[1])
            best[idx] = c
    return best


def test_cost_model_nonnegative_fit_is_the_best_nonnegative_subset_fit():
    rng = np.random.default_rng(3)
    clipped = 0
    for _ in range(300):
        n, p = 256, int(rng.integers(2, 6))
        x = np.column_stack([np.ones(n)] + [rng.random(n) * rng.integers(1, 100)
                                            for _ in range(p - 1)])
        y = x @ rng.normal(size=p) * 0.01 + 0.01 * rng.normal(size=n)
        got, want = nnls(x, y), nnls_by_subsets(x, y)
        assert (got >= 0).all()
        np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-12)
        clipped += int((want == 0).any())
    assert clipped > 50   # the constraint was active in many of them


def test_cost_model_fits_the_cost_of_a_verifying_step():
    """A step that verifies drafts costs d more than the token line says
    (vLLM's rejection sampler runs only then). The fit recovers d, and leaves
    it at 0 until both kinds of step were seen."""
    rng = np.random.default_rng(2)
    m = StepCostModel(cost_features="tokens+batch")
    for _ in range(16):
        tok = int(rng.integers(17, 112))
        m.observe(tok, 16, 0.074 + 0.001 * tok + 0.006, True)
    assert m.warm and m.verify_step_s == 0.0          # only verifying steps so far
    for _ in range(300):
        ver = bool(rng.random() < 0.6)
        tok = 16 + (16 * int(rng.integers(1, 7)) if ver else 0)
        m.observe(tok, 16, (0.074 + 0.001 * tok + 0.006 * ver) * (1 + 0.01 * rng.normal()),
                  ver)
    co = m.coefficients()
    assert abs(co["verify_step_s"] - 0.006) < 0.0015, co
    assert abs(co["per_token_s"] - 0.001) / 0.001 < 0.05, co
    off = StepCostModel(verify_step_cost=False)
    for _ in range(64):
        ver = bool(rng.random() < 0.6)
        tok = 16 + (16 * int(rng.integers(1, 7)) if ver else 0)
        off.observe(tok, 16, 0.074 + 0.001 * tok + 0.006 * ver, ver)
    assert off.coefficients()["verify_step_s"] == 0.0


def test_context_term_keeps_long_prompts_out_of_the_slope():
    """Batch 1: prompts of 100 to 1,500 tokens; the long ones copy and draft
    more. Each committed token costs 0.04 ms, a verified one 7 ms, a
    verifying step 3 ms more. Without the context term the slope takes up
    the long prompts' dearer steps; with it the slope and the step terms are
    the curve's, and the line answers for the context being decided."""
    rng = np.random.default_rng(3)
    models = {f: StepCostModel(cost_features=f, cost_window=512)
              for f in ("tokens+batch", "tokens+batch+context")}
    for _ in range(600):
        context = float(rng.integers(100, 1500))
        drafts = int(rng.binomial(6, context / 1500))
        tokens = 1 + drafts
        t = 0.090 + 0.00004 * context + 0.007 * tokens + (0.003 if drafts else 0.0)
        for m in models.values():
            m.observe(tokens, 1, t * (1 + 0.01 * rng.normal()), drafts > 0, context=context)
    plain, with_context = (models[f].coefficients() for f in models)
    assert "per_context_token_s" not in plain
    assert abs(with_context["per_token_s"] - 0.007) < 0.0007, with_context
    assert abs(with_context["per_context_token_s"] - 0.00004) < 0.000005, with_context
    assert abs(with_context["verify_step_s"] - 0.003) < 0.0015, with_context
    assert plain["per_token_s"] > 0.009, plain          # the long prompts' cost, as slope
    m = models["tokens+batch+context"]
    m.context_now = 1000.0
    a, b = m.line(1)
    assert abs(a + b - (0.090 + 0.04 + 0.007)) < 0.003


def test_recent_sizes_is_an_lru_of_token_counts():
    r = RecentSizes(3)
    assert [r.touch(n) for n in (16, 32, 16, 48, 64)] == [True, True, False, True, True]
    assert sorted(r.array().tolist()) == [16, 48, 64]   # 32 was least recent
    assert r.touch(32) and not r.touch(64)
    assert RecentSizes(0).touch(5) is False and RecentSizes(0).array() is None


def test_cost_model_prior_before_data():
    m = StepCostModel(prior_token_cost=0.001)
    assert m.line(8) == (1.0, 0.001)
    for _ in range(50):
        m.observe(100, 4, 0.05)                        # one token count: no slope
    assert not m.warm


def test_goodput_allocation_is_the_exhaustive_optimum():
    rng = np.random.default_rng(5)
    for trial in range(100):
        p = rng.uniform(0.05, 0.99, size=(3, 4))
        q = np.cumprod(p, axis=1)
        a, b = rng.uniform(0.5, 2.0), rng.uniform(0.0, 0.5)
        d = 0.0 if trial % 2 else rng.uniform(0.0, 1.0)   # verify-step cost
        # A correction per token count, over part of them (none: the line).
        by_count = None if trial % 3 == 0 else rng.uniform(-0.3, 0.6, int(rng.integers(0, 17)))

        def goodput(ks):
            n = 3 + sum(ks)
            t = a + b * n + (d if any(ks) else 0.0)
            if by_count is not None and n < len(by_count):
                t += by_count[n]
            return (3 + sum(q[i, :k].sum() for i, k in enumerate(ks))) / t

        keep, g, _ = goodput_allocation(q, np.ones_like(q, bool), a, b, d, by_count=by_count)
        assert g == pytest.approx(max(goodput(ks) for ks in np.ndindex(5, 5, 5)))
        assert g == pytest.approx(goodput(tuple(keep)))
