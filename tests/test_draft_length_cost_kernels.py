"""The step-time model's compiled refit against the numpy it replaced
(written out here as the reference, its non-negative fit
``nnls_by_subsets``): same columns, same outliers, the same
coefficients, spread and slope error up to the last bits of a solve; and
where a column subset is exactly singular, the same fitted values."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length import step_cost_kernels as kernels
from vllm_plugins.proposers.draft_length.step_cost import StepCostModel
from vllm_plugins.proposers.draft_length.step_cost_kernels import independent as _independent

from tests.test_draft_length_cost import nnls_by_subsets

TERMS = ("verify_step_s", "new_shape_s", "tree_step_s")


def reference_refit(m: StepCostModel):
    """The numpy refit over ``m``'s window: (a, b, c, d), the step terms,
    outliers, rmse, slope standard error, the rows fitted, and whether
    their columns were linearly dependent; None where the token count has
    not varied."""
    n = m._len
    tok, bat, y = m._x[:n, 0], m._x[:n, 1], m._y[:n]
    if np.ptp(tok) <= 0:
        return None
    cols, names = [np.ones(n), tok], ["a", "b"]
    if m.use_batch and _independent(tok, bat):
        cols.append(bat)
        names.append("c")
    if m.use_context and _independent(tok, m._x[:n, 5]) \
            and ("c" not in names or _independent(bat, m._x[:n, 5])):
        cols.append(m._x[:n, 5])
        names.append("d")
    y = y.copy()
    terms = {t: getattr(m, t) for t in TERMS}
    for col, name, used in ((2, TERMS[0], m.use_verify_step), (3, TERMS[1], m.use_shape),
                            (4, TERMS[2], m.use_tree_step)):
        marked = m._x[:n, col]
        ones = int(marked.sum())
        if used and min(ones, n - ones) >= m._MIN_MODE_STEPS and _independent(tok, marked):
            cols.append(marked)
            names.append(name)
        else:
            y -= marked * terms[name]
    x = np.stack(cols, 1)
    coef = nnls_by_subsets(x, y)
    resid = y - x @ coef
    mad = np.median(np.abs(resid - np.median(resid)))
    keep = np.abs(resid) <= 5.0 * 1.4826 * mad + 1e-12 * max(float(y.mean()), 1e-12)
    outliers = int(n - keep.sum())
    if 0 < outliers and keep.sum() >= max(3, x.shape[1] + 1):
        coef = nnls_by_subsets(x[keep], y[keep])
        resid = y[keep] - x[keep] @ coef
    rmse = float(np.sqrt(np.mean(resid ** 2)))
    rows = keep if 0 < outliers and keep.sum() >= x.shape[1] + 1 else np.ones(n, bool)
    xk = x[rows]
    dof = max(len(xk) - xk.shape[1], 1)
    try:
        cov = np.linalg.inv(xk.T @ xk) * float(np.sum(resid ** 2)) / dof
        slope_se = float(np.sqrt(max(cov[1, 1], 0.0)))
    except np.linalg.LinAlgError:
        slope_se = float("inf")
    got = dict(zip(names, (float(v) for v in coef)))
    terms.update({t: got[t] for t in TERMS if t in got})
    return ((got["a"], got["b"], got.get("c", 0.0), got.get("d", 0.0)),
            tuple(terms[t] for t in TERMS), outliers, rmse, slope_se, rows,
            bool(np.linalg.matrix_rank(xk) < xk.shape[1]))


def window_seconds(m: StepCostModel, line, terms) -> np.ndarray:
    """The seconds a model (line: a, b, c, d; the step terms) gives each
    step of ``m``'s window."""
    w = m._x[:m._len]
    a, b, c, d = line
    return (a + b * w[:, 0] + c * w[:, 1] + d * w[:, 5] + terms[0] * w[:, 2]
            + terms[1] * w[:, 3] + terms[2] * w[:, 4])


def _window(rng, features, batch_varies):
    m = StepCostModel(cost_features=features, cost_window=int(rng.choice([32, 256])),
                      warmup=8)
    a, b, c, d = 0.02, rng.uniform(0.0, 0.002), rng.uniform(0.0, 0.001), 4e-5
    verify, shape, tree = rng.uniform(-0.001, 0.004, 3)
    p_verify, p_shape, p_tree = rng.uniform(0.0, 1.0, 3) ** 2
    for i in range(int(rng.integers(8, 400))):
        batch = int(rng.integers(1, 17)) if batch_varies else 1
        drafts = int(rng.integers(0, 7)) * batch * (rng.random() < p_verify)
        tokens = batch + drafts
        context = float(rng.integers(100, 1500) * batch)
        new, tr = rng.random() < p_shape, drafts > 0 and rng.random() < p_tree
        t = (a + b * tokens + c * batch + d * context + verify * (drafts > 0) + shape * new
             + tree * tr) * (1 + 0.02 * rng.normal())
        if rng.random() < 0.03:
            t *= 5.0                                    # a stall
        m.observe(tokens, batch, t, drafts > 0, new, tr, context)
        if rng.random() < 0.3:                          # refits along the way
            m.warm
    return m


