"""The acceptance estimator's compiled step against the vectorised numpy it
replaced (written out here as the reference): same counts, same resets, same
probabilities, over random outcome sequences with regime changes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length.acceptance import EPS, AcceptanceEstimator
from vllm_plugins.proposers.draft_length.slots import RequestSlots


def _lgamma(x):
    return np.vectorize(math.lgamma, otypes=[np.float64])(x)


def _window_counts(n, m, depth, w):
    j = np.arange(depth)
    acc = (m[:, :, None] > j) & (n[:, :, None] > 0)
    seen = np.minimum(m + 1, n)[:, :, None] > j
    return (acc * w[:, :, None]).sum(1), (seen * w[:, :, None]).sum(1)


class Reference:
    """The estimator's numpy step: per-position counts, window, detector."""

    def __init__(self, est: AcceptanceEstimator, capacity: int):
        d, w = est.depth, est.recent
        self.e = est
        self.s = np.zeros((capacity, d))
        self.n = np.zeros((capacity, d))
        self.win_n = np.zeros((capacity, w), np.int64)
        self.win_m = np.zeros((capacity, w), np.int64)
        self.win_pos = np.zeros(capacity, np.int64)
        self.gs = self.gn = 0.0
        self.gps, self.gpn = np.zeros(d), np.zeros(d)
        self.changes = 0

    def rate(self):
        return (self.gs + self.e.prior_acceptance) / (self.gn + 1.0)

    def observe(self, rows, n, m):
        if len(rows) == 0:
            return
        e, d = self.e, self.e.depth
        n = np.minimum(n, d)
        m = np.minimum(m, n)
        j = np.arange(d)
        obs = j[None, :] < np.minimum(m + 1, n)[:, None]
        acc = j[None, :] < m[:, None]
        g = e._gdecay
        self.gs, self.gn = g * self.gs + float(acc.sum()), g * self.gn + float(obs.sum())
        self.gps, self.gpn = g * self.gps + acc.sum(0), g * self.gpn + obs.sum(0)
        col = self.win_pos[rows] % e.recent
        self.win_n[rows, col], self.win_m[rows, col] = n, m
        self.win_pos[rows] += 1
        self.s[rows] = e.decay * self.s[rows] + acc
        self.n[rows] = e.decay * self.n[rows] + obs
        self._changed(rows)

    def _changed(self, rows):
        e = self.e
        n, m = self.win_n[rows], self.win_m[rows]
        valid = n > 0
        newest = (self.win_pos[rows] - 1) % e.recent
        age = (newest[:, None] - np.arange(e.recent)[None, :]) % e.recent
        rs, rn = _window_counts(n, m, e.depth, e.decay ** age)
        s_ref = np.maximum(self.s[rows].sum(1) - rs.sum(1), 0.0)
        n_ref = np.maximum(self.n[rows].sum(1) - rn.sum(1), s_ref)
        g = self.rate()
        a0 = (s_ref + g)[:, None]
        b0 = (n_ref - s_ref + 1.0 - g)[:, None]
        acc = np.where(valid, m, 0).astype(np.float64)
        rej = (valid & (m < n)).astype(np.float64)
        order = np.argsort(age, axis=1)
        A = np.cumsum(np.take_along_axis(acc, order, 1), 1)
        F = np.cumsum(np.take_along_axis(rej, order, 1), 1)
        steps = np.cumsum(np.take_along_axis(valid, order, 1), 1)

        def lbeta(x, y):
            return _lgamma(x) + _lgamma(y) - _lgamma(x + y)

        log_bf = lbeta(1 + A, 1 + F) - lbeta(a0 + A, b0 + F) + lbeta(a0, b0)
        log_bf = np.where(steps >= 2, log_bf, -np.inf)
        log_bf[:, 0] = -np.inf
        best = np.argmax(log_bf, axis=1)
        hit = log_bf[np.arange(len(rows)), best] > e.change_threshold
        for i in np.nonzero(hit)[0]:
            r = rows[i]
            keep = (age[i] <= best[i]).astype(np.float64)[None]
            s, o = _window_counts(self.win_n[r][None], self.win_m[r][None], e.depth, keep)
            self.s[r], self.n[r] = s[0], o[0]
            self.win_n[r] = 0
            self.changes += 1

    def probs(self, rows):
        e, g = self.e, self.rate()
        s, n = self.s[rows], self.n[rows]
        alpha = np.clip((s.sum(1) + g) / (n.sum(1) + 1.0), EPS, 1 - EPS)
        rates = (self.gps + 2 * g) / (self.gpn + 2)
        profile = rates / (1 - rates) / (g / (1 - g))
        scaled = alpha[:, None] * profile[None]
        prior = scaled / (1 - alpha[:, None] + scaled)
        c = e.prior_strength
        return np.clip((s + c * prior) / np.maximum(n + c, 1e-12), EPS, 1 - EPS)


