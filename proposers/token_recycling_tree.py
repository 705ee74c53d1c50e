"""Token Recycling's draft trees: many candidate paths from the same tables.

A chain bets a whole step on the most probable successor at every depth; a
tree spends the same verification on the paths most likely to be accepted.
Every node's candidate children come from the tables the chain walks: the
longest context-table entry for the path so far, then the adjacency matrix
row of the node's token (its stored top-k), scored by their stored
log-probabilities. Two builders use them:

- ``best_first``: the ``budget`` nodes of highest path probability (the
  product of the stored probabilities from the root), grown with a small
  heap: a node's children are sorted once, so each expanded node has one
  entry, its next child, and the nodes come out in descending path
  probability, parents before children (a topological order whose every
  prefix is the best tree of its size).
- ``template``: the paper's static shape, an 80-node tree over 6 levels
  whose node ``r`` under a parent is the parent's ``r``-th candidate; its
  first ``budget`` nodes in level order.

A request's own context adds one more source: the tokens that followed the
longest earlier occurrence of the context's suffix (a verbatim span, as
vLLM's n-gram and suffix methods find). It enters as one more candidate at
each depth along the span, scored by the match length, so it becomes its
own branch where the recycled candidates disagree and merges with them where
they agree.

Everything is one numba loop per request over buffers allocated once
(``TreeBuffers``), as the chain walk is.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_plugins.proposers.array_table import ArrayTable, mat, vec
from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.token_recycling_tables import RecyclingTables, _hash

BUILDERS = ("best_first", "template")

# The paper's static tree, stated as the number of children (its top
# candidates) of each node of one level, in level order; levels 1..6.
# Nodes of a level not listed have no children.
_TEMPLATE_CHILD_COUNTS = (
    (8,),
    (8, 4, 3, 2, 1, 1, 1, 1),
    (8, 3, 2, 1, 1, 1, 1, 1, 2, 1, 0, 0, 1, 0, 0, 1, 0, 1, 1),
    (5, 2, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1),
    (3, 1, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 1),
    (2, 0, 0, 1),
)

# Span lookup: suffixes of this many tokens are matched (longer ones count
# as this long); shorter matches than the minimum give no span.
SPAN_MIN_MATCH = 2
SPAN_MAX_MATCH = 16


def template_shape() -> tuple[np.ndarray, np.ndarray]:
    """The template's nodes in level order: (parent index or -1, candidate
    rank under that parent)."""
    parents, ranks = [], []
    level = [-1]  # the root
    for counts in _TEMPLATE_CHILD_COUNTS:
        nxt = []
        for parent, count in zip(level, counts):
            for rank in range(count):
                nxt.append(len(parents))
                parents.append(parent)
                ranks.append(rank)
        level = nxt
    return np.asarray(parents, np.int64), np.asarray(ranks, np.int64)


TEMPLATE_PARENTS, TEMPLATE_RANKS = template_shape()
TEMPLATE_SIZE = len(TEMPLATE_PARENTS)


def span_logp(match_len: int) -> float:
    """How much a span token is trusted: a suffix that matched m tokens
    earlier in the context predicts the next with probability m / (m + 1)
    (a uniform prior over whether the repeat goes on, Laplace's rule)."""
    return math.log(match_len / (match_len + 1.0))


class TreeBuffers:
    """Per-node scratch for one request's tree, sized for ``budget`` nodes
    and ``k`` matrix successors; grown when a step asks for more."""

    def __init__(self, budget: int, k: int, order: int):
        self.budget, self.k, self.order = budget, k, order
        n, c = budget + 1, k + 2  # root + nodes; matrix row + context + span
        self.cand_tok = np.zeros((n, c), np.int64)
        self.cand_lp = np.zeros((n, c), np.float64)
        self.cand_n = np.zeros(n, np.int64)
        self.next_child = np.zeros(n, np.int64)
        self.node_tok = np.zeros(n, np.int64)
        self.node_parent = np.zeros(n, np.int64)
        self.node_lp = np.zeros(n, np.float64)     # path log-probability
        self.node_span = np.zeros(n, np.int64)     # span index of its span child, or -1
        self.heap_lp = np.zeros(n + 1, np.float64)
        self.heap_node = np.zeros(n + 1, np.int64)
        self.heap_seq = np.zeros(n + 1, np.int64)
        self.seq = np.zeros(max(order, 1), np.int64)
        self.out_tok = np.zeros(budget, np.int64)
        self.out_parent = np.zeros(budget, np.int64)
        self.out_p = np.zeros(budget, np.float64)  # conditional probability
        self.span = np.zeros(budget, np.int64)
        # ``_grow_best_first_table``'s view of them.
        self.table = ArrayTable(
            (self.span, self.cand_tok, self.cand_lp, self.cand_n, self.next_child,
             self.node_tok, self.node_parent, self.node_lp, self.node_span, self.heap_lp,
             self.heap_node, self.heap_seq, self.seq, self.out_tok, self.out_parent,
             self.out_p), _BEST_FIRST_TABLE)

    def fits(self, budget: int, k: int, order: int) -> bool:
        return budget <= self.budget and k <= self.k and order <= self.order


class TreeBuilder:
    """Builds one request's tree from the tables; holds the buffers."""

    def __init__(self, tables: RecyclingTables, builder: str = "best_first",
                 context_branch: bool = True):
        if builder not in BUILDERS:
            raise ValueError(f"tree_builder must be one of {list(BUILDERS)}, got {builder!r}")
        self.tables = tables
        self.builder = builder
        self.context_branch = context_branch
        self._buf: TreeBuffers | None = None

    def buffers(self, budget: int) -> TreeBuffers:
        t = self.tables
        order = max(t.context_order, 1)
        if self._buf is None or not self._buf.fits(budget, t.k, order):
            self._buf = TreeBuffers(max(budget, 0 if self._buf is None else self._buf.budget),
                                    t.k, order)
        return self._buf

    def build(self, context: np.ndarray, budget: int, min_confidence: float = 0.0
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(tokens, parents, conditional probabilities) of up to ``budget``
        nodes after ``context``, in topological order; parents[i] = -1 for
        a child of the root (the context's last token). Nodes whose path
        probability falls below ``min_confidence`` are left out."""
        context = np.ascontiguousarray(context, np.int64)
        if budget <= 0 or len(context) == 0:
            empty = np.zeros(0, np.int64)
            return empty, empty, np.zeros(0, np.float64)
        t, b = self.tables, self.buffers(budget)
        order = max(t.context_order, 1)
        n_span, lp_span = 0, 0.0
        if self.context_branch:
            n_span, match = _find_span(context, SPAN_MIN_MATCH, SPAN_MAX_MATCH, budget, b.span)
            if n_span:
                lp_span = span_logp(match)
        tail = context[-order:]
        min_lp = -np.inf if min_confidence <= 0 else math.log(min_confidence)
        if self.builder == "best_first":
            n = _grow_best_first_table(t.ids, t.logp, t.ctx_key, t.ctx_tok, t.ctx_logp,
                                       t.context_order, tail, budget, min_lp, n_span, lp_span,
                                       b.table.table)
        else:
            size = min(budget, TEMPLATE_SIZE)
            n = _grow_template(t.ids, t.logp, t.ctx_key, t.ctx_tok, t.ctx_logp,
                               t.context_order, tail, TEMPLATE_PARENTS[:size],
                               TEMPLATE_RANKS[:size], min_lp, b.span, n_span, lp_span,
                               b.cand_tok, b.cand_lp, b.cand_n, b.node_tok,
                               b.node_parent, b.node_lp, b.node_span, b.seq,
                               b.out_tok, b.out_parent, b.out_p)
        return b.out_tok[:n].copy(), b.out_parent[:n].copy(), b.out_p[:n].copy()


def learn_tree(tables: RecyclingTables, context: np.ndarray, tokens: np.ndarray,
               parents: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray
               ) -> None:
    """Tables <- the target's top-k at every verified node of a tree step.

    Row 0 of ``topk_*`` is the target at the root (the context's last
    token), row i + 1 at node i. The matrix row of each node's token takes
    its top-k; the context tables take each node's top-1 keyed by the path
    that leads to it (the context's tail, then its ancestors)."""
    context = np.asarray(context, np.int64)
    tokens = np.asarray(tokens, np.int64)
    parents = np.asarray(parents, np.int64)
    rows = len(tokens) + 1
    tables.learn_rows(np.concatenate([context[-1:], tokens]), topk_ids[:rows],
                      topk_logprobs[:rows])
    order = tables.context_order
    if order < 2:
        return
    seqs = np.empty(rows * order, np.int64)
    starts = np.empty(rows, np.int64)
    ends = np.empty(rows, np.int64)
    used = _context_paths(context[-order:], tokens, parents, order, seqs, starts, ends)
    tables.learn_contexts(seqs[:used], ends, topk_ids[:rows, 0], topk_logprobs[:rows, 0],
                          starts)


# ------------------------------------------------------------------ kernels

@cached_njit
def _context_paths(tail, tokens, parents, order, seqs, starts, ends):
    """For the root and each node i, the ``order`` tokens that lead to it
    (the context's tail, then its ancestors, then i), written back to back
    into ``seqs`` with each one's [start, end); returns the length used.
    A Python walk per node cost more than the tables' update itself."""
    path = np.empty(order, np.int64)
    used = 0
    for i in range(-1, len(tokens)):
        depth = 0
        j = i
        while j >= 0 and depth < order:
            path[depth] = tokens[j]
            depth += 1
            j = parents[j]
        total = len(tail) + depth
        take = min(order, total)
        starts[i + 1] = used
        for q in range(total - take, total):
            seqs[used] = tail[q] if q < len(tail) else path[depth - 1 - (q - len(tail))]
            used += 1
        ends[i + 1] = used
    return used


@cached_njit
def _find_span(context, min_match, max_match, max_len, out):
    """The tokens that followed the longest earlier occurrence of the
    context's suffix (the latest such occurrence), up to ``max_len``, into
    ``out``: (span length, match length); (0, 0) when no suffix of at
    least ``min_match`` tokens occurs earlier."""
    n = len(context)
    best, best_end = 0, -1
    last = context[n - 1]
    for j in range(n - 2, -1, -1):
        if context[j] != last:
            continue
        m = 1
        while m < max_match and j - m >= 0 and context[j - m] == context[n - 1 - m]:
            m += 1
        if m > best:
            best, best_end = m, j
            if m == max_match:
                break
    if best < min_match:
        return 0, 0
    count = min(max_len, n - 1 - best_end)
    for i in range(count):
        out[i] = context[best_end + 1 + i]
    return count, best


@cached_njit
def _candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, seq, n_seq,
                span_tok, span_lp, out_tok, out_lp):
    """A node's candidate children, best first: the longest context-table
    entry for ``seq[:n_seq]`` (the path ending at the node), the matrix row
    of its last token, and the span's next token (``span_tok`` >= 0). The
    matrix row's probabilities are what remains beside a context entry:
    scaled by 1 - p(context entry). A token offered twice keeps its
    higher score. Returns how many."""
    count = 0
    rest = 0.0  # log of the mass left to the matrix row
    slots = len(ctx_key)
    for n in range(min(order, n_seq), 1, -1):
        h = _hash(seq, n_seq, n)
        slot = h % slots
        if ctx_key[slot] == h:
            out_tok[0] = ctx_tok[slot]
            out_lp[0] = ctx_logp[slot]
            count = 1
            p = math.exp(ctx_logp[slot])
            rest = math.log(1.0 - p) if p < 1.0 else -np.inf
            break
    last = seq[n_seq - 1]
    for r in range(ids.shape[1]):
        tok = ids[last, r]
        if tok < 0:
            break
        count = _offer(out_tok, out_lp, count, tok, logp[last, r] + rest)
    if span_tok >= 0:
        count = _offer(out_tok, out_lp, count, span_tok, span_lp)
    # insertion sort, descending; equal scores keep their offer order
    for i in range(1, count):
        t, s = out_tok[i], out_lp[i]
        j = i - 1
        while j >= 0 and out_lp[j] < s:
            out_tok[j + 1] = out_tok[j]
            out_lp[j + 1] = out_lp[j]
            j -= 1
        out_tok[j + 1] = t
        out_lp[j + 1] = s
    return count


@cached_njit
def _offer(out_tok, out_lp, count, tok, lp):
    for i in range(count):
        if out_tok[i] == tok:
            if lp > out_lp[i]:
                out_lp[i] = lp
            return count
    if lp == -np.inf:
        return count
    out_tok[count] = tok
    out_lp[count] = lp
    return count + 1


@cached_njit
def _node_candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, u,
                     node_tok, node_parent, node_span, span, n_span, lp_span,
                     seq, cand_tok, cand_lp, cand_n):
    """Fill node u's candidates (u = 0: the root, the tail's last token)."""
    width = max(order, 1)
    # the path's last ``width`` tokens: u's ancestors, then the tail
    k = 0
    j = u
    while j > 0 and k < width:
        seq[width - 1 - k] = node_tok[j]
        k += 1
        j = node_parent[j]
    t = len(tail) - 1
    while k < width and t >= 0:
        seq[width - 1 - k] = tail[t]
        k += 1
        t -= 1
    # shift so the path starts at seq[0]
    if k < width:
        for i in range(k):
            seq[i] = seq[width - k + i]
    s = node_span[u]
    span_tok = span[s] if 0 <= s < n_span else -1
    cand_n[u] = _candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, seq, k,
                            span_tok, lp_span, cand_tok[u], cand_lp[u])


@cached_njit
def _child_span(node_span, span, n_span, u, tok):
    """The span index a child of u with token ``tok`` carries on, or -1."""
    s = node_span[u]
    if 0 <= s < n_span and span[s] == tok:
        return s + 1
    return -1


@cached_njit
def _heap_push(heap_lp, heap_node, heap_seq, size, lp, node, seq):
    """Max-heap on (lp, -seq): equal scores come out in push order."""
    i = size
    heap_lp[i], heap_node[i], heap_seq[i] = lp, node, seq
    while i > 0:
        p = (i - 1) // 2
        if heap_lp[p] > heap_lp[i] or (heap_lp[p] == heap_lp[i] and heap_seq[p] < heap_seq[i]):
            break
        heap_lp[p], heap_lp[i] = heap_lp[i], heap_lp[p]
        heap_node[p], heap_node[i] = heap_node[i], heap_node[p]
        heap_seq[p], heap_seq[i] = heap_seq[i], heap_seq[p]
        i = p
    return size + 1


@cached_njit
def _heap_pop(heap_lp, heap_node, heap_seq, size):
    """Remove the top (read it first); returns the new size."""
    size -= 1
    heap_lp[0], heap_node[0], heap_seq[0] = heap_lp[size], heap_node[size], heap_seq[size]
    i = 0
    while True:
        a, b, best = 2 * i + 1, 2 * i + 2, i
        for c in (a, b):
            if c < size and (heap_lp[c] > heap_lp[best] or (
                    heap_lp[c] == heap_lp[best] and heap_seq[c] < heap_seq[best])):
                best = c
        if best == i:
            break
        heap_lp[best], heap_lp[i] = heap_lp[i], heap_lp[best]
        heap_node[best], heap_node[i] = heap_node[i], heap_node[best]
        heap_seq[best], heap_seq[i] = heap_seq[i], heap_seq[best]
        i = best
    return size


_I64, _F64 = np.int64, np.float64
# ``TreeBuffers`` as an ``ArrayTable`` for ``_grow_best_first_table``: (dtype,
# dimensions) by row, in ``_grow_best_first``'s order (``span``, ``cand_tok`` ..
# ``seq``, ``out_tok`` .. ``out_p``).
_BEST_FIRST_TABLE = ((_I64, 1), (_I64, 2), (_F64, 2), (_I64, 1), (_I64, 1), (_I64, 1),
                     (_I64, 1), (_F64, 1), (_I64, 1), (_F64, 1), (_I64, 1), (_I64, 1),
                     (_I64, 1), (_I64, 1), (_I64, 1), (_F64, 1))


@cached_njit
def _grow_best_first_table(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, budget, min_lp,
                           n_span, lp_span, t):
    """``_grow_best_first`` with the builder's buffers as a table: a tree
    is built every drafting step, after a forward."""
    return _grow_best_first(
        ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, budget, min_lp, vec(t, 0, _I64),
        n_span, lp_span, mat(t, 1, _I64), mat(t, 2, _F64), vec(t, 3, _I64), vec(t, 4, _I64),
        vec(t, 5, _I64), vec(t, 6, _I64), vec(t, 7, _F64), vec(t, 8, _I64), vec(t, 9, _F64),
        vec(t, 10, _I64), vec(t, 11, _I64), vec(t, 12, _I64), vec(t, 13, _I64),
        vec(t, 14, _I64), vec(t, 15, _F64))


@cached_njit
def _grow_best_first(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, budget, min_lp,
                     span, n_span, lp_span, cand_tok, cand_lp, cand_n, next_child,
                     node_tok, node_parent, node_lp, node_span, heap_lp, heap_node,
                     heap_seq, seq, out_tok, out_parent, out_p):
    """Best-first tree; internal node u + 1 is output node u. Returns the
    node count."""
    node_tok[0] = tail[len(tail) - 1]
    node_parent[0] = -1
    node_lp[0] = 0.0
    node_span[0] = 0 if n_span > 0 else -1
    next_child[0] = 0
    _node_candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, 0, node_tok,
                     node_parent, node_span, span, n_span, lp_span, seq, cand_tok,
                     cand_lp, cand_n)
    size, pushes, n = 0, 0, 0
    if cand_n[0] > 0:
        size = _heap_push(heap_lp, heap_node, heap_seq, size, cand_lp[0, 0], 0, pushes)
        pushes += 1
    while size > 0 and n < budget:
        lp, u = heap_lp[0], heap_node[0]
        size = _heap_pop(heap_lp, heap_node, heap_seq, size)
        if lp < min_lp:
            break
        c = next_child[u]
        v = n + 1
        tok = cand_tok[u, c]
        node_tok[v] = tok
        node_parent[v] = u
        node_lp[v] = lp
        node_span[v] = _child_span(node_span, span, n_span, u, tok)
        next_child[v] = 0
        out_tok[n] = tok
        out_parent[n] = u - 1
        out_p[n] = math.exp(cand_lp[u, c])
        n += 1
        next_child[u] = c + 1
        if c + 1 < cand_n[u]:
            size = _heap_push(heap_lp, heap_node, heap_seq, size,
                              node_lp[u] + cand_lp[u, c + 1], u, pushes)
            pushes += 1
        if n < budget:
            _node_candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, v,
                             node_tok, node_parent, node_span, span, n_span, lp_span,
                             seq, cand_tok, cand_lp, cand_n)
            if cand_n[v] > 0:
                size = _heap_push(heap_lp, heap_node, heap_seq, size,
                                  lp + cand_lp[v, 0], v, pushes)
                pushes += 1
    return n


