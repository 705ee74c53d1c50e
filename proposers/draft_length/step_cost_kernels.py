"""The step-time model's refit, compiled.

``StepCostModel`` refits every fourth observation over a window of a few
hundred steps and up to seven columns: the non-negative fit solves every
column subset. As numpy that was some sixty array calls a refit whose
dispatch, not arithmetic, was a third of the draft-length controller's
host time. These loops do the same sums; the subset solves are Gaussian
elimination with partial pivoting (numba has no LAPACK without SciPy), so
a coefficient may differ from LAPACK's in its last bits. A subset whose
matrix is exactly singular is passed over (``nnls`` says why that loses
nothing), so a window that turns singular (the screen dropped every step
of a flag, say, or two flags coincide) still refits in this one call: no
subset needs a least-squares solve of its own.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_plugins.proposers.jit import cached_njit

# Design columns, as ``design`` codes them: intercept, tokens, batch,
# context, then the step-level flags in the window's column order.
INTERCEPT, TOKENS, BATCH, CONTEXT, VERIFY, NEW_SHAPE, TREE = range(7)


@cached_njit
def independent(tok, other):
    """Whether ``other`` varies, and not in lockstep with ``tok`` (|Pearson
    correlation| under 0.98)."""
    n = len(tok)
    lo = hi = other[0]
    mean_t = mean_o = 0.0
    for i in range(n):
        lo = min(lo, other[i])
        hi = max(hi, other[i])
        mean_t += tok[i]
        mean_o += other[i]
    if not hi - lo > 0:
        return False
    mean_t /= n
    mean_o /= n
    stt = soo = sto = 0.0
    for i in range(n):
        dt = tok[i] - mean_t
        do = other[i] - mean_o
        stt += dt * dt
        soo += do * do
        sto += dt * do
    corr = sto / np.sqrt(stt * soo)
    return bool(np.isfinite(corr) and abs(corr) < 0.98)


@cached_njit
def design(window, seconds, n, use_batch, use_context, used, last, min_mode):
    """(design matrix, seconds less the step terms not fitted, column
    codes) over the window's first ``n`` rows; no columns while the token
    count has not varied. ``window`` columns: tokens, batch, verifies,
    new_shape, tree (1, or the step's tokens), context; ``used``/``last``:
    per step term (verifies, new_shape, tree) whether it may be fitted and
    its last estimate, which corrects the seconds of the few steps it is
    non-zero on while it is not."""
    tok = window[:n, 0]
    codes = np.empty(7, np.int64)
    lo = hi = tok[0]
    for i in range(n):
        lo = min(lo, tok[i])
        hi = max(hi, tok[i])
    if not hi - lo > 0:
        return np.empty((n, 0)), seconds[:n].copy(), codes[:0]
    codes[0], codes[1] = INTERCEPT, TOKENS
    p = 2
    with_batch = use_batch and independent(tok, window[:n, 1])
    if with_batch:
        codes[p] = BATCH
        p += 1
    if use_context and independent(tok, window[:n, 5]) and (
            not with_batch or independent(window[:n, 1], window[:n, 5])):
        codes[p] = CONTEXT
        p += 1
    y = seconds[:n].copy()
    for t in range(3):
        col = 2 + t
        ones = 0.0
        for i in range(n):
            ones += 1.0 if window[i, col] != 0.0 else 0.0
        if used[t] and min(ones, n - ones) >= min_mode and independent(tok, window[:n, col]):
            codes[p] = VERIFY + t
            p += 1
        else:
            for i in range(n):
                y[i] -= window[i, col] * last[t]
    x = np.empty((n, p))
    for k in range(p):
        c = codes[k]
        src = -1 if c == INTERCEPT else 0 if c == TOKENS else 1 if c == BATCH \
            else 5 if c == CONTEXT else c - VERIFY + 2
        for i in range(n):
            x[i, k] = 1.0 if src < 0 else window[i, src]
    return x, y, codes[:p]


@cached_njit
def _solve(a, b):
    """Solves a z = b in place (z in ``b``; ``a`` is overwritten) by
    Gaussian elimination with partial pivoting; False on an exactly zero
    pivot, where LAPACK reports a singular matrix."""
    q = len(b)
    for k in range(q):
        piv = k
        big = abs(a[k, k])
        for i in range(k + 1, q):
            if abs(a[i, k]) > big:
                big = abs(a[i, k])
                piv = i
        if a[piv, k] == 0.0:
            return False
        if piv != k:
            for j in range(q):
                a[k, j], a[piv, j] = a[piv, j], a[k, j]
            b[k], b[piv] = b[piv], b[k]
        for i in range(k + 1, q):
            f = a[i, k] / a[k, k]
            for j in range(k + 1, q):
                a[i, j] -= f * a[k, j]
            b[i] -= f * b[k]
    for k in range(q - 1, -1, -1):
        s = b[k]
        for j in range(k + 1, q):
            s -= a[k, j] * b[j]
        b[k] = s / a[k, k]
    return True


@cached_njit
def _normal(x, y, scale):
    """(X'X, X'y) of the columns divided by ``scale``."""
    n, p = x.shape
    g = np.zeros((p, p))
    h = np.zeros(p)
    for i in range(n):
        for k in range(p):
            xk = x[i, k] / scale[k]
            h[k] += xk * y[i]
            for m in range(k, p):
                g[k, m] += xk * (x[i, m] / scale[m])
    for k in range(p):
        for m in range(k):
            g[k, m] = g[m, k]
    return g, h


@cached_njit
def nnls(x, y):
    """Least squares with all coefficients >= 0, exact: the non-negative
    optimum is the plain fit on its own support, so the best of the plain
    fits on every column subset that come out non-negative is it. Every
    subset is solved on the p x p normal equations of max-scaled columns
    (the explained sum of squares is c.h); subsets in binary order, the
    first of equal gains kept. A subset whose columns are linearly
    dependent (an exactly zero pivot) is passed over: any non-negative fit
    on it is, by Caratheodory's theorem, a non-negative fit with the same
    fitted values on an independent subset of it, which comes earlier in
    binary order. So the fitted values are the optimum's; only which of
    several equal coefficient vectors is kept is a choice."""
    n, p = x.shape
    scale = np.empty(p)
    for k in range(p):
        big = 0.0
        for i in range(n):
            big = max(big, abs(x[i, k]))
        scale[k] = max(big, 1e-12)
    g, h = _normal(x, y, scale)
    best = np.zeros(p)
    best_gain = -np.inf
    idx = np.empty(p, np.int64)
    for mask in range(1, 1 << p):
        q = 0
        for k in range(p):
            if mask >> k & 1:
                idx[q] = k
                q += 1
        a = np.empty((q, q))
        b = np.empty(q)
        for r in range(q):
            b[r] = h[idx[r]]
            for s in range(q):
                a[r, s] = g[idx[r], idx[s]]
        if not _solve(a, b):
            continue
        feasible = True
        gain = 0.0
        for r in range(q):
            if not b[r] >= 0.0:
                feasible = False
            gain += b[r] * h[idx[r]]
        if feasible and gain > best_gain:
            best_gain = gain
            best[:] = 0.0
            for r in range(q):
                best[idx[r]] = b[r]
    if not best_gain > 0:
        return np.zeros(p)
    for k in range(p):
        best[k] /= scale[k]
    return best


@cached_njit
def _residuals(x, y, coef):
    n, p = x.shape
    out = np.empty(n)
    for i in range(n):
        s = 0.0
        for k in range(p):
            s += x[i, k] * coef[k]
        out[i] = y[i] - s
    return out


@cached_njit
def screen(x, y, coef):
    """(rows kept, rows dropped): a residual beyond 5 robust sigmas (MAD)
    is an outlier."""
    n = len(y)
    resid = _residuals(x, y, coef)
    med = np.median(resid)
    dev = np.empty(n)
    mean_y = 0.0
    for i in range(n):
        dev[i] = abs(resid[i] - med)
        mean_y += y[i]
    mad = np.median(dev)
    limit = 5.0 * 1.4826 * mad + 1e-12 * max(mean_y / n, 1e-12)
    keep = np.empty(n, np.bool_)
    dropped = 0
    for i in range(n):
        keep[i] = abs(resid[i]) <= limit
        if not keep[i]:
            dropped += 1
    return keep, dropped


@cached_njit
def spread(x, y, coef):
    """(root mean square residual, standard error of the tokens
    coefficient; inf where X'X is singular)."""
    n, p = x.shape
    resid = _residuals(x, y, coef)
    sse = 0.0
    for i in range(n):
        sse += resid[i] ** 2
    rmse = math.sqrt(sse / n)
    ones = np.ones(p)
    g, _ = _normal(x, y, ones)
    e = np.zeros(p)
    e[1] = 1.0
    if not _solve(g, e):
        return rmse, np.inf
    cov = e[1] * sse / max(n - p, 1)
    return rmse, math.sqrt(max(cov, 0.0))


@cached_njit
def refit(window, seconds, n, use_batch, use_context, used, last, min_mode, out):
    """The whole refit in one call: ``design``, ``nnls``, ``screen``, the
    fit again without the outliers where enough rows are left, ``spread``.
    ``out`` gets, per column code, the coefficient (0 where not fitted).
    Returns (status, fitted codes, rows dropped, rmse, slope standard
    error); status 0: the token count has not varied, 1: fitted."""
    x, y, codes = design(window, seconds, n, use_batch, use_context, used, last, min_mode)
    p = len(codes)
    if p == 0:
        return 0, codes, 0, np.nan, np.inf
    coef = nnls(x, y)
    keep, dropped = screen(x, y, coef)
    if 0 < dropped and n - dropped >= max(3, p + 1):
        x = x[keep]
        y = y[keep]
        coef = nnls(x, y)
    rmse, slope_se = spread(x, y, coef)
    out[:] = 0.0
    for k in range(p):
        out[codes[k]] = coef[k]
    return 1, codes, dropped, rmse, slope_se


@cached_njit
def count_costs(window, seconds, n, coef, prior_rows):
    """Each token count's mean residual from the fitted model, over the
    window's first ``n`` rows, shrunk toward 0 by ``prior_rows`` rows of
    prior weight: ``out[N]`` is added to the model's time of a step of N
    tokens (0 for a count the window does not hold). ``coef``: intercept,
    tokens, batch, context, then the step terms in the window's column order
    (verifies, new_shape, tree), each as the model now charges it. A row
    whose residual is beyond 5 robust sigmas (MAD) is left out, as ``screen``
    leaves stalls out of the fit."""
    if n == 0:
        return np.zeros(0)
    resid = np.empty(n)
    top = 0
    mean_y = 0.0
    for i in range(n):
        t = window[i, 0]
        pred = (coef[0] + coef[1] * t + coef[2] * window[i, 1] + coef[3] * window[i, 5]
                + coef[4] * window[i, 2] + coef[5] * window[i, 3] + coef[6] * window[i, 4])
        resid[i] = seconds[i] - pred
        top = max(top, int(t))
        mean_y += seconds[i]
    med = np.median(resid)
    limit = 5.0 * 1.4826 * np.median(np.abs(resid - med)) + 1e-12 * max(mean_y / n, 1e-12)
    sums = np.zeros(top + 1)
    rows = np.zeros(top + 1)
    for i in range(n):
        if abs(resid[i]) <= limit:
            t = int(window[i, 0])
            sums[t] += resid[i]
            rows[t] += 1.0
    for t in range(top + 1):
        sums[t] /= rows[t] + prior_rows
    return sums
