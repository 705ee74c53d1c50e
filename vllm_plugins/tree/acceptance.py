"""Which path of each request's tree draft the target accepts, and what it emits.

Contract shared by the three rules:

- A step's requests come in batch order; request r has ``tokens[r]`` and
  ``parents[r]`` (vllm_plugins.tree.draft) and ``len(tokens[r]) + 1`` target
  rows, packed one request after another: the request's row 0 is the target
  at the root (its last committed token), row ``i + 1`` the target after node
  i. A request with no nodes has its one root row and emits one token.
- Target rows are what vLLM would sample from: probabilities after its
  processing (penalties, temperature, top-k/top-p), or argmax ids for greedy.
  The rules do no processing of their own, so a tree step samples from the
  very distribution a chain step would.
- Each returns one ``TreeAcceptance`` per request: the accepted node path
  from the root down, and the emitted tokens, which are the path's tokens and
  then one more (the target's token after the path). That is what chain
  decoding would emit for the same accepted prefix, so everything after
  (output, KV move, scheduler counts) can treat the path as a chain.
- Randomness comes from ``generators``: None (torch's default), one
  ``torch.Generator`` used for every request in order, a list with one entry
  per request (None for the default), or vLLM's ``{batch index: generator}``
  of seeded requests. A seeded request thus draws only from its own
  generator, and its output does not depend on its neighbours in the batch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_plugins.tree.draft import children


@dataclass
class TreeAcceptance:
    """One request's result: ``tokens == [draft token of n for n in nodes] +
    [one more]``."""

    nodes: list[int]
    tokens: list[int]

    @property
    def num_accepted(self) -> int:
        return len(self.nodes)


def row_starts(tokens: Sequence[Sequence[int]]) -> list[int]:
    """First target row of each request in the packed layout."""
    starts, at = [], 0
    for t in tokens:
        starts.append(at)
        at += len(t) + 1
    return starts


def draw(probs: torch.Tensor, generator=None) -> int:
    """One token from an (unnormalised) probability row by inverse CDF: one
    uniform and one cumulative sum per draw, cheaper on CPU than
    torch.multinomial over a large vocabulary. A zero-probability token is
    never drawn (the search takes the first cumulative sum above u)."""
    cdf = torch.cumsum(probs, 0, dtype=torch.float64)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    index = torch.searchsorted(cdf, u * cdf[-1], right=True)
    return int(index.clamp_(max=probs.shape[0] - 1))


def first_argmax(rows: torch.Tensor) -> torch.Tensor:
    """Per row the index of its first maximum, as ``argmax(dim=-1)`` gives
    it (ties to the lowest index, as vLLM's greedy sampler takes them; a NaN
    counts as the maximum). On the CPU numpy's ``argmax`` reads it, a
    vectorised pass an order of magnitude faster than torch's ``max`` or
    ``argmax`` over a vocabulary (bfloat16 rows, which numpy lacks, are
    read as float32, which orders them alike); elsewhere ``max``."""
    if rows.is_cpu and rows.ndim == 2:
        if rows.dtype not in (torch.float32, torch.float64, torch.float16):
            rows = rows.float()
        return torch.from_numpy(np.argmax(rows.numpy(), axis=-1))
    return rows.max(dim=-1).indices


def _generator(generators, r: int):
    if generators is None or isinstance(generators, torch.Generator):
        return generators
    if isinstance(generators, Mapping):
        return generators.get(r)
    return generators[r]


# --------------------------------------------------------------------- greedy
def greedy_accept(parents: Sequence[Sequence[int] | None],
                  tokens: Sequence[Sequence[int]],
                  target_argmax: torch.Tensor) -> list[TreeAcceptance]:
    """Longest root-down path whose every node is the target's argmax at its
    parent's row, then the argmax after it.

    This is exactly plain greedy decoding's output for as long as the path
    goes, so greedy output stays token for token that of decoding without
    drafts. Among equally long paths (only possible when siblings repeat a
    token) the first sibling in node order wins at each level.
    ``target_argmax``: argmax ids per packed row (a tensor, a host array or
    a list), or the rows themselves ([rows, vocab], argmax taken here).
    """
    if isinstance(target_argmax, torch.Tensor) and target_argmax.ndim == 2:
        target_argmax = first_argmax(target_argmax)
    # One transfer for the whole step.
    best = target_argmax if isinstance(target_argmax, list) else target_argmax.tolist()
    out = []
    for r, start in enumerate(row_starts(tokens)):
        toks = [int(t) for t in tokens[r]]
        par = _parents_of(parents, r, len(toks))
        n = len(toks)
        # Leaves first (children have larger indices): a matching node's run
        # is 1 + its best child's; each row keeps its best matching child,
        # the first in node order among equal runs (visited last here). One
        # loop of plain operations: it runs for every tree, every step.
        best_run = [0] * (n + 1)     # by row: row 0 the root, row i + 1 node i
        best_child = [-1] * (n + 1)
        for i in range(n - 1, -1, -1):
            if toks[i] == best[start + par[i] + 1]:
                run = 1 + best_run[i + 1]
                if run >= best_run[par[i] + 1]:
                    best_run[par[i] + 1] = run
                    best_child[par[i] + 1] = i
        nodes, row = [], 0
        while best_child[row] >= 0:
            row = best_child[row] + 1
            nodes.append(row - 1)
        out.append(TreeAcceptance(nodes, [toks[i] for i in nodes] + [best[start + row]]))
    return out


# ----------------------------------------------------- sampled, deterministic
def sample_accept_deterministic(parents: Sequence[Sequence[int] | None],
                                tokens: Sequence[Sequence[int]],
                                target_probs: torch.Tensor,
                                generators=None) -> list[TreeAcceptance]:
    """For drafts chosen without randomness (lookups, argmaxes, recycled
    tables): at the current node draw x from the target's row; if a child
    has token x, descend into it, else emit x and stop (at a leaf, x is the
    bonus token).

    Each emitted token is a draw from the target given the tokens before it,
    whatever the tree holds: the tree only decides how many of those draws
    one forward pass can confirm. Rows are drawn lazily along the path, so a
    step costs one draw per accepted node plus one.
    """
    out = []
    for r, start in enumerate(row_starts(tokens)):
        toks = [int(t) for t in tokens[r]]
        kids = children(_parents_of(parents, r, len(toks)))
        gen = _generator(generators, r)
        nodes, row, emitted = [], 0, []
        while True:
            x = draw(target_probs[start + row], gen)
            emitted.append(x)
            child = next((c for c in kids[row] if toks[c] == x), None)
            if child is None:
                break
            nodes.append(child)
            row = child + 1
        out.append(TreeAcceptance(nodes, emitted))
    return out


# ------------------------------------------------------ sampled, with q rows
def sample_accept_with_probs(parents: Sequence[Sequence[int] | None],
                             tokens: Sequence[Sequence[int]],
                             target_probs: torch.Tensor,
                             draft_probs: Sequence[torch.Tensor | np.ndarray | None],
                             generators=None) -> list[TreeAcceptance]:
    """Recursive rejection sampling (SpecInfer's multi-draft rule, with the
    without-replacement correction of Recursive Speculative Decoding, Jeon et
    al. 2024) over the children of each node on the path.

    ``draft_probs[r][i]`` is the distribution node i was drawn from at its
    parent (a request whose entry is None takes the deterministic rule).
    Siblings whose rows are equal were drawn from that one distribution
    without replacement, in node order (a Gumbel-top-k draw listed by
    decreasing perturbed score is such a sequence); siblings with different
    rows were drawn independently. At a node with target p, child k drawn from
    q_k -- q with the tokens of earlier siblings from the same q removed and
    renormalised, which is the distribution it was actually drawn from given
    them -- is accepted with probability min(1, p(x_k) / q_k(x_k)); on
    rejection p becomes the residual norm(max(p - q_k, 0)). When every child
    is rejected, the emitted token is drawn from the last residual. Each step
    is an ordinary exact rejection step against the current p, so the emitted
    token is distributed as the target's, and an accepted child continues the
    walk with its own target row.

    Exactness needs each child's presence in the tree to be decided before it
    was drawn (a builder may stop drawing at a node, but must not drop a drawn
    child for its value, nor reorder siblings by value) and needs the node
    order among siblings to be the draw order.
    """
    out = []
    for r, start in enumerate(row_starts(tokens)):
        toks = [int(t) for t in tokens[r]]
        par = _parents_of(parents, r, len(toks))
        gen = _generator(generators, r)
        q_rows = draft_probs[r] if draft_probs is not None else None
        if q_rows is None:
            out.extend(sample_accept_deterministic(
                [par], [toks], target_probs[start:start + len(toks) + 1], gen))
            continue
        q_rows = torch.as_tensor(q_rows, device=target_probs.device,
                                 dtype=torch.float32)
        kids = children(par)
        # One acceptance coin per node, drawn up front: one generator call.
        coins = torch.rand(len(toks), generator=gen, dtype=torch.float64,
                           device=target_probs.device).tolist()
        nodes, row = [], 0
        while True:
            p = target_probs[start + row].to(torch.float32)
            child, p = _accept_child(p, kids[row], toks, q_rows, coins)
            if child is None:
                x = draw(p, gen)
                out.append(TreeAcceptance(nodes, [toks[n] for n in nodes] + [x]))
                break
            nodes.append(child)
            row = child + 1
    return out


def _accept_child(p: torch.Tensor, kids: list[int], toks: list[int],
                  q_rows: torch.Tensor, coins: list[float]):
    """Run the children of one node: (accepted child or None, residual p)."""
    drawn: list[tuple[torch.Tensor, list[int]]] = []  # (shared q, its tokens so far)
    for child in kids:
        q = q_rows[child]
        group = next((g for g in drawn if torch.equal(g[0], q)), None)
        if group is None:
            group = (q, [])
            drawn.append(group)
        q_k = q
        if group[1]:  # drawn given the earlier siblings from this q
            q_k = q.clone()
            q_k[group[1]] = 0.0
            mass = float(q_k.sum())
            q_k = q_k / mass if mass > 0 else None
        x = toks[child]
        group[1].append(x)
        if q_k is None:
            continue  # q had nothing left to draw: not a draw from q; skip it
        qx, px = float(q_k[x]), float(p[x])
        if qx <= 0.0:
            continue  # a token q could not have drawn carries no evidence
        if coins[child] * qx < px:
            return child, p
        residual = torch.clamp(p - q_k, min=0.0)
        mass = float(residual.sum())
        if mass > 0.0:  # else p == q_k up to rounding, and rejection was rounding
            p = residual / mass
    return None, p


def _parents_of(parents, r: int, n: int) -> list[int]:
    if parents is None or parents[r] is None:
        return list(range(-1, n - 1))
    par = [int(p) for p in parents[r]]
    if len(par) != n:
        raise ValueError(f"tree draft of request {r}: {n} tokens but "
                         f"{len(par)} parents")
    return par