@cached_njit
def _grow_template(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, t_parent, t_rank,
                   min_lp, span, n_span, lp_span, cand_tok, cand_lp, cand_n, node_tok,
                   node_parent, node_lp, node_span, seq, out_tok, out_parent, out_p):
    """The template's nodes whose parent is present and has a candidate of
    their rank (and whose path probability reaches ``min_lp``). Internal
    node u + 1 is template node u; ``node_parent`` then holds the output
    index of each present template node (-2: absent)."""
    node_tok[0] = tail[len(tail) - 1]
    node_parent[0] = -1  # as an output index: the root
    node_lp[0] = 0.0
    node_span[0] = 0 if n_span > 0 else -1
    _node_candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, 0, node_tok,
                     node_parent, node_span, span, n_span, lp_span, seq, cand_tok,
                     cand_lp, cand_n)
    n = 0
    out_index = np.full(len(t_parent) + 1, -2, np.int64)
    out_index[0] = -1
    for i in range(len(t_parent)):
        u = t_parent[i] + 1
        v = i + 1
        cand_n[v] = 0
        if out_index[u] == -2 or t_rank[i] >= cand_n[u]:
            continue
        lp = node_lp[u] + cand_lp[u, t_rank[i]]
        if lp < min_lp:
            continue
        tok = cand_tok[u, t_rank[i]]
        node_tok[v] = tok
        node_parent[v] = u
        node_lp[v] = lp
        node_span[v] = _child_span(node_span, span, n_span, u, tok)
        out_tok[n] = tok
        out_parent[n] = out_index[u]
        out_p[n] = math.exp(cand_lp[u, t_rank[i]])
        out_index[v] = n
        n += 1
        _node_candidates(ids, logp, ctx_key, ctx_tok, ctx_logp, order, tail, v, node_tok,
                         node_parent, node_span, span, n_span, lp_span, seq, cand_tok,
                         cand_lp, cand_n)
    return n


def warm_up() -> None:
    """Compile (or load from numba's cache) the builders on toy tables."""
    t = RecyclingTables(8, 2, 2, 16)
    t.learn_rows(np.array([1, 2]), np.array([[2, 3], [3, 1]]),
                 np.log(np.array([[0.6, 0.3], [0.5, 0.4]], np.float32)))
    t.learn_context(np.array([1, 2, 3]), 2, 3, 0.0)
    for builder in BUILDERS:
        TreeBuilder(t, builder, True).build(np.array([1, 2, 1, 2]), 4, 0.0)
