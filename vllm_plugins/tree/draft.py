"""A request's tree draft as a parent list.

Nodes are numbered in topological order (``parents[i] < i``) and the root,
the request's last committed token, is -1. Keeping the tree as one flat list
is what lets the scheduler cut any draft to a prefix and still hold a tree,
and lets the verification step lay nodes out as rows: row 0 is the root and
row ``i + 1`` is node ``i``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ROOT = -1


def chain_parents(n: int) -> list[int]:
    """A chain of n drafts: the tree every chain proposer already returns."""
    return list(range(-1, n - 1))


def chain_length(parents: Sequence[int]) -> int:
    """How many leading nodes form a chain from the root."""
    n = 0
    for i, p in enumerate(parents):
        if int(p) != i - 1:
            break
        n += 1
    return n


def validate(parents: Sequence[int]) -> None:
    """Raise ValueError naming the first node whose parent breaks the layout.

    Everything downstream (masks, positions by depth, acceptance walks)
    assumes topological order, so a bad list must fail here, loudly.
    """
    for i, parent in enumerate(parents):
        parent = int(parent)
        if parent < ROOT:
            raise ValueError(f"tree draft: node {i} has parent {parent}; "
                             "parents are node indices or -1 for the root")
        if parent >= i:
            raise ValueError(f"tree draft: node {i} has parent {parent}; a "
                             "parent must come before its child (parents[i] < i)")


def depths(parents: Sequence[int]) -> list[int]:
    """Depth per node, root children at 1: a node's rotary position is the
    root's position plus its depth, whatever its index."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent == ROOT else out[parent] + 1)
    return out


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """Node indices from the root's child down to ``node`` (empty for the root)."""
    path = []
    while node != ROOT:
        path.append(node)
        node = parents[node]
    return path[::-1]


def children(parents: Sequence[int]) -> list[list[int]]:
    """Children per row (row 0 the root, row i + 1 node i), in node order: the
    order siblings were drawn in, which exact sampled acceptance relies on."""
    out: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        out[parent + 1].append(i)
    return out


def ancestor_mask(parents: Sequence[int], device=None) -> torch.Tensor:
    """bool [n + 1, n + 1] over root + nodes (row = query, column = key):
    each sees the root, its ancestors and itself, so a node's hidden state is
    the one chain decoding of its path would have computed."""
    mask = torch.from_numpy(ancestor_mask_numpy(parents))
    return mask if device is None else mask.to(device)


def ancestor_mask_numpy(parents: Sequence[int]) -> np.ndarray:
    """``ancestor_mask`` as a numpy array: each row a copy of its parent's
    row with its own column set, as bytes, and one array made of them all
    (a tensor write per node, or numpy's fancy indexing, costs more than
    the whole walk after a forward has evicted their code)."""
    n = len(parents)
    root = bytearray(n + 1)
    root[0] = 1   # every row sees the root
    rows = [root]
    for i, parent in enumerate(parents):
        row = bytearray(rows[int(parent) + 1])
        row[i + 1] = 1
        rows.append(row)
    return np.frombuffer(bytearray().join(rows), np.bool_).reshape(n + 1, n + 1)
