"""The estimating controllers' compiled bookkeeping against the numpy it
replaced (written out here as the reference), over random slot states:
outcomes with the cut draft, length bounds, probes and cut drafts, the
decision counts."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.draft_length.controller_kernels import (count_decisions,
                                                                   length_bounds, settle,
                                                                   step_outcomes)

CAP, BACKOFF = 24, 1


def _slots(rng, depth):
    return {
        "cut_token": np.where(rng.random(CAP) < 0.6, rng.integers(0, 5, CAP), -1),
        "cut_at": rng.integers(-1, depth + 1, CAP),
        "probing": rng.random(CAP) < 0.3,
        "probe_level": rng.integers(0, 3, CAP),
        "zero_streak": rng.integers(0, 12, CAP),
        "conf_seen": rng.random(CAP) < 0.2,
    }


def _copy(a):
    return {k: v.copy() for k, v in a.items()}


def ref_outcomes(a, rows, emitted, num_draft, last, trees, observe_cut):
    n = np.where(emitted > 0, num_draft, 0)
    if trees is not None:
        n = np.where(trees, 0, n)
    m = np.minimum(np.maximum(emitted - 1, 0), n)
    cut_token, cut_at = a["cut_token"][rows].copy(), a["cut_at"][rows].copy()
    a["cut_token"][rows] = -1
    peek = np.zeros(len(rows), bool)
    hit = np.zeros(len(rows), bool)
    if observe_cut:
        peek = (cut_token >= 0) & (emitted > 0) & (m == n) & (cut_at == n)
        hit = peek & (last == cut_token)
        n, m = n + peek, m + hit
    probed = a["probing"][rows] & (n > 0)
    pr = rows[probed]
    a["probe_level"][pr] = np.where(m[probed] > 0, 0, a["probe_level"][pr] + 1)
    a["probing"][rows] = False
    return n, m, np.where(peek, cut_at, -1), hit


def ref_bounds(a, rows, probs, threshold, gap, conf_seen, max_draft):
    bound = (np.cumprod(probs, axis=1) > threshold).sum(1)
    if gap > 0:
        level = np.minimum(a["probe_level"][rows], BACKOFF)
        bound = np.where(a["zero_streak"][rows] >= gap << level, np.maximum(bound, 1), bound)
    bound = np.clip(bound, 0, max_draft)
    if conf_seen:
        bound = np.where(a["conf_seen"][rows], max_draft, bound)
    return bound


def ref_settle(a, rows, lengths, keep, bound, observable, gap):
    zs = a["zero_streak"]
    offered = lengths > 0
    zero = (offered & (keep == 0)) | bound
    a["probe_level"][rows[offered & (keep > 0)]] = 0
    probes = 0
    if gap > 0:
        level = np.minimum(a["probe_level"][rows], BACKOFF)
        due = zero & offered & ~observable & (zs[rows] >= gap << level)
        keep = keep.copy()
        keep[due] = 1
        a["probing"][rows[due]] = True
        probes = int(due.sum())
        zero = zero & ~due
    zs[rows] = np.where(zero, zs[rows] + 1, np.where(offered, 0, zs[rows]))
    keep = np.minimum(keep, lengths)
    cut = (keep < lengths) & observable
    a["cut_at"][rows[cut]] = keep[cut]
    return keep, keep + cut, np.nonzero(cut)[0], probes


@pytest.mark.parametrize("observe_cut", [True, False])
def test_outcomes_bounds_and_settling_match_the_numpy_reference(observe_cut):
    rng = np.random.default_rng(int(observe_cut))
    depth = 6
    for trial in range(300):
        a = _slots(rng, depth)
        b = _copy(a)
        size = int(rng.integers(1, 10))
        rows = rng.choice(CAP, size, replace=False).astype(np.int64)
        emitted = rng.integers(0, depth + 2, size) * (rng.random(size) < 0.9)
        num_draft = rng.integers(0, depth + 1, size)
        last = rng.integers(0, 5, size)
        trees = rng.random(size) < 0.2 if trial % 2 else None
        info = np.stack([emitted, num_draft, last], 1).astype(np.int64)
        out = np.empty((4, size), np.int64)
        peeks = step_outcomes(rows, info, np.zeros(0, bool) if trees is None else trees,
                              a["cut_token"], a["cut_at"], observe_cut, a["probing"],
                              a["probe_level"], *out)
        n, m, peek_at, hit = ref_outcomes(b, rows, emitted, num_draft, last, trees,
                                          observe_cut)
        np.testing.assert_array_equal(out[0], n)
        np.testing.assert_array_equal(out[1], m)
        np.testing.assert_array_equal(out[2], peek_at)
        np.testing.assert_array_equal(out[3], hit)
        assert peeks == int((peek_at >= 0).sum())

        probs = rng.uniform(0.05, 0.95, (size, depth))
        threshold = float(rng.choice([-np.inf, rng.uniform(0.0, 0.5)]))
        gap = int(rng.choice([0, 2, 4]))
        conf_seen = bool(trial % 3 == 0)
        got = length_bounds(rows, probs, threshold, a["zero_streak"], a["probe_level"], gap,
                            BACKOFF, a["conf_seen"] if conf_seen else np.zeros(0, bool),
                            depth)
        np.testing.assert_array_equal(got, ref_bounds(b, rows, probs, threshold, gap,
                                                      conf_seen, depth))

        lengths = rng.integers(0, depth + 1, size)
        keep = np.minimum(rng.integers(0, depth + 1, size), lengths + rng.integers(0, 2, size))
        bound = (lengths == 0) & (rng.random(size) < 0.5)
        stochastic = rng.random(size) < 0.2 if trial % 4 == 0 else np.zeros(0, bool)
        observable = observe_cut & (lengths > 0)
        if len(stochastic):
            observable &= ~stochastic
        res = np.empty((3, size), np.int64)
        probes, cuts = settle(rows, lengths, keep, bound, observe_cut, stochastic,
                              a["zero_streak"], a["probe_level"], a["probing"], gap, BACKOFF,
                              a["cut_at"], *res)
        kept, upto, cut_rows, ref_probes = ref_settle(b, rows, lengths, keep, bound,
                                                      observable, gap)
        np.testing.assert_array_equal(res[0], kept)
        np.testing.assert_array_equal(res[1], upto)
        np.testing.assert_array_equal(res[2, :cuts], cut_rows)
        assert probes == ref_probes
        for name in a:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_decision_counts_match_the_numpy_reference():
    rng = np.random.default_rng(5)
    depth = 5
    hist, want_hist = np.zeros(depth + 1, np.int64), np.zeros(depth + 1, np.int64)
    for _ in range(300):
        size = int(rng.integers(1, 10))
        lengths = rng.integers(0, depth + 1, size)
        keep = rng.integers(-1, depth + 2, size)
        bound = (lengths == 0) & (rng.random(size) < 0.5)
        want = np.clip(keep, 0, lengths)
        offered = lengths > 0
        no_draft, decisions, zeros, any_row = count_decisions(lengths, keep, bound, hist)
        want_hist += np.bincount(want[offered | bound], minlength=depth + 1)
        np.testing.assert_array_equal(keep, want)
        np.testing.assert_array_equal(hist, want_hist)
        assert no_draft == int((~offered & ~bound).sum())
        assert decisions == int((offered | bound).sum())
        assert zeros == int(((offered & (want == 0)) | bound).sum())
        assert any_row == bool(offered.any() or bound.any())