@pytest.mark.parametrize("depth", [1, 4, 7])
def test_compiled_step_matches_the_numpy_reference(depth):
    rng = np.random.default_rng(depth)
    slots = RequestSlots(64)
    est = AcceptanceEstimator(slots, depth)
    ref = Reference(est, 64)
    rows_all = slots.slots([f"r{i}" for i in range(12)])
    level = rng.uniform(0.05, 0.95, 12)
    for step in range(400):
        if step % 40 == 0:   # regimes flip: the detector must fire
            level = np.where(np.arange(12) % 2 == (step // 40) % 2, 0.97, 0.03)
        rows = rng.choice(rows_all, size=rng.integers(1, 13), replace=False)
        n = rng.integers(0, depth + 2, len(rows))
        m = np.array([next((j for j in range(k) if rng.random() > level[r]), k)
                      for k, r in zip(n, rows)], np.int64)
        verified = n > 0
        est.observe(rows[verified], n[verified], m[verified])
        ref.observe(rows[verified], n[verified], m[verified])
        a = slots.arrays
        np.testing.assert_allclose(a["acc_s"][rows_all], ref.s[rows_all], atol=1e-9)
        np.testing.assert_allclose(a["acc_n"][rows_all], ref.n[rows_all], atol=1e-9)
        np.testing.assert_array_equal(a["win_n"][rows_all], ref.win_n[rows_all])
        np.testing.assert_array_equal(a["win_m"][rows_all], ref.win_m[rows_all])
        np.testing.assert_allclose(est.probs(rows_all), ref.probs(rows_all), atol=1e-12)
    assert est.changes == ref.changes
    if depth > 1:   # one position gives three steps too little evidence to reset
        assert ref.changes > 3


def _reference_probs(est, s, n):
    """The estimator's probabilities from counts, in numpy."""
    g = est.global_rate
    alpha = np.clip((s.sum(1) + g) / (n.sum(1) + 1.0), EPS, 1 - EPS)
    rates = (est._gps + 2 * g) / (est._gpn + 2)
    profile = rates / (1 - rates) / (g / (1 - g))
    scaled = alpha[:, None] * profile[None]
    prior = scaled / (1 - alpha[:, None] + scaled)
    c = est.prior_strength
    return np.clip((s + c * prior) / np.maximum(n + c, 1e-12), EPS, 1 - EPS)


@pytest.mark.parametrize("mode", ["ewma", "window"])
def test_unverified_rows_are_skipped_and_window_probs_match(mode):
    """Rows given with n = 0 learn nothing (a step with none verified
    changes nothing), as if left out; the window estimator's probabilities
    are its window's counts through the same formula."""
    rng = np.random.default_rng(7)
    depth = 5
    pair = []
    for _ in range(2):
        slots = RequestSlots(64)
        pair.append((slots, AcceptanceEstimator(slots, depth, estimator=mode, window=4),
                     slots.slots([f"r{i}" for i in range(8)])))
    (sa, ea, rows), (sb, eb, _) = pair
    for step in range(300):
        pick = rng.choice(rows, size=rng.integers(1, 9), replace=False)
        n = rng.integers(0, depth + 2, len(pick)) * (rng.random(len(pick)) < 0.7)
        m = np.minimum(rng.integers(0, depth + 1, len(pick)), n)
        ea.observe(pick, n, m)
        v = n > 0
        eb.observe(pick[v], n[v], m[v])
        for name in sa.arrays:
            np.testing.assert_array_equal(sa.arrays[name], sb.arrays[name])
        np.testing.assert_array_equal(ea._glob, eb._glob)
        np.testing.assert_array_equal(ea.probs(rows), eb.probs(rows))
    if mode == "window":
        a = sa.arrays
        s, o = _window_counts(a["win_n"][rows].astype(np.int64),
                              a["win_m"][rows].astype(np.int64), depth,
                              np.ones(a["win_n"][rows].shape))
        np.testing.assert_allclose(ea.probs(rows), _reference_probs(ea, s, o), atol=1e-12)
