"""The confidence calibration's per-step arithmetic, compiled.

``ConfidenceCalibrator`` learns, calibrates and remembers every engine step
over a handful of drafts; as numpy that was a score of array calls (masks,
``nonzero``, six ``bincount``) whose dispatch outweighed the arithmetic.
These loops do the same over its tables and slot arrays in place, summing
in the same order.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.jit import cached_njit


@cached_njit
def _bin(c, bins):
    """A confidence's bucket (NaN: bucket 0)."""
    b = int((c if c == c else 0.0) * bins)
    return min(max(b, 0), bins - 1)


@cached_njit
def _global(j, c, gs, gn, gps, gpn, strength):
    """g_jb(c): the bucket's rate shrunk to c, the position's to that."""
    b = _bin(c, len(gs))
    g = (gs[b] + strength * c) / (gn[b] + strength)
    return (gps[j, b] + strength * g) / (gpn[j, b] + strength)


@cached_njit
def learn_outcomes(rows, n, m, conf, extra_row, extra_depth, extra_conf, extra_outcome,
                   gs, gn, gps, gpn, cal_s, cal_e, strength, gdecay, decay):
    """Learn the kept drafts' outcomes: row i observed ``n[i]`` positions,
    the first ``m[i]`` accepted, with the confidences ``conf[i]`` they had
    when kept (NaN: none); then the ``extra_*`` outcomes (row index into
    ``rows``, position, confidence, outcome). Each outcome's expectation is
    read before any of the step's outcomes count."""
    rows_n, depth = conf.shape
    size = rows_n * depth + len(extra_row)
    r_idx = np.empty(size, np.int64)
    j_idx = np.empty(size, np.int64)
    cs = np.empty(size)
    xs = np.empty(size)
    count = 0
    for i in range(rows_n):
        ni = min(n[i], depth)
        mi = min(m[i], ni)
        for j in range(min(mi + 1, ni)):
            c = conf[i, j]
            if c == c:
                r_idx[count] = i
                j_idx[count] = j
                cs[count] = c
                xs[count] = 1.0 if j < mi else 0.0
                count += 1
    for e in range(len(extra_row)):
        r_idx[count] = extra_row[e]
        j_idx[count] = extra_depth[e]
        cs[count] = extra_conf[e]
        xs[count] = extra_outcome[e]
        count += 1
    if count == 0:
        return
    bins = len(gs)
    expected = np.empty(count)
    buckets = np.empty(count, np.int64)
    for e in range(count):
        c = min(max(cs[e], 0.0), 1.0) if cs[e] == cs[e] else cs[e]
        cs[e] = c
        buckets[e] = _bin(c, bins)
        expected[e] = _global(j_idx[e], c, gs, gn, gps, gpn, strength)
    # Sums first, then added: the order numpy's bincount gave.
    add_s = np.zeros(bins)
    add_n = np.zeros(bins)
    add_ps = np.zeros(gps.shape)
    add_pn = np.zeros(gps.shape)
    row_s = np.zeros(rows_n)
    row_e = np.zeros(rows_n)
    seen = np.zeros(rows_n, np.bool_)
    for e in range(count):
        b = buckets[e]
        add_s[b] += xs[e]
        add_n[b] += 1.0
        add_ps[j_idx[e], b] += xs[e]
        add_pn[j_idx[e], b] += 1.0
        row_s[r_idx[e]] += xs[e]
        row_e[r_idx[e]] += expected[e]
        seen[r_idx[e]] = True
    for b in range(bins):
        gs[b] = gs[b] * gdecay + add_s[b]
        gn[b] = gn[b] * gdecay + add_n[b]
        for j in range(gps.shape[0]):
            gps[j, b] = gps[j, b] * gdecay + add_ps[j, b]
            gpn[j, b] = gpn[j, b] * gdecay + add_pn[j, b]
    for i in range(rows_n):
        row = rows[i]
        if seen[i]:
            cal_s[row] *= decay
            cal_e[row] *= decay
        cal_s[row] += row_s[i]
        cal_e[row] += row_e[i]


@cached_njit
def _calibrated(j, c, level, gs, gn, gps, gpn, strength, eps):
    """g_jb(c) moved by the request's ``level`` in odds, clipped."""
    p = min(max(_global(j, c, gs, gn, gps, gpn, strength), eps), 1.0 - eps)
    scaled = p * level
    return min(max(scaled / (1.0 - p + scaled), eps), 1.0 - eps)


@cached_njit
def calibrated(rows, conf, gs, gn, gps, gpn, cal_s, cal_e, strength, eps):
    """[rows, width] calibrated probabilities of confidences ``conf``
    (column j: draft position j + 1; NaN stays NaN)."""
    rows_n, width = conf.shape
    out = np.empty((rows_n, width))
    for i in range(rows_n):
        level = (cal_s[rows[i]] + strength) / (cal_e[rows[i]] + strength)
        for j in range(width):
            c = conf[i, j]
            out[i, j] = np.nan if c != c else _calibrated(
                j, min(max(c, 0.0), 1.0), level, gs, gn, gps, gpn, strength, eps)
    return out


@cached_njit
def calibrated_at(rows, positions, conf, gs, gn, gps, gpn, cal_s, cal_e, strength, eps):
    """Calibrated probabilities of single drafts: slot row, position and
    raw confidence per entry (NaN counts as 0)."""
    out = np.empty(len(rows))
    for e in range(len(rows)):
        c = conf[e]
        c = min(max(c, 0.0), 1.0) if c == c else 0.0
        level = (cal_s[rows[e]] + strength) / (cal_e[rows[e]] + strength)
        out[e] = _calibrated(positions[e], c, level, gs, gn, gps, gpn, strength, eps)
    return out


