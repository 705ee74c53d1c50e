"""Merging the sources' trees into one trie, best first, cut to a budget.

Every source proposes its own small tree for a request. The hybrid wants
one tree: the same token under the same parent is one node (a prefix two
sources agree on is verified once), each node keeps the best calibrated
estimate among the sources that proposed it, and the nodes come out in
descending path probability q (the product of the estimates from the
root), ties by creation order. q never grows down a path and a parent is
created before its children, so that order is topological and every
prefix of it is the most probable tree of its size: cutting to the budget
keeps a tree. The kernels for one request are ``trie.py``'s.

A step's requests are merged together: one numba call (``_merge_step``)
checks every source tree against the contract, merges each request's valid
trees, takes the best chain where a request needs one, and counts each
source's nodes, over buffers allocated once per hybrid (``MergeBuffers``,
grown when a step brings more candidates), as the other hot loops are:
the per-request work of a step costs no Python beyond collecting the
sources' trees. The next step reads every request's tree against what the
target emitted in one call too (``_outcomes_step``).
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.sources.base import PROBLEMS, valid_tree
from vllm_plugins.proposers.sources.trie import _merge, best_chain, outcomes

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
        # One step's candidates, each request's valid trees compacted, and
        # the best chain of requests that need one.
        self.c_tok = np.zeros(nodes, np.int64)
        self.c_par = np.zeros(nodes, np.int64)
        self.c_raw = np.zeros(nodes, np.float64)
        self.c_src = np.zeros(nodes, np.int64)
        self.c_seg = np.zeros(nodes, np.int64)
        self.chain_idx = np.zeros(nodes, np.int64)
        self.chain_tok = np.zeros(nodes, np.int64)
        self.chain_cond = np.zeros(nodes, np.float64)

    def fits(self, nodes: int, sources: int) -> bool:
        return nodes <= self.nodes and sources <= self.sources


@cached_njit
def _merge_step(tok, par, raw, vocab, g_off, g_src, r_off, budget, want_chain, cal_s, cal_n,
                cal_sd, cal_nd, strength, c_tok, c_par, c_raw, c_src, c_seg, local_depth,
                m_map, m_tok, m_par, m_cond, m_mask, m_depth, m_q, first_child,
                next_sibling, m_raw, new_index, out_tok, out_par, out_cond, out_mask,
                out_depth, out_q, out_raw, chain_idx, chain_tok, chain_cond, status,
                out_start, out_n, chain_n, node_count):
    """A step's merge. Source tree g holds candidates ``g_off[g]:g_off[g+1]``
    of source ``g_src[g]``; request r holds trees ``r_off[r]:r_off[r+1]``;
    ``vocab``: token ids from it on break the contract (-1: unknown).
    ``status[g]`` <- 0 for a tree that keeps the contract (``valid_tree``;
    3: more nodes than the budget), and only those are merged (a tree
    whose status comes in nonzero is skipped as it is). Request r's
    merged nodes go to ``out_*[out_start[r]:][:out_n[r]]``; where
    ``want_chain[r]``, its best chain's tokens and estimates to
    ``chain_*[out_start[r]:][:chain_n[r]]``. ``node_count[s]`` += the merged
    nodes source s proposed. Returns the number of merged nodes."""
    n_src = m_raw.shape[1]
    at = 0
    for r in range(len(budget)):
        n_c = 0
        for g in range(r_off[r], r_off[r + 1]):
            if status[g] != 0:
                continue
            lo, hi = g_off[g], g_off[g + 1]
            st = valid_tree(tok[lo:hi], par[lo:hi], raw[lo:hi], vocab)
            if st == 0 and hi - lo > budget[r]:
                st = 3
            status[g] = st
            if st != 0:
                continue
            base = n_c
            for i in range(lo, hi):
                c_tok[n_c] = tok[i]
                c_par[n_c] = par[i]
                c_raw[n_c] = raw[i]
                c_src[n_c] = g_src[g]
                c_seg[n_c] = base
                n_c += 1
        out_start[r] = at
        k = 0
        if n_c > 0:
            k = _merge(c_tok[:n_c], c_par[:n_c], c_seg[:n_c], c_src[:n_c], c_raw[:n_c],
                       budget[r], cal_s, cal_n, cal_sd, cal_nd, strength, local_depth, m_map,
                       m_tok, m_par, m_cond, m_mask, m_depth, m_q, first_child, next_sibling,
                       m_raw, new_index, out_tok[at:], out_par[at:], out_cond[at:],
                       out_mask[at:], out_depth[at:], out_q[at:], out_raw[at:])
        out_n[r] = k
        chain_n[r] = 0
        if k > 0 and want_chain[r]:
            m = best_chain(out_par[at:at + k], out_q[at:at + k], chain_idx)
            for j in range(m):
                chain_tok[at + j] = out_tok[at + chain_idx[j]]
                chain_cond[at + j] = out_cond[at + chain_idx[j]]
            chain_n[r] = m
        for j in range(at, at + k):
            for s in range(n_src):
                if (out_mask[j] >> s) & 1:
                    node_count[s] += 1
        at += k
    return at


@cached_njit
def _outcomes_step(tok, par, depth, mask, raw, start, n, emitted, e_off, observed,
                   accepted, path, out_src, out_depth, out_conf, out_outcome,
                   src_accepted, src_alone, row_alone):
    """``outcomes`` of each request's merged tree (nodes ``start[r]:][:n[r]]``)
    against its emitted tokens (``emitted[e_off[r]:e_off[r+1]]``). Writes one
    calibration entry per (observed node, source that proposed it), nodes in
    order, then sources: the source, the node's depth, the source's own
    estimate, 1.0 if accepted. Counts each accepted node to every source
    that proposed it (``src_accepted``) and to the one source where only one
    did (``src_alone``, and ``row_alone[r]`` per request: what each source
    brought each request). Returns the number of entries."""
    n_src = raw.shape[1]
    c = 0
    for r in range(len(start)):
        s, k = start[r], n[r]
        m = outcomes(tok[s:s + k], par[s:s + k], depth[s:s + k],
                     emitted[e_off[r]:e_off[r + 1]], observed[:k], accepted[:k], path[:k])
        for v in range(k):
            if not observed[v]:
                continue
            for q in range(n_src):
                x = raw[s + v, q]
                if not np.isnan(x):
                    out_src[c] = q
                    out_depth[c] = depth[s + v]
                    out_conf[c] = x
                    out_outcome[c] = 1.0 if accepted[v] else 0.0
                    c += 1
        for j in range(m):
            bits = mask[s + path[j]]
            count, last = 0, -1
            for q in range(n_src):
                if (bits >> q) & 1:
                    src_accepted[q] += 1
                    count += 1
                    last = q
            if count == 1:
                src_alone[last] += 1
                row_alone[r, last] += 1
    return c


class StepTrees:
    """A step's merged trees, each request's nodes one after another: what
    the next step reads against the tokens the target emitted (copies: the
    buffers serve the next merge)."""

    __slots__ = ("tokens", "parents", "depth", "mask", "raw")

    def __init__(self, b: MergeBuffers, total: int):
        self.tokens, self.parents = b.out_tok[:total].copy(), b.out_par[:total].copy()
        self.depth, self.mask = b.out_depth[:total].copy(), b.out_mask[:total].copy()
        self.raw = b.out_raw[:total].copy()

    @classmethod
    def concatenate(cls, parts) -> "StepTrees":
        """One ``StepTrees`` of the (trees, start, n) slices, in order."""
        out = cls.__new__(cls)
        for name in cls.__slots__:
            setattr(out, name, np.concatenate([getattr(t, name)[a:a + n]
                                               for t, a, n in parts]))
        return out


class MergedStep:
    """What ``Merger.merge_step`` returns: per request (``start``, ``n``,
    ``chain_n``), per source tree (``status``), and the merged nodes of the
    whole step (``trees``); ``tokens``, ``parents``, ``cond``, ``chain_tok``
    and ``chain_cond`` are views of the buffers, valid until the next merge."""

    PROBLEMS = PROBLEMS

    def __init__(self, b: MergeBuffers, total, start, n, chain_n, status):
        self.start, self.n, self.chain_n, self.status = start, n, chain_n, status
        self.trees = StepTrees(b, total)
        self.tokens, self.parents = self.trees.tokens, self.trees.parents
        self.cond, self.chain_tok = b.out_cond[:total], b.chain_tok[:total]
        self.chain_cond = b.chain_cond[:total]


def _flat(parts, field: str, dtype, status: np.ndarray) -> np.ndarray:
    """One array of every tree's ``field``, as ``dtype``. Where that fails
    (a source drafted something that is not a number), tree by tree: a
    tree that does not convert gets status 4 and zeros in its place, so
    it costs its own candidates only."""
    values = [getattr(t, field) for t in parts]
    try:
        return np.concatenate(values or [[]], dtype=dtype, casting="unsafe")
    except Exception:  # noqa: BLE001 (any tree's fault is that tree's alone)
        out = []
        for g, v in enumerate(values):
            try:
                a = np.asarray(v).astype(dtype)
                if a.ndim != 1:
                    raise ValueError(f"shape {a.shape}")
                out.append(a)
            except Exception:  # noqa: BLE001
                status[g] = 4
                out.append(np.zeros(len(v), dtype))
        return np.concatenate(out)


class Merger:
    """Merges source trees, one request's or a whole step's; holds the buffers."""

    def __init__(self, num_sources: int, vocab_size: int | None = None):
        if num_sources > MAX_SOURCES:
            raise ValueError(f"at most {MAX_SOURCES} draft sources, got {num_sources}")
        self.num_sources = num_sources
        # Token ids at or past it are refused per tree (-1: unknown).
        self.vocab_size = -1 if vocab_size is None else int(vocab_size)
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

    def _buffers(self, total: int) -> MergeBuffers:
        buf = self._buf
        if buf is None or not buf.fits(max(total, 1), self.num_sources):
            buf = self._buf = MergeBuffers(max(total, 64, 0 if buf is None else buf.nodes),
                                           self.num_sources)
        return buf

    def merge_step(self, trees, counts, budgets, chains, calibrator,
                   node_count: np.ndarray) -> MergedStep:
        """Every drafting request of a step at once. ``trees``: (source
        index, SourceTree) pairs, request after request, each tree's
        tokens, parents and confidence of one length; ``counts[r]``: request
        r's number of trees; ``budgets[r]``, ``chains[r]``: its node budget,
        and whether it takes the best chain. ``node_count`` (per source)
        counts the merged nodes each source proposed."""
        parts = [t for _, t in trees]
        srcs = [k for k, _ in trees]
        if srcs and not 0 <= min(srcs) <= max(srcs) < self.num_sources:
            raise ValueError(f"source index outside [0, {self.num_sources})")
        # Offsets in Python: np.cumsum of a short list costs more than the merge.
        g_off = np.array(list(accumulate((len(t.tokens) for t in parts), initial=0)),
                         np.int64)
        r_off = np.array(list(accumulate(counts, initial=0)), np.int64)
        total = int(g_off[-1])
        b = self._buffers(total)
        status = np.zeros(len(trees), np.int64)
        tok = _flat(parts, "tokens", np.int64, status)
        par = _flat(parts, "parents", np.int64, status)
        raw = _flat(parts, "confidence", np.float64, status)
        start, n, chain_n = np.zeros((3, len(counts)), np.int64)
        g_src = np.array(srcs, np.int64)
        c = calibrator
        done = _merge_step(
            tok, par, raw, self.vocab_size, g_off, g_src, r_off, np.array(budgets, np.int64),
            np.array(chains, np.bool_), c.s, c.n, c.sd, c.nd, c.strength, b.c_tok,
            b.c_par, b.c_raw, b.c_src, b.c_seg, b.local_depth, b.map, b.tok, b.par, b.cond,
            b.mask, b.depth, b.q, b.first_child, b.next_sibling, b.raw, b.new_index,
            b.out_tok, b.out_par, b.out_cond, b.out_mask, b.out_depth, b.out_q, b.out_raw,
            b.chain_idx, b.chain_tok, b.chain_cond, status, start, n, chain_n, node_count)
        return MergedStep(b, done, start, n, chain_n, status)

    def outcomes_step(self, trees, starts, lengths, emitted, src_accepted: np.ndarray,
                      src_alone: np.ndarray):
        """Calibration entries (source, depth, raw estimate, outcome) of the
        merged trees ``starts[r]:][:lengths[r]]`` of ``trees`` (a
        ``StepTrees``) against each one's ``emitted[r]`` tokens, and the
        accepted nodes counted to their sources (see ``_outcomes_step``);
        last, per request and source, its accepted tokens no other source
        proposed (int64, ``len(starts)`` x sources)."""
        start = np.asarray(starts, np.int64)
        n = np.asarray(lengths, np.int64)
        e_off = np.array(list(accumulate((len(e) for e in emitted), initial=0)), np.int64)
        flat = np.concatenate(emitted).astype(np.int64)
        width = int(n.max()) if len(n) else 0
        size = int(n.sum()) * trees.raw.shape[1]
        src, depth = np.zeros(size, np.int64), np.zeros(size, np.int64)
        conf, out = np.zeros(size), np.zeros(size)
        row_alone = np.zeros((len(start), trees.raw.shape[1]), np.int64)
        c = _outcomes_step(trees.tokens, trees.parents, trees.depth, trees.mask, trees.raw,
                           start, n, flat, e_off, np.zeros(width, np.bool_),
                           np.zeros(width, np.bool_), np.zeros(width, np.int64), src, depth,
                           conf, out, src_accepted, src_alone, row_alone)
        return src[:c], depth[:c], conf[:c], out[:c], row_alone

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
    valid_tree(a.tokens, a.parents, a.confidence, -1)
    t, p, *_, q, _ = m.merge([(0, a), (1, a)], SourceCalibrator(2, 4), 2)
    m.chain(p, q)
    z = np.zeros(len(t), np.bool_)
    outcomes(t, p, np.ones(len(t), np.int64), t[:1], z, z.copy(), np.zeros(len(t), np.int64))
    cal = SourceCalibrator(2, 4)
    cal.learn(np.array([0]), np.array([1]), np.array([0.5]), np.array([1.0]))
    step = m.merge_step([(0, a), (1, a)], [2], [2], [True], cal, np.zeros(2, np.int64))
    m.outcomes_step(step.trees, [0], [2], [np.array([1, 2, 3])], np.zeros(2, np.int64),
                    np.zeros(2, np.int64))
