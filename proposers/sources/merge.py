"""Merging the sources' trees into one trie, best first, cut to a budget.

Every source proposes its own small tree for a request. The hybrid wants
one tree: the same token under the same parent is one node (a prefix two
sources agree on is verified once), each node keeps the best calibrated
estimate among the sources that proposed it, and the nodes come out in
descending path probability q (the product of the estimates from the
root), ties by creation order. q never grows down a path and a parent is
created before its children, so that order is topological and every
prefix of it is the most probable tree of its size: cutting to the budget
keeps a tree.

One numba pass over buffers allocated once per hybrid (``MergeBuffers``,
grown when a step brings more candidates), as the other hot loops are.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.jit import cached_njit

# Bits of the per-node source mask: at most this many sources in one hybrid.
MAX_SOURCES = 63


class MergeBuffers:
    """Scratch and output of one merge, sized for ``nodes`` candidates from
    ``sources`` sources."""

    def __init__(self, nodes: int, sources: int):
        self.nodes, self.sources = nodes, sources
        self.map = np.zeros(nodes, np.int64)
        self.local_depth = np.zeros(nodes, np.int64)
        self.tok = np.zeros(nodes, np.int64)
        self.par = np.zeros(nodes, np.int64)
        self.cond = np.zeros(nodes, np.float64)
        self.mask = np.zeros(nodes, np.int64)
        self.depth = np.zeros(nodes, np.int64)
        self.q = np.zeros(nodes, np.float64)
        self.first_child = np.zeros(nodes + 1, np.int64)   # index parent + 1
        self.next_sibling = np.zeros(nodes, np.int64)
        self.raw = np.zeros((nodes, sources), np.float64)
        self.new_index = np.zeros(nodes, np.int64)
        self.out_tok = np.zeros(nodes, np.int64)
        self.out_par = np.zeros(nodes, np.int64)
        self.out_cond = np.zeros(nodes, np.float64)
        self.out_mask = np.zeros(nodes, np.int64)
        self.out_depth = np.zeros(nodes, np.int64)
        self.out_q = np.zeros(nodes, np.float64)
        self.out_raw = np.zeros((nodes, sources), np.float64)

    def fits(self, nodes: int, sources: int) -> bool:
        return nodes <= self.nodes and sources <= self.sources


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
           next_sibling, m_raw, new_index, out_tok, out_par, out_cond, out_mask,
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
    order = np.argsort(-m_q[:n], kind="mergesort")   # stable: ties by index
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


class Merger:
    """Merges one request's source trees; holds the buffers."""

    def __init__(self, num_sources: int):
        if num_sources > MAX_SOURCES:
            raise ValueError(f"at most {MAX_SOURCES} draft sources, got {num_sources}")
        self.num_sources = num_sources
        self._buf: MergeBuffers | None = None
        self._chain = np.zeros(0, np.int64)

    def merge(self, trees, calibrator, budget: int):
        """``trees``: (source index, SourceTree) pairs; ``calibrator``: the
        ``SourceCalibrator`` whose tables map each source's estimates.
        Returns (tokens, parents, cond, mask, depth, q, raw), the budget's
        best nodes, copies."""
        sizes = [len(t.tokens) for _, t in trees]
        total = sum(sizes)
        buf = self._buf
        if buf is None or not buf.fits(max(total, 1), self.num_sources):
            buf = self._buf = MergeBuffers(max(total, 64, 0 if buf is None else buf.nodes),
                                           self.num_sources)
        if total == 0 or budget <= 0:
            z = np.zeros(0, np.int64)
            return z, z.copy(), np.zeros(0), z.copy(), z.copy(), np.zeros(0), \
                np.zeros((0, self.num_sources))
        if len(trees) == 1:
            (k, t), = trees
            tok, par, raw = t.tokens, t.parents, t.confidence
            seg = np.zeros(total, np.int64)
            src = np.full(total, k, np.int64)
        else:
            tok = np.concatenate([t.tokens for _, t in trees])
            par = np.concatenate([t.parents for _, t in trees])
            raw = np.concatenate([t.confidence for _, t in trees])
            starts = np.cumsum([0] + sizes[:-1])
            seg = np.repeat(np.asarray(starts, np.int64), sizes)
            src = np.repeat(np.asarray([s for s, _ in trees], np.int64), sizes)
        b, c = buf, calibrator
        k = _merge(tok, par, seg, src, raw, int(budget), c.s, c.n, c.sd, c.nd,
                   c.strength, b.local_depth, b.map, b.tok, b.par, b.cond, b.mask,
                   b.depth, b.q, b.first_child, b.next_sibling, b.raw, b.new_index,
                   b.out_tok, b.out_par, b.out_cond, b.out_mask, b.out_depth, b.out_q,
                   b.out_raw)
        return (b.out_tok[:k].copy(), b.out_par[:k].copy(), b.out_cond[:k].copy(),
                b.out_mask[:k].copy(), b.out_depth[:k].copy(), b.out_q[:k].copy(),
                b.out_raw[:k].copy())

    def chain(self, parents: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Node indices of the path with the most expected accepted tokens."""
        if len(self._chain) < len(parents):
            self._chain = np.zeros(max(len(parents), 64), np.int64)
        m = best_chain(np.asarray(parents, np.int64), np.asarray(q, np.float64), self._chain)
        return self._chain[:m].copy()


def warm_up() -> None:
    """Compile (or load) the merge now, not in an engine step."""
    from vllm_plugins.proposers.sources.base import SourceTree, valid_tree
    from vllm_plugins.proposers.sources.calibrate import SourceCalibrator

    m = Merger(2)
    a = SourceTree.chain([1, 2], [0.5, 0.5])
    valid_tree(a.parents, a.confidence)
    t, p, *_, q, _ = m.merge([(0, a), (1, a)], SourceCalibrator(2, 4), 2)
    m.chain(p, q)
    z = np.zeros(len(t), np.bool_)
    outcomes(t, p, np.ones(len(t), np.int64), t[:1], z, z.copy(), np.zeros(len(t), np.int64))