@pytest.mark.parametrize("features", ["tokens", "tokens+batch", "tokens+batch+context"])
def test_compiled_refit_matches_the_numpy_reference(features):
    """Where the columns fitted are linearly dependent the coefficients
    are not unique: there the seconds of the rows fitted are compared."""
    rng = np.random.default_rng(len(features))
    fitted = 0
    for trial in range(150):
        m = _window(rng, features, batch_varies=trial % 3 != 0)
        m._dirty, m._warm = True, False   # refit now, from the terms as they stand
        want = reference_refit(m)
        m._refit()
        if want is None:
            continue
        fitted += 1
        line, terms, outliers, rmse, slope_se, rows, dependent = want
        co = m.coefficients()
        got = (co["intercept_s"], co["per_token_s"], co["per_request_s"],
               co.get("per_context_token_s", 0.0))
        got_terms = [getattr(m, t) for t in TERMS]
        np.testing.assert_allclose(window_seconds(m, got, got_terms)[rows],
                                   window_seconds(m, line, terms)[rows], rtol=1e-7,
                                   atol=1e-12)
        if not dependent:
            np.testing.assert_allclose(got, line, rtol=1e-7, atol=1e-13)
            np.testing.assert_allclose(got_terms, terms, rtol=1e-7, atol=1e-13)
        assert m._outliers == outliers
        assert m._rmse == pytest.approx(rmse, rel=1e-7, abs=1e-15)
        assert m.slope_se == pytest.approx(slope_se, rel=1e-5, abs=1e-15)
    assert fitted > 100


def test_singular_subsets_are_passed_over_with_the_optimum_kept():
    """Every step either verifies or runs a new token count: the two flags
    sum to the intercept's column, so the subset of all three is exactly
    singular. The compiled refit passes it over and still fits (status 1),
    with numpy's fitted values and residual spread."""
    m = StepCostModel(cost_features="tokens", warmup=8)
    for i in range(64):
        tokens = 1 + i % 7 if i % 3 else 1
        m.observe(tokens, 1, 0.02 + 0.001 * tokens + 0.003 * (tokens > 1), tokens > 1,
                  tokens == 1)
    used, last = np.ones(3, np.bool_), np.zeros(3)
    x, y, codes = kernels.design(m._x, m._y, m._len, False, False, used, last, 4.0)
    assert list(codes) == [kernels.INTERCEPT, kernels.TOKENS, kernels.VERIFY,
                           kernels.NEW_SHAPE]
    assert np.linalg.matrix_rank(x) == 3
    status, _, _, rmse, _ = kernels.refit(m._x, m._y, m._len, False, False, used, last, 4.0,
                                          np.zeros(7))
    assert status == 1
    want = nnls_by_subsets(x, y)
    np.testing.assert_allclose(x @ kernels.nnls(x, y), x @ want, rtol=1e-9, atol=1e-12)
    assert rmse == pytest.approx(float(np.sqrt(np.mean((y - x @ want) ** 2))), abs=1e-12)


@pytest.mark.parametrize("dependent", ["zero", "copy", "flags"])
def test_dependent_columns_keep_the_nonnegative_optimum(dependent):
    """A window whose screen dropped every step of a flag (a zero column),
    two flags that coincide, or flags that sum to the intercept: the
    compiled fit's fitted values are the non-negative optimum's, which is
    unique even where its coefficients are not."""
    rng = np.random.default_rng(len(dependent))
    for _ in range(100):
        n = int(rng.integers(16, 200))
        tok = rng.integers(1, 9, n).astype(float)
        flag = (rng.random(n) < 0.5).astype(float)
        other = {"zero": np.zeros(n), "copy": flag, "flags": 1.0 - flag}[dependent]
        # The dependent column second, so most subsets after it hold it.
        x = np.column_stack([np.ones(n), other, tok, flag])
        y = x[:, [0, 2, 3]] @ rng.uniform(-0.002, 0.02, 3) + 1e-4 * rng.normal(size=n)
        got, want = kernels.nnls(x, y), nnls_by_subsets(x, y)
        assert (got >= 0).all()
        np.testing.assert_allclose(x @ got, x @ want, rtol=1e-7, atol=1e-10)


def reference_count_costs(m: StepCostModel) -> np.ndarray:
    """Each token count's shrunk mean residual from ``m``'s model as it now
    charges steps, in numpy."""
    n = m._len
    x, y = m._x[:n], m._y[:n]
    a, b, c, d = m._coef
    tree = m.tree_token_s if m.tree_per_token else m.tree_step_s
    resid = y - (a + b * x[:, 0] + c * x[:, 1] + d * x[:, 5] + m.verify_step_s * x[:, 2]
                 + m.new_shape_s * x[:, 3] + tree * x[:, 4])
    mad = np.median(np.abs(resid - np.median(resid)))
    keep = np.abs(resid) <= 5.0 * 1.4826 * mad + 1e-12 * max(float(y.mean()), 1e-12)
    tok = x[:, 0].astype(np.int64)
    sums = np.bincount(tok[keep], resid[keep], minlength=tok.max() + 1)
    rows = np.bincount(tok[keep], minlength=tok.max() + 1)
    return sums / (rows + m.count_prior)


@pytest.mark.parametrize("features", ["tokens", "tokens+batch+context"])
def test_count_costs_match_the_numpy_reference(features):
    """The per-count corrections a refit keeps: each count's mean residual
    from the fitted model, stalls left out, shrunk by the prior rows."""
    rng = np.random.default_rng(7 + len(features))
    fitted = 0
    for trial in range(60):
        m = _window(rng, features, batch_varies=trial % 2 == 0)
        m._dirty, m._warm = True, False
        m._refit()
        if not m._warm:
            continue
        fitted += 1
        np.testing.assert_allclose(m.by_count, reference_count_costs(m), rtol=1e-9, atol=1e-12)
    assert fitted > 30
    m.count_prior = 0.0   # off: the refit keeps none
    m.by_count = np.zeros(0)
    m._dirty = True
    m._refit()
    assert len(m.by_count) == 0
