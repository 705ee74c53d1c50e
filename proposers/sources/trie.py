"""One request's trie: the kernels the merge is made of.

``_merge`` merges one request's source trees into a trie and lays out its
best nodes (``merge.py`` says in what order and why), ``best_chain`` takes
the path with the most expected accepted tokens, ``outcomes`` reads a
drafted trie against the tokens the target emitted, and ``calibrated`` is
``SourceCalibrator.calibrate`` of one estimate. ``merge.Merger`` runs them
for one request or, inside one numba call, for every request of a step.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.jit import cached_njit


@cached_njit
def calibrated(source, depth, c, cal_s, cal_n, cal_sd, cal_nd, strength):
    """``SourceCalibrator.calibrate`` of one estimate (see calibrate.py)."""
    bins = cal_s.shape[1]
    if not c >= 0.0:       # NaN too
        c = 0.0
    elif c > 1.0:
        c = 1.0
    b = min(int(c * bins), bins - 1)
    d = min(max(depth - 1, 0), cal_sd.shape[1] - 1)
    g = (cal_s[source, b] + strength * c) / (cal_n[source, b] + strength)
    return (cal_sd[source, d, b] + strength * g) / (cal_nd[source, d, b] + strength)


@cached_njit
def _merge(tok, par, seg_start, src, raw, budget, cal_s, cal_n, cal_sd, cal_nd, strength,
           local_depth, m_map, m_tok, m_par, m_cond, m_mask, m_depth, m_q, first_child,
           next_sibling, m_raw, new_index, order, out_tok, out_par, out_cond, out_mask,
           out_depth, out_q, out_raw):
    """Merge ``len(tok)`` candidates (each source's nodes contiguous, its
    parents local to its segment starting at ``seg_start[i]``) into a trie;
    write the ``budget`` nodes of highest q, re-laid, to ``out_*``. Returns
    the number written. ``raw``: each candidate's confidence as its source
    gave it, calibrated here per source and depth in its own tree (what the
    merge compares)."""
    n_in = len(tok)
    n_src = m_raw.shape[1]
    first_child[0] = -1
    n = 0
    for i in range(n_in):
        if par[i] < 0:
            mp = -1
            local_depth[i] = 1
        else:
            mp = m_map[seg_start[i] + par[i]]
            local_depth[i] = local_depth[seg_start[i] + par[i]] + 1
        cal_i = calibrated(src[i], local_depth[i], raw[i], cal_s, cal_n, cal_sd, cal_nd,
                           strength)
        c = first_child[mp + 1]
        found = -1
        while c >= 0:
            if m_tok[c] == tok[i]:
                found = c
                break
            c = next_sibling[c]
        if found < 0:
            found = n
            n += 1
            m_tok[found] = tok[i]
            m_par[found] = mp
            m_cond[found] = cal_i
            m_mask[found] = 0
            m_depth[found] = 1 if mp < 0 else m_depth[mp] + 1
            for s in range(n_src):
                m_raw[found, s] = np.nan
            first_child[found + 1] = -1
            next_sibling[found] = first_child[mp + 1]
            first_child[mp + 1] = found
        elif cal_i > m_cond[found]:
            m_cond[found] = cal_i
        m_mask[found] |= np.int64(1) << src[i]
        s = src[i]
        if np.isnan(m_raw[found, s]) or raw[i] > m_raw[found, s]:
            m_raw[found, s] = raw[i]
        m_map[i] = found
    for v in range(n):
        m_q[v] = m_cond[v] if m_par[v] < 0 else m_q[m_par[v]] * m_cond[v]
    # Descending q, ties by index, a NaN after every number: a stable
    # insertion sort over the scratch ``order`` (a merge holds tens of
    # nodes; ``np.argsort`` would allocate for each request).
    for v in range(n):
        x = m_q[v]
        j = v
        while j > 0:
            y = m_q[order[j - 1]]
            if not (x > y or (np.isnan(y) and not np.isnan(x))):
                break
            order[j] = order[j - 1]
            j -= 1
        order[j] = v
    k = min(budget, n)
    for v in range(n):
        new_index[v] = -1
    for j in range(k):
        v = order[j]
        new_index[v] = j
        out_tok[j] = m_tok[v]
        p = m_par[v]
        out_par[j] = -1 if p < 0 else new_index[p]
        out_cond[j] = m_cond[v]
        out_mask[j] = m_mask[v]
        out_depth[j] = m_depth[v]
        out_q[j] = m_q[v]
        for s in range(n_src):
            out_raw[j, s] = m_raw[v, s]
    return k


@cached_njit
def best_chain(parents, q, out):
    """The path with the most expected accepted tokens (the sum of q along
    it) into ``out``; returns its length. ``parents`` topological, so a
    node's children come after it: one pass from the last node up. Ties go
    to the lower index."""
    n = len(parents)
    below = np.zeros(n, np.float64)    # the best child's value
    child = np.full(n, -1, np.int64)
    root_val, root_child = 0.0, -1
    for v in range(n - 1, -1, -1):
        val = q[v] + below[v]
        p = parents[v]
        if p < 0:
            if root_child < 0 or val >= root_val:
                root_val, root_child = val, v
        elif child[p] < 0 or val >= below[p]:
            below[p] = val
            child[p] = v
    m = 0
    v = root_child
    while v >= 0:
        out[m] = v
        m += 1
        v = child[v]
    return m


@cached_njit
def outcomes(tokens, parents, depth, emitted, observed, accepted, path):
    """Read a drafted trie against the tokens the target emitted after it
    (the accepted path's tokens plus one). ``path`` <- the accepted nodes
    (the trie holds each path once); ``observed``: nodes whose parent is
    the root or on that path; ``accepted``: those whose token is the one
    the target emitted there. Returns the path's length."""
    n = len(tokens)
    on = np.zeros(n, np.bool_)
    m = 0
    node = -1
    for d in range(len(emitted) - 1):
        nxt = -1
        for v in range(n):
            if parents[v] == node and tokens[v] == emitted[d]:
                nxt = v
                break
        if nxt < 0:
            break
        path[m] = nxt
        m += 1
        on[nxt] = True
        node = nxt
    for v in range(n):
        p = parents[v]
        observed[v] = p < 0 or on[p]
        accepted[v] = observed[v] and tokens[v] == emitted[depth[v] - 1]
    return m
