"""The acceptance estimator's per-step arithmetic, compiled.

The estimator runs every engine step, usually over a handful of rows: as
vectorised numpy it was some sixty array calls a step whose dispatch, not
arithmetic, was most of the draft-length controller's host time. These loops
do the same over the slot arrays in place (``AcceptanceEstimator`` says what
the numbers mean).
"""

from __future__ import annotations

import math

import numpy as np

from vllm_plugins.proposers.jit import cached_njit


@cached_njit
def _log_beta(x, y):
    return math.lgamma(x) + math.lgamma(y) - math.lgamma(x + y)


@cached_njit
def learn_rows(rows, n, m, depth, acc_s, acc_n, win_n, win_m, win_pos, glob, gps, gpn,
               gdecay, prior_acceptance, decay, ewma, change_threshold):
    """Learn one step's outcomes: row ``rows[i]`` verified ``n[i]`` drafts,
    the first ``m[i]`` accepted; rows with ``n[i]`` = 0 verified nothing
    and are skipped (a step where no row verified changes nothing, not even
    the global decay). Updates the global counts (``glob``: the pooled
    accepted and observed, ``gps``/``gpn`` per position), the recent
    window, and with ``ewma`` the decayed counts, then runs the change
    detector where ``change_threshold`` > 0. Returns how many rows it
    reset."""
    rows_n = len(rows)
    recent = win_n.shape[1]
    verified = 0
    for i in range(rows_n):
        if n[i] > 0:
            verified += 1
    if verified == 0:
        return 0
    accepted_total = 0.0
    observed_total = 0.0
    for j in range(depth):
        gps[j] *= gdecay
        gpn[j] *= gdecay
    for i in range(rows_n):
        if n[i] <= 0:
            continue
        ni = min(n[i], depth)
        mi = min(m[i], ni)
        seen = min(mi + 1, ni)
        accepted_total += mi
        observed_total += seen
        for j in range(mi):
            gps[j] += 1.0
        for j in range(seen):
            gpn[j] += 1.0
        row = rows[i]
        col = win_pos[row] % recent
        win_n[row, col] = ni
        win_m[row, col] = mi
        win_pos[row] += 1
    glob[0] = gdecay * glob[0] + accepted_total
    glob[1] = gdecay * glob[1] + observed_total
    if not ewma:
        return 0
    for i in range(rows_n):
        if n[i] <= 0:
            continue
        ni = min(n[i], depth)
        mi = min(m[i], ni)
        seen = min(mi + 1, ni)
        row = rows[i]
        for j in range(depth):
            acc_s[row, j] = decay * acc_s[row, j] + (1.0 if j < mi else 0.0)
            acc_n[row, j] = decay * acc_n[row, j] + (1.0 if j < seen else 0.0)
    if change_threshold <= 0:
        return 0
    rate = (glob[0] + prior_acceptance) / (glob[1] + 1.0)
    changes = 0
    for i in range(rows_n):
        if n[i] > 0 and _detect_change(rows[i], depth, acc_s, acc_n, win_n, win_m, win_pos,
                                       rate, decay, change_threshold):
            changes += 1
    return changes


@cached_njit
def _detect_change(row, depth, acc_s, acc_n, win_n, win_m, win_pos, rate, decay, threshold):
    """Bayes factor of "a new regime began L steps ago" for one row
    (``AcceptanceEstimator._changed`` says why); where the best L clears the
    threshold, the row's counts become those L steps' and its window
    empties."""
    recent = win_n.shape[1]
    newest = (win_pos[row] - 1) % recent
    # The window's share of the decayed counts, to leave it out of the reference.
    window_s = 0.0
    window_n = 0.0
    for c in range(recent):
        age = (newest - c) % recent
        weight = decay ** age
        nc = win_n[row, c]
        if nc > 0:
            window_s += weight * min(win_m[row, c], depth)
        window_n += weight * min(min(win_m[row, c] + 1, nc), depth)
    total_s = 0.0
    total_n = 0.0
    for j in range(depth):
        total_s += acc_s[row, j]
        total_n += acc_n[row, j]
    s_ref = max(total_s - window_s, 0.0)
    n_ref = max(total_n - window_n, s_ref)
    a0 = s_ref + rate
    b0 = n_ref - s_ref + 1.0 - rate
    reference = _log_beta(a0, b0)
    accepted = 0.0
    rejected = 0.0
    steps = 0
    best_age = 0
    best = -np.inf
    for age in range(recent):   # newest first
        c = (newest - age) % recent
        nc = win_n[row, c]
        if nc > 0:
            accepted += win_m[row, c]
            if win_m[row, c] < nc:
                rejected += 1.0
            steps += 1
        if age == 0 or steps < 2:   # one step is a fluke
            continue
        log_bf = (_log_beta(1.0 + accepted, 1.0 + rejected)
                  - _log_beta(a0 + accepted, b0 + rejected) + reference)
        if log_bf > best:
            best = log_bf
            best_age = age
    if not best > threshold:
        return False
    for j in range(depth):
        acc_s[row, j] = 0.0
        acc_n[row, j] = 0.0
    for c in range(recent):
        if (newest - c) % recent > best_age:
            continue
        nc = win_n[row, c]
        mc = win_m[row, c]
        for j in range(depth):
            if nc > 0 and mc > j:
                acc_s[row, j] += 1.0
            if min(mc + 1, nc) > j:
                acc_n[row, j] += 1.0
    for c in range(recent):
        win_n[row, c] = 0
    return True


@cached_njit
def probs_rows(rows, acc_s, acc_n, win_n, win_m, ewma, rate, gps, gpn, strength, eps):
    """``probs_from`` of slot rows, their counts read in place: the decayed
    counts with ``ewma``, else the recent window's (``AcceptanceEstimator``
    gives both)."""
    depth = len(gps)
    rows_n = len(rows)
    s = np.zeros((rows_n, depth))
    n = np.zeros((rows_n, depth))
    for i in range(rows_n):
        row = rows[i]
        if ewma:
            for j in range(depth):
                s[i, j] = acc_s[row, j]
                n[i, j] = acc_n[row, j]
            continue
        for c in range(win_n.shape[1]):
            nc = int(win_n[row, c])
            mc = int(win_m[row, c])
            for j in range(depth):
                if mc > j and nc > 0:
                    s[i, j] += 1.0
                if min(mc + 1, nc) > j:
                    n[i, j] += 1.0
    return probs_from(s, n, rate, gps, gpn, strength, eps)


@cached_njit
def probs_from(s, n, rate, gps, gpn, strength, eps):
    """[rows, depth] conditional acceptance from counts ``s``/``n``
    (``AcceptanceEstimator`` gives the model)."""
    rows_n, depth = s.shape
    out = np.empty((rows_n, depth))
    odds_rate = rate / (1.0 - rate)
    profile = np.empty(depth)
    for j in range(depth):
        r = (gps[j] + 2.0 * rate) / (gpn[j] + 2.0)
        profile[j] = r / (1.0 - r) / odds_rate
    for i in range(rows_n):
        total_s = 0.0
        total_n = 0.0
        for j in range(depth):
            total_s += s[i, j]
            total_n += n[i, j]
        alpha = (total_s + rate) / (total_n + 1.0)
        alpha = min(max(alpha, eps), 1.0 - eps)
        for j in range(depth):
            scaled = alpha * profile[j]
            prior = scaled / (1.0 - alpha + scaled)
            p = (s[i, j] + strength * prior) / max(n[i, j] + strength, 1e-12)
            out[i, j] = min(max(p, eps), 1.0 - eps)
    return out
