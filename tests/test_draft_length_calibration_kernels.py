"""The prefix calibration's compiled step, and the rule's prefix
probabilities, against the numpy they replaced (written out here as the
reference): the same tables, the same stored probabilities, the same q."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length.acceptance import EPS
from vllm_plugins.proposers.draft_length.calibration import (ConfidenceCalibrator,
                                                            OutcomeCalibrator,
                                                            PrefixCalibrator,
                                                            prefix_probabilities)
from vllm_plugins.proposers.draft_length.slots import RequestSlots


class ReferencePrefix:
    """PrefixCalibrator's numpy step."""

    def __init__(self, capacity, depth):
        self.q_used = np.full((capacity, depth), np.nan)
        self.cal = OutcomeCalibrator()
        self.depth = depth

    def apply(self, q):
        b = np.searchsorted(OutcomeCalibrator.EDGES, q)
        k = OutcomeCalibrator._STRENGTH
        out = np.clip(q * ((self.cal.s[b] + k) / (self.cal.e[b] + k)), EPS, 1.0 - EPS)
        return np.minimum.accumulate(out, axis=1)

    def remember(self, rows, q, upto):
        self.q_used[rows] = np.nan
        w = min(q.shape[1], self.depth)
        self.q_used[rows, :w] = np.where(np.arange(w)[None, :] < upto[:, None], q[:, :w],
                                         np.nan)

    def observe(self, rows, n, m):
        q = self.q_used[rows]
        self.q_used[rows] = np.nan
        j = np.arange(self.depth)[None, :]
        seen = ~np.isnan(q) & ((j < n[:, None]) | (m[:, None] < n[:, None]))
        if seen.any():
            self.cal.learn(q[seen], (j < m[:, None])[seen].astype(np.float64))


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_prefix_calibration_matches_the_numpy_reference(depth):
    rng = np.random.default_rng(depth)
    slots = RequestSlots(32)
    cal = PrefixCalibrator(slots, depth)
    ref = ReferencePrefix(32, depth)
    rows_all = slots.slots([f"r{i}" for i in range(10)])
    for _ in range(300):
        rows = rng.choice(rows_all, size=rng.integers(1, 11), replace=False)
        width = int(rng.integers(1, depth + 1))
        p = rng.uniform(0.0, 1.0, (len(rows), width)) ** 0.3
        q = np.cumprod(p, axis=1)
        np.testing.assert_array_equal(cal.apply(q), ref.apply(q))
        upto = rng.integers(0, width + 1, len(rows))
        cal.remember(rows, q, upto)
        ref.remember(rows, q, upto)
        np.testing.assert_array_equal(slots.arrays["q_used"][:32], ref.q_used)
        n = rng.integers(0, depth + 2, len(rows))
        m = np.minimum(rng.integers(0, depth + 1, len(rows)), n)
        cal.observe(rows, n, m)
        ref.observe(rows, n, m)
        np.testing.assert_array_equal(slots.arrays["q_used"][:32], ref.q_used)
        np.testing.assert_array_equal(cal.s, ref.cal.s)
        np.testing.assert_array_equal(cal.e, ref.cal.e)


@pytest.mark.parametrize("with_conf", [False, True])
@pytest.mark.parametrize("with_prefix", [False, True])
def test_prefix_probabilities_match_the_numpy_reference(with_conf, with_prefix):
    """History estimates, calibrated confidences where given (NaN: not),
    their running product, the prefix calibration: as the controller's
    numpy did them one call each."""
    rng = np.random.default_rng(int(with_conf) + 2 * int(with_prefix))
    depth = 6
    slots = RequestSlots(32)
    conf_cal = ConfidenceCalibrator(slots, depth)
    prefix = PrefixCalibrator(slots, depth)
    rows_all = slots.slots([f"r{i}" for i in range(8)])
    for _ in range(100):
        # Learn something, so the tables are not flat.
        rows = rng.choice(rows_all, size=rng.integers(1, 9), replace=False)
        conf = rng.uniform(0.0, 1.0, (len(rows), depth))
        conf[rng.random(conf.shape) < 0.2] = np.nan
        keep = rng.integers(0, depth + 1, len(rows))
        conf_cal.remember(rows, conf, keep)
        prefix.remember(rows, np.cumprod(rng.uniform(0.2, 1.0, (len(rows), depth)), 1), keep)
        n = rng.integers(0, depth + 1, len(rows))
        m = np.minimum(rng.integers(0, depth + 1, len(rows)), n)
        conf_cal.observe(rows, n, m)
        prefix.observe(rows, n, m)
        width = int(rng.integers(1, depth + 1))
        probs = rng.uniform(EPS, 1 - EPS, (len(rows), depth))
        given = conf[:, :width].copy() if with_conf else None
        q, q_raw = prefix_probabilities(rows, probs, width, given, conf_cal,
                                        prefix if with_prefix else None)
        p = probs[:, :width]
        if with_conf:
            cal = conf_cal.calibrate(rows, given)
            p = np.where(np.isnan(cal), p, cal)
        want_raw = np.cumprod(p, axis=1)
        np.testing.assert_array_equal(q_raw, want_raw)
        want = ReferencePrefix(1, depth)
        want.cal.s, want.cal.e = prefix.s, prefix.e
        np.testing.assert_array_equal(q, want.apply(want_raw) if with_prefix else want_raw)


def test_confidence_observe_reads_and_clears_the_kept_confidences():
    """``observe`` reads each row's kept confidences from the slots (and
    leaves NaN there) as the numpy gather did before the compiled update."""
    from vllm_plugins.proposers.draft_length.calibration_kernels import learn_outcomes

    rng = np.random.default_rng(11)
    depth = 4
    pair = []
    for _ in range(2):
        slots = RequestSlots(16)
        pair.append((slots, ConfidenceCalibrator(slots, depth),
                     slots.slots([f"r{i}" for i in range(6)])))
    (sa, ca, rows_all), (sb, cb, _) = pair
    for _ in range(200):
        rows = rng.choice(rows_all, size=rng.integers(1, 7), replace=False)
        conf = rng.uniform(0.0, 1.0, (len(rows), depth))
        keep = rng.integers(0, depth + 1, len(rows))
        ca.remember(rows, conf, keep)
        cb.remember(rows, conf, keep)
        n = rng.integers(0, depth + 1, len(rows))
        m = np.minimum(rng.integers(0, depth + 1, len(rows)), n)
        ca.observe(rows, n, m)
        kept = sb.arrays["conf_kept"][rows]
        sb.arrays["conf_kept"][rows] = np.nan
        none_i, none_f = np.zeros(0, np.int64), np.zeros(0)
        learn_outcomes(rows, n, m, kept, none_i, none_i, none_f, none_f, cb.gs, cb.gn,
                       cb.gps, cb.gpn, sb.arrays["cal_s"], sb.arrays["cal_e"],
                       cb._STRENGTH, cb._gdecay, cb.decay)
        for name in ("conf_kept", "cal_s", "cal_e"):
            np.testing.assert_array_equal(sa.arrays[name], sb.arrays[name])
        for name in ("gs", "gn", "gps", "gpn"):
            np.testing.assert_array_equal(getattr(ca, name), getattr(cb, name))
