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

A step's requests are merged together: one numba call
(``merge_kernels.merge_step``) checks every source tree against the
contract, merges each request's valid trees, takes the best chain where a
request needs one, and counts each source's nodes, over buffers allocated
once per hybrid (``MergeBuffers``, grown when a step brings more
candidates), as the other hot loops are: the per-request work of a step
costs no Python beyond collecting the sources' trees. The next step reads
every request's tree against what the target emitted, and learns the
calibration from it, in one call too (``merge_kernels.outcomes_step``).
After a forward has left their code and data cold, each numpy call costs
more than these loops at a step's few trees: the step's integers go in as
one array and come out as another.
"""

from __future__ import annotations

from itertools import accumulate

import numpy as np

from vllm_plugins.proposers.array_table import ArrayTable
from vllm_plugins.proposers.sources import merge_kernels
from vllm_plugins.proposers.sources.base import PROBLEMS
from vllm_plugins.proposers.sources.calibrate import SourceCalibrator
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
        self.order = np.zeros(nodes, np.int64)
        # The merged nodes' tokens, parents, best chains' tokens, source bits
        # and depths: rows of one array, so a step's trees are kept in one
        # copy (``StepTrees``) and its drafts listed in one call.
        self.out_int = np.zeros((5, nodes), np.int64)
        self.out_tok, self.out_par, self.chain_tok, self.out_mask, self.out_depth = \
            self.out_int
        self.out_cond = np.zeros(nodes, np.float64)
        self.out_q = np.zeros(nodes, np.float64)
        self.out_raw = np.zeros((nodes, sources), np.float64)
        # One step's candidates, each request's valid trees compacted, and
        # the best chain of requests that need one.
        self.c_tok = np.zeros(nodes, np.int64)
        self.c_par = np.zeros(nodes, np.int64)
        self.c_raw = np.zeros(nodes, np.float64)
        self.c_src = np.zeros(nodes, np.int64)
        self.c_seg = np.zeros(nodes, np.int64)
        self.res = np.zeros(64, np.int64)
        self.chain_idx = np.zeros(nodes, np.int64)
        self.chain_cond = np.zeros(nodes, np.float64)
        # The merged nodes' and the best chains' estimates as drafts carry them.
        self.draft_cond = np.zeros((2, nodes), np.float32)
        # ``merge_kernels.merge_step_table``'s view of them.
        self.table = ArrayTable(
            (self.c_tok, self.c_par, self.c_raw, self.c_src, self.c_seg, self.local_depth,
             self.map, self.tok, self.par, self.cond, self.mask, self.depth, self.q,
             self.first_child, self.next_sibling, self.raw, self.new_index, self.order,
             self.out_tok, self.out_par, self.out_cond, self.out_mask, self.out_depth,
             self.out_q, self.out_raw, self.chain_idx, self.chain_tok, self.chain_cond,
             self.draft_cond), merge_kernels.MERGE_TABLE)

    def fits(self, nodes: int, sources: int) -> bool:
        return nodes <= self.nodes and sources <= self.sources

    def results(self, size: int) -> np.ndarray:
        """The merge's per-tree and per-request results
        (``merge_kernels.merge_step``'s ``res``), ``size`` of them."""
        if len(self.res) < size:
            self.res = np.zeros(max(size, 2 * len(self.res)), np.int64)
        return self.res[:size]


class StepTrees:
    """A step's merged trees, each request's nodes one after another: what
    the next step reads against the tokens the target emitted (copies: the
    buffers serve the next merge). ``ints``' rows: tokens, parents, the best
    chains' tokens, source bits, depths; ``raw``: each node's estimate per
    source (NaN: not its)."""

    __slots__ = ("ints", "raw")

    def __init__(self, ints: np.ndarray, raw: np.ndarray):
        self.ints, self.raw = ints, raw

    @classmethod
    def of_buffers(cls, b: MergeBuffers, total: int) -> "StepTrees":
        return cls(b.out_int[:, :total].copy(), b.out_raw[:total].copy())

    @property
    def tokens(self) -> np.ndarray:
        return self.ints[0]

    @property
    def parents(self) -> np.ndarray:
        return self.ints[1]

    @property
    def mask(self) -> np.ndarray:
        return self.ints[3]

    @property
    def depth(self) -> np.ndarray:
        return self.ints[4]

    @classmethod
    def concatenate(cls, parts) -> "StepTrees":
        """One ``StepTrees`` of the (trees, start, n) slices, in order."""
        return cls(np.concatenate([t.ints[:, a:a + n] for t, a, n in parts], axis=1),
                   np.concatenate([t.raw[a:a + n] for t, a, n in parts]))


class MergedStep:
    """What ``Merger.merge_step`` returns: per request (``start``, ``n``,
    ``chain_n``), per source tree (``status``), and the merged nodes of the
    whole step (``trees``, a copy). These and ``cond`` and ``chain_cond``
    are views of the buffers, valid until the next merge; ``draft_cond``'s
    rows are both estimates in float32, a copy."""

    PROBLEMS = PROBLEMS

    def __init__(self, b: MergeBuffers, total: int, res: np.ndarray, trees: int):
        r = (len(res) - trees) // 3
        self.res, self.num_trees = res, trees
        self.status, self.start = res[:trees], res[trees:trees + r]
        self.n, self.chain_n = res[trees + r:trees + 2 * r], res[trees + 2 * r:]
        self.trees = StepTrees.of_buffers(b, total)
        self.cond, self.chain_cond = b.out_cond[:total], b.chain_cond[:total]
        self.draft_cond = b.draft_cond[:, :total].copy()

    @property
    def chain_tok(self) -> np.ndarray:
        return self.trees.ints[2]

    @property
    def tokens(self) -> np.ndarray:
        return self.trees.tokens

    @property
    def parents(self) -> np.ndarray:
        return self.trees.parents

    def lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(status, start, n, chain_n) as lists, in one conversion."""
        values, g = self.res.tolist(), self.num_trees
        r = (len(values) - g) // 3
        return (values[:g], values[g:g + r], values[g + r:g + 2 * r], values[g + 2 * r:])

    def drafted(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, parents, chain tokens) of the whole step, as lists."""
        return self.trees.ints[:3].tolist()


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


def _flat_trees(meta: list[int], parts, total: int, status: np.ndarray):
    """(meta, tokens, parents, confidence, whether status was set): ``meta``
    as an array and every tree's fields, one tree after another. Where the
    trees are as the contract says (``SourceTree.conformed``) the integers
    take one conversion; else field by field (``_flat``, which marks a tree
    that does not convert in ``status``, zeroed first)."""
    m = len(meta)
    try:
        ints = np.concatenate([meta, *(t.tokens for t in parts), *(t.parents for t in parts)],
                              dtype=np.int64, casting="unsafe")
        raw = np.concatenate([t.confidence for t in parts] or [[]], dtype=np.float64,
                             casting="unsafe")
        if ints.ndim == 1 and len(ints) == m + 2 * total and len(raw) == total:
            return ints[:m], ints[m:m + total], ints[m + total:], raw, False
    except Exception:  # noqa: BLE001 (the field by field pass says whose fault)
        pass
    status[:] = 0
    return (np.array(meta, np.int64), _flat(parts, "tokens", np.int64, status),
            _flat(parts, "parents", np.int64, status),
            _flat(parts, "confidence", np.float64, status), True)


class OutcomeBuffers:
    """Scratch and output of ``Merger.outcomes_step``: trees of up to
    ``width`` nodes, ``entries`` calibration entries, ``requests`` rows."""

    def __init__(self, width: int, entries: int, requests: int, sources: int):
        self.width, self.entries, self.requests, self.sources = (width, entries, requests,
                                                                  sources)
        self.observed = np.zeros(width, np.bool_)
        self.accepted = np.zeros(width, np.bool_)
        self.path = np.zeros(width, np.int64)
        self.entry_int = np.zeros((2, entries), np.int64)      # source, depth
        self.entry_float = np.zeros((2, entries), np.float64)  # estimate, outcome
        self.row_alone = np.zeros((requests, sources), np.int64)

    def fits(self, width: int, entries: int, requests: int, sources: int) -> bool:
        return (width <= self.width and entries <= self.entries
                and requests <= self.requests and sources == self.sources)


class Merger:
    """Merges source trees, one request's or a whole step's; holds the buffers."""

    def __init__(self, num_sources: int, vocab_size: int | None = None):
        if num_sources > MAX_SOURCES:
            raise ValueError(f"at most {MAX_SOURCES} draft sources, got {num_sources}")
        self.num_sources = num_sources
        # Token ids at or past it are refused per tree (-1: unknown).
        self.vocab_size = -1 if vocab_size is None else int(vocab_size)
        self._buf: MergeBuffers | None = None
        self._outcomes: OutcomeBuffers | None = None
        # Tables of the types ``outcomes_step``'s kernel takes, for a call
        # that learns nothing (one compiled signature either way).
        self._no_calibration = SourceCalibrator(1, 1, 1)
        self._chain = np.zeros(0, np.int64)

    def merge(self, trees, calibrator, budget: int):
        """``trees``: (source index, SourceTree) pairs; ``calibrator``: the
        ``SourceCalibrator`` whose tables map each source's estimates.
        Returns (tokens, parents, cond, mask, depth, q, raw), the budget's
        best nodes, copies."""
        sizes = [len(t.tokens) for _, t in trees]
        total = sum(sizes)
        buf = self._buffers(total)
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
                   b.depth, b.q, b.first_child, b.next_sibling, b.raw, b.new_index, b.order,
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
        sizes = [len(t.tokens) for t in parts]
        total = sum(sizes)
        meta = [*accumulate(sizes, initial=0), *srcs, *accumulate(counts, initial=0),
                *budgets, *chains]
        b = self._buffers(total)
        res = b.results(len(parts) + 3 * len(counts))
        meta, tok, par, raw, status_given = _flat_trees(meta, parts, total, res)
        c = calibrator
        done = merge_kernels.merge_step_table(
            tok, par, raw, self.vocab_size, meta, len(parts), c.s, c.n, c.sd, c.nd,
            c.strength, b.table.table, res, status_given, node_count)
        return MergedStep(b, done, res, len(parts))

    def outcomes_step(self, trees, starts, lengths, emitted, src_accepted: np.ndarray,
                      src_alone: np.ndarray, calibrator=None):
        """Calibration entries (source, depth, raw estimate, outcome) of the
        merged trees ``starts[r]:][:lengths[r]]`` of ``trees`` (a
        ``StepTrees``) against each one's ``emitted[r]`` tokens (int64
        arrays), and the accepted nodes counted to their sources (see
        ``merge_kernels.outcomes_step``); last, per request and source, its
        accepted tokens no other source proposed (``len(starts)`` x
        sources). The
        arrays returned are views of buffers the next call reuses. With a
        ``calibrator``, the entries are learned too, in the same compiled
        call (as its ``learn`` would)."""
        sources = trees.raw.shape[1]
        meta = np.array([*starts, *lengths, *accumulate(map(len, emitted), initial=0)],
                        np.int64)
        flat = np.concatenate(emitted, dtype=np.int64, casting="same_kind")
        o = self._outcome_buffers(max(lengths, default=0), sum(lengths) * sources,
                                  len(starts), sources)
        cal = calibrator or self._no_calibration
        c = merge_kernels.outcomes_step(
            trees.ints, trees.raw, meta, flat, o.observed, o.accepted, o.path, o.entry_int,
            o.entry_float, src_accepted, src_alone, o.row_alone, calibrator is not None,
            cal.decay, cal.s, cal.n, cal.sd, cal.nd)
        return (o.entry_int[0, :c], o.entry_int[1, :c], o.entry_float[0, :c],
                o.entry_float[1, :c], o.row_alone[:len(starts)])

    def _outcome_buffers(self, width: int, entries: int, requests: int,
                         sources: int) -> "OutcomeBuffers":
        o = self._outcomes
        if o is None or not o.fits(width, entries, requests, sources):
            grown = (width, entries, requests) if o is None else \
                (max(width, o.width), max(entries, o.entries), max(requests, o.requests))
            o = self._outcomes = OutcomeBuffers(*(max(n, 64) for n in grown), sources)
        return o

    def chain(self, parents: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Node indices of the path with the most expected accepted tokens."""
        if len(self._chain) < len(parents):
            self._chain = np.zeros(max(len(parents), 64), np.int64)
        m = best_chain(np.asarray(parents, np.int64), np.asarray(q, np.float64), self._chain)
        return self._chain[:m].copy()


def warm_up() -> None:
    """Compile (or load) the merge now, not in an engine step."""
    from vllm_plugins.proposers.sources.base import SourceTree, valid_tree

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
                    np.zeros(2, np.int64), cal)