@cached_njit
def remember_kept(rows, conf, upto, conf_kept, conf_seen):
    """Store each row's confidences of positions < ``upto[i]`` (NaN
    beyond), and mark rows that were given any confidence."""
    rows_n, width = conf.shape
    depth = conf_kept.shape[1]
    for i in range(rows_n):
        row = rows[i]
        given = False
        for j in range(width):
            if conf[i, j] == conf[i, j]:
                given = True
            if j < depth:
                conf_kept[row, j] = conf[i, j] if j < upto[i] else np.nan
        for j in range(width, depth):
            conf_kept[row, j] = np.nan
        if given:
            conf_seen[row] = True


@cached_njit
def learn_kept(rows, n, m, conf_kept, extra_row, extra_depth, extra_conf, extra_outcome,
               gs, gn, gps, gpn, cal_s, cal_e, strength, gdecay, decay):
    """``learn_outcomes`` with each row's kept confidences read from the
    slot array ``conf_kept``, which they leave (NaN): consumed, or stale."""
    depth = conf_kept.shape[1]
    conf = np.empty((len(rows), depth))
    for i in range(len(rows)):
        for j in range(depth):
            conf[i, j] = conf_kept[rows[i], j]
            conf_kept[rows[i], j] = np.nan
    if len(rows):
        learn_outcomes(rows, n, m, conf, extra_row, extra_depth, extra_conf, extra_outcome,
                       gs, gn, gps, gpn, cal_s, cal_e, strength, gdecay, decay)


@cached_njit
def _bucket(edges, q):
    """``np.searchsorted(edges, q)``: the first edge not below q (NaN: past
    the last)."""
    b = 0
    while b < len(edges) and not edges[b] >= q:
        b += 1
    return b


@cached_njit
def learn_prefix(rows, n, m, q_used, edges, s, e, decay):
    """The prefix calibration's step (``PrefixCalibrator.observe``): each
    row's remembered prefix probabilities leave ``q_used``; those whose
    outcome is known (position < n, or the whole run failed short of n)
    count, per bucket, their outcome into ``s`` and themselves into ``e``,
    both decayed once where any counted."""
    depth = q_used.shape[1]
    add_s = np.zeros(len(s))
    add_e = np.zeros(len(s))
    count = 0
    for i in range(len(rows)):
        row = rows[i]
        for j in range(depth):
            q = q_used[row, j]
            q_used[row, j] = np.nan
            if q == q and (j < n[i] or m[i] < n[i]):
                b = _bucket(edges, q)
                add_s[b] += 1.0 if j < m[i] else 0.0
                add_e[b] += q
                count += 1
    if count == 0:
        return
    for b in range(len(s)):
        s[b] = decay * s[b] + add_s[b]
        e[b] = decay * e[b] + add_e[b]


@cached_njit
def learn_buckets(q, x, edges, s, e, decay):
    """``OutcomeCalibrator.learn``: predictions ``q`` and their outcomes
    ``x`` summed per bucket in their order, added to ``s`` and ``e``
    decayed once (numpy's ``bincount`` with weights, the same sums)."""
    add_s = np.zeros(len(s))
    add_e = np.zeros(len(s))
    for i in range(len(q)):
        b = _bucket(edges, q[i])
        add_s[b] += x[i]
        add_e[b] += q[i]
    for b in range(len(s)):
        s[b] = s[b] * decay + add_s[b]
        e[b] = e[b] * decay + add_e[b]


@cached_njit
def apply_prefix(q, edges, s, e, strength, eps, out):
    """Calibrated prefix probabilities (``PrefixCalibrator.apply``) into
    ``out``: q times its bucket's factor, clipped, non-increasing along
    each row."""
    for i in range(q.shape[0]):
        for j in range(q.shape[1]):
            b = _bucket(edges, q[i, j])
            v = q[i, j] * ((s[b] + strength) / (e[b] + strength))
            v = min(max(v, eps), 1.0 - eps)
            if j > 0 and out[i, j - 1] < v:
                v = out[i, j - 1]
            out[i, j] = v


@cached_njit
def prefix_probs(rows, probs, width, conf, gs, gn, gps, gpn, cal_s, cal_e, strength, eps,
                 use_prefix, edges, ps, pe, prefix_strength, q, q_raw):
    """The rule's prefix probabilities of the first ``width`` drafts: each
    position's history estimate (``probs``), or its calibrated confidence
    where ``conf`` (empty: none) gives one, multiplied along the row into
    ``q_raw``; ``q``: those through the prefix calibration where
    ``use_prefix``, else a copy."""
    with_conf = conf.shape[0] > 0
    for i in range(len(rows)):
        level = (cal_s[rows[i]] + strength) / (cal_e[rows[i]] + strength) if with_conf \
            else 1.0
        acc = 1.0
        for j in range(width):
            p = probs[i, j]
            if with_conf:
                c = conf[i, j]
                if c == c:
                    p = _calibrated(j, min(max(c, 0.0), 1.0), level, gs, gn, gps, gpn,
                                    strength, eps)
            acc = p if j == 0 else acc * p
            q_raw[i, j] = acc
    if use_prefix:
        apply_prefix(q_raw, edges, ps, pe, prefix_strength, eps, q)
    else:
        q[:, :] = q_raw


@cached_njit
def remember_prefix(rows, q_raw, upto, q_used):
    """Store each row's raw prefix probabilities of positions < ``upto[i]``
    (NaN beyond) for the next step's ``learn_prefix``."""
    width = q_raw.shape[1]
    for i in range(len(rows)):
        for j in range(q_used.shape[1]):
            q_used[rows[i], j] = q_raw[i, j] if j < width and j < upto[i] else np.nan
