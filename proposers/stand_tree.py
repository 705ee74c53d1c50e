"""STAND's tree draft: Gumbel-top-k children from its n-gram store, grown
best-first by estimated path acceptance.

A chain spends its whole budget on one guess per position. STAND's entries
hold the target's own next-token distributions, so when the first guess at a
node is wrong the second or third is often right; a tree verifies them in the
same forward. Nodes come out in the order they were drawn (a topological
order, parents before children) with their parents, which is the layout of
vllm_plugins.tree.

How a node is chosen, and why it keeps sampled output exact
(vllm_plugins.tree.acceptance.sample_accept_with_probs):

* A slot is "the next child of node u". Its score, the estimated probability
  that the path through that child is accepted, is computed from what was
  drawn before the slot opens: u's path score, the calibrated confidence of
  u's entry, and (sampled requests) the draft mass u's earlier children
  already took. The best slot is opened next, and only then is its token
  drawn. So whether a node exists never depends on its own token, only on
  tokens drawn before it (rule 2 of docs/stand.md, for trees); a node's token
  does decide how its own children score, which is allowed.
* Sampled requests: a node's children are a Gumbel-top-k draw from the
  tempered entry q, revealed in decreasing perturbed score, which is a
  sequence of draws without replacement from q in node order. Each child's
  row is q itself (siblings share it), the distribution the acceptance rule
  conditions on the earlier siblings.
* Greedy requests: children are the entry's tokens by rank (greedy
  acceptance needs no rows).

Slot scores never increase from one opened slot to the next (children and
later siblings score at most what opened them), so any prefix of the nodes is
the best tree of its size under these scores, and ``confidence[j] =
score[j] / score[j - 1]``: a chain draft-length controller's running product
of confidences is then each node's own estimated acceptance, and its prefix
cut keeps the best nodes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from vllm_plugins.proposers.stand_draws import draft_distribution
from vllm_plugins.proposers.stand_store import NgramStore


@dataclass
class StandTree:
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Sampled requests: per node (support ids, q over them), the distribution
    # the node was drawn from at its parent; siblings share one.
    rows: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)
    # Per node: score / previous node's score (see the module docstring).
    confidence: list[float] = field(default_factory=list)
    # Per node: estimated probability that its whole path is accepted.
    scores: list[float] = field(default_factory=list)
    # Per node: (calibration kind, entry score) of the entry it was drawn from.
    kinds: list[tuple[int, float]] = field(default_factory=list)
    hits: int = 0
    misses: int = 0


@dataclass
class _Expansion:
    """A node whose children may be drawn: its entry, read when it was added."""

    seq: list[int]
    path_score: float
    ids: np.ndarray
    q: np.ndarray            # sampled: tempered q (float32); greedy: stored p
    order: np.ndarray        # children's tokens' positions in ids, in draw order
    kind: int
    entry_score: float
    conf: float              # calibrated confidence of the entry
    taken: float = 0.0       # q mass of the children already drawn


def grow_tree(store: NgramStore, tail, budget: int, *, sampled: bool,
              temperature: float, top_k: int, top_p: float,
              rng: np.random.Generator | None, max_order: int, calibration,
              calibrate: bool, min_path_prob: float) -> StandTree:
    """Up to ``budget`` nodes after the context ``tail``; slots scoring under
    ``min_path_prob`` are not opened (the chain's stopping rule)."""
    tree = StandTree()
    expansions: list[_Expansion] = []
    heap: list[tuple[float, int, int, int]] = []  # (-score, tie, expansion, rank)

    def expand(seq: list[int], path_score: float) -> None:
        slot, order = store.find(seq[-max_order:], max_order)
        if slot < 0:
            tree.misses += 1
            return
        tree.hits += 1
        ids, p = store.entry(slot)
        if len(ids) == 0:
            return
        if sampled:
            q, entry_score = draft_distribution(p, temperature, top_k, top_p)
            ids = ids[:len(q)]
            q64 = q.astype(np.float64) / float(q.astype(np.float64).sum())
            with np.errstate(divide="ignore"):
                keys = np.log(q64) - np.log(-np.log(rng.random(len(q64))))
            draw_order = np.argsort(-keys, kind="stable")
            draw_order = draw_order[q64[draw_order] > 0]
        else:
            q, entry_score = p, float(p[0])
            draw_order = np.arange(len(ids))
        kind = calibration.kind(sampled, order, store.is_seed(slot))
        conf = calibration.confidence(kind, entry_score) if calibrate else entry_score
        expansions.append(_Expansion(list(seq), path_score, ids, q, draw_order,
                                     kind, entry_score, conf))
        _push(len(expansions) - 1, 0)

    def slot_score(e: _Expansion, rank: int) -> float:
        if sampled:  # the draft mass not yet taken by earlier siblings
            return e.path_score * e.conf * max(1.0 - e.taken, 0.0)
        if rank == 0:
            return e.path_score * e.conf
        score = float(e.q[rank])
        c = calibration.confidence(e.kind, score) if calibrate else score
        return e.path_score * c

    def _push(index: int, rank: int) -> None:
        e = expansions[index]
        if rank >= len(e.order):
            return
        score = slot_score(e, rank)
        if score >= min_path_prob and score > 0.0:
            heapq.heappush(heap, (-score, len(tree.tokens) * 64 + rank, index, rank))

    parent_of = [-1]  # expansion index -> node index (-1: the root)
    expand([int(x) for x in tail], 1.0)
    previous = 1.0
    while heap and len(tree.tokens) < budget:
        neg, _, index, rank = heapq.heappop(heap)
        score = -neg
        e = expansions[index]
        pos = int(e.order[rank])
        token = int(e.ids[pos])
        node = len(tree.tokens)
        tree.tokens.append(token)
        tree.parents.append(parent_of[index])
        if sampled:
            tree.rows.append((e.ids, e.q))
            e.taken += float(e.q[pos])
        tree.scores.append(score)
        tree.confidence.append(min(score / previous, 1.0) if previous > 0 else 0.0)
        tree.kinds.append((e.kind, e.entry_score))
        previous = score
        _push(index, rank + 1)  # the next sibling, scored with this one taken
        before = len(expansions)
        expand(e.seq + [token], score)
        if len(expansions) > before:
            parent_of.append(node)
    return tree


def dense_rows(rows: list[tuple[np.ndarray, np.ndarray]], vocab_size: int) -> np.ndarray:
    """[nodes, vocab] float32 rows; siblings' rows come out equal, which is how
    the acceptance rule knows they were drawn from one q without replacement."""
    out = np.zeros((len(rows), vocab_size), dtype=np.float32)
    for j, (ids, q) in enumerate(rows):
        out[j, ids] = q
    return out


def observed_nodes(parents: list[int], tokens: list[int], emitted) -> list[tuple[int, bool]]:
    """(node, accepted) for the nodes whose verdict the emitted tokens show.

    The accepted path is read back by matching emitted tokens to children
    (STAND's siblings never repeat a token). At each node on the path, the
    children tried before the accepted one were rejected; at the path's end
    every child was tried and rejected. Later siblings were never tried."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent + 1].append(i)
    out: list[tuple[int, bool]] = []
    row = 0
    for x in list(emitted):
        child = next((c for c in kids[row] if tokens[c] == int(x)), None)
        for c in kids[row]:
            if c == child:
                break
            out.append((c, False))
        if child is None:
            return out
        out.append((child, True))
        row = child + 1
    return out
