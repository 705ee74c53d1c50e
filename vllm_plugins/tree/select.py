"""Choosing which nodes of a drafted tree to verify, and laying them out.

A controller that verifies part of a tree must hand on a tree: a node set
closed under ancestors, numbered so that each parent comes before its
children. Ranking nodes by their path probability q (the probability that
the node is on the accepted path) does that by itself: a node's q never
exceeds its parent's, so with ties going to the lower index every leading
set of the ranking is closed under ancestors, and the ranking is itself a
topological order. Laid out in that order, any prefix the scheduler cuts
keeps the most probable nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vllm_plugins.tree.draft import ROOT, depths


def path_probabilities(parents: Sequence[int], conditional: Sequence[float]
                       ) -> np.ndarray:
    """q[i]: the product of ``conditional`` over node i's path from the
    root (``conditional[i]``: P(node i accepted | its parent accepted))."""
    q: list[float] = []
    for parent, c in zip(_ints(parents), np.asarray(conditional, np.float64).tolist()):
        q.append(c if parent == ROOT else q[parent] * c)
    return np.asarray(q, np.float64)


def cap_by_parent(parents: Sequence[int], q: Sequence[float]) -> np.ndarray:
    """``q`` with each node's value capped by its parent's, so that it is
    non-increasing down every path (a per-node correction of path
    probabilities may break that)."""
    out: list[float] = []
    for parent, v in zip(_ints(parents), np.asarray(q, np.float64).tolist()):
        out.append(v if parent == ROOT else min(v, out[parent]))
    return np.asarray(out, np.float64)


def rank_nodes(q: np.ndarray) -> np.ndarray:
    """Node indices by descending q, ties by index. With q non-increasing
    down every path, every prefix of the result is closed under ancestors."""
    q = np.asarray(q, np.float64)
    return np.lexsort((np.arange(len(q)), -q))


def best_path(parents: Sequence[int], q: Sequence[float]) -> list[int]:
    """The path that descends from the root through the child of highest q
    at every node (ties: the lower index), down to a leaf."""
    best: dict[int, int] = {}
    q = np.asarray(q, np.float64).tolist()
    for i, parent in enumerate(_ints(parents)):
        b = best.get(parent)
        if b is None or q[i] > q[b]:
            best[parent] = i
    path = []
    node = best.get(ROOT)
    while node is not None:
        path.append(node)
        node = best.get(node)
    return path


def is_closed(parents: Sequence[int], nodes: Sequence[int]) -> bool:
    """Whether every node's parent comes earlier in ``nodes`` (or is the
    root): the list, in its order, is a tree."""
    seen = set()
    for v in nodes:
        parent = parents[v]
        if parent != ROOT and parent not in seen:
            return False
        seen.add(v)
    return True


def relaid_parents(parents: Sequence[int], nodes: Sequence[int]) -> list[int]:
    """The parent list of the tree made of ``nodes`` in that order (each
    node's parent must come earlier in it: ``is_closed``); node k of the
    result is ``nodes[k]``."""
    index = {int(v): k for k, v in enumerate(nodes)}
    out = []
    for k, v in enumerate(nodes):
        parent = int(parents[v])
        if parent == ROOT:
            out.append(ROOT)
            continue
        p = index.get(parent)
        if p is None or p >= k:
            raise ValueError(f"tree selection: node {int(v)} comes before its parent "
                             f"{parent} or without it")
        out.append(p)
    return out


def accepted_path(tokens: Sequence[int], parents: Sequence[int], verified: Sequence[int],
                  emitted: Sequence[int]) -> list[int] | None:
    """The nodes the target accepted, from the tokens it emitted.

    ``verified``: the nodes that were verified, in the order they were
    laid out; ``emitted``: the accepted path's tokens plus one. At each
    depth the accepted node carries the token the target emitted after the
    path so far, and the path ends where no verified child carries the
    next one. Where sibling tokens repeat, the first path in layout order
    that fits (``vllm_plugins.tree.acceptance``'s tie rule). None when the
    emitted tokens are no such path (they came from another verification).
    """
    kids: dict[int, list[int]] = {}
    for v in verified:
        kids.setdefault(int(parents[v]), []).append(int(v))
    emitted = [int(t) for t in emitted]
    if not emitted:
        return None
    m = len(emitted) - 1

    def walk(node: int, depth: int) -> list[int] | None:
        if depth == m:   # the last emitted token must match no child
            fits = all(int(tokens[c]) != emitted[m] for c in kids.get(node, ()))
            return [] if fits else None
        for c in kids.get(node, ()):
            if int(tokens[c]) == emitted[depth]:
                rest = walk(c, depth + 1)
                if rest is not None:
                    return [c, *rest]
        return None

    return walk(ROOT, 0)


def node_outcomes(tokens: Sequence[int], parents: Sequence[int], path: Sequence[int],
                  emitted: Sequence[int], node_depths: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(observed, accepted) per node, given the accepted ``path``.

    A node whose parent is on the accepted path (or is the root) is
    observed: the target emitted its own token after that parent, and the
    node would be accepted exactly when its token is that one (under
    greedy decoding its outcome; for a deterministic draft under sampling,
    an exact draw of it), whether or not the node itself was verified.
    Deeper nodes are censored. ``node_depths``: ``depths(parents)`` if
    known."""
    n = len(parents)
    on_path = np.zeros(n + 1, dtype=bool)   # index parent + 1; 0 = the root
    on_path[0] = True
    for v in path:
        on_path[int(v) + 1] = True
    par = np.asarray(parents, np.int64)
    observed = on_path[par + 1]
    d = np.asarray(depths(parents) if node_depths is None else node_depths, np.int64)
    emitted = np.asarray(emitted, np.int64)
    accepted = np.zeros(n, dtype=bool)
    idx = np.nonzero(observed)[0]
    if len(idx):
        accepted[idx] = np.asarray(tokens, np.int64)[idx] == emitted[d[idx] - 1]
    return observed, accepted


def _ints(values: Sequence[int]) -> list[int]:
    """Python ints (numpy scalars make the node loops several times slower)."""
    return values.tolist() if isinstance(values, np.ndarray) else [int(v) for v in values]
