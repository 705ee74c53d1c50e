"""Goodput for draft trees: which nodes of each request's tree to verify.

The ``goodput`` policy's rule, with a tree's nodes as the candidates. A
node's conditional acceptance (P(accepted | its parent accepted)) is the
proposer's confidence calibrated per (depth, confidence bucket), as a
chain draft's is per (position, bucket); its path probability q is the
product along its path, and the expected tokens of a step are B plus the
sum of q over the kept nodes (the accepted length is the number of kept
nodes on the accepted path). q never grows down a path, so the M nodes of
highest q are closed under ancestors and ``goodput_allocation`` applies
over nodes ranked by q. Each step weighs two shapes: the ranked nodes as a
tree, whose step pays the fitted ``tree_step_s`` (the bridge's masked
attention rows and K/V moves), and each tree's best path re-laid as a
chain, which vLLM verifies on its own path. Where verified tokens are
nearly free (a GPU) trees grow; where each costs nearly a token's forward
(this CPU) the rule keeps what pays, down to a chain or nothing.

Every node whose parent is on the accepted path is observed exactly, kept
or not: the target emitted its own token after that parent. So tree rows
need no probes, and the calibration sees the nodes the rule cut.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllm_plugins.proposers.draft_length.acceptance import EPS
from vllm_plugins.proposers.draft_length.calibration import OutcomeCalibrator
from vllm_plugins.proposers.draft_length.controllers import Observation, trim
from vllm_plugins.proposers.draft_length.goodput import GoodputController, goodput_allocation
from vllm_plugins.proposers.draft_length.tree_kernels import (lay_out, price_tree, read_tree,
                                                              well_formed)

if TYPE_CHECKING:
    from vllm_plugins.step_context import Drafts, StepContext

TREE, CHAIN = "tree", "chain"
_NO_EDGES = np.zeros(0)


def tree_allocation(q: np.ndarray, valid: np.ndarray, q_chain: np.ndarray,
                    valid_chain: np.ndarray, intercept: float, slope: float,
                    verify_step_s: float = 0.0, tree_step_s: float = 0.0,
                    new_shape_s: float = 0.0, warm_tokens: np.ndarray | None = None
                    ) -> tuple[np.ndarray, float, float, str]:
    """The better of the step's two shapes: (kept per row, expected
    goodput, expected tokens, ``TREE`` or ``CHAIN``).

    ``q``/``valid``: per row the candidates in the order they are kept, a
    tree row's nodes ranked by path probability (``select.rank_nodes``), a
    chain row's drafts; ``q_chain``/``valid_chain``: the same with each tree
    row replaced by its best path (``select.best_path``). The tree shape pays
    ``tree_step_s`` on top of ``verify_step_s``. Exact over every choice of
    node sets closed under ancestors whose rows that keep a path keep their
    best path's: a tree allocation that keeps only paths keeps the best
    paths (the M nodes of highest q form a path only along it), which the
    chain allocation prices without the tree term, so charging the term to
    every tree allocation never loses the optimum.
    """
    as_tree = goodput_allocation(q, valid, intercept, slope, verify_step_s + tree_step_s,
                                 new_shape_s, warm_tokens)
    as_chain = goodput_allocation(q_chain, valid_chain, intercept, slope, verify_step_s,
                                  new_shape_s, warm_tokens)
    if as_tree[1] > as_chain[1]:
        return (*as_tree, TREE)
    return (*as_chain, CHAIN)


@dataclass
class TreeRow:
    """One request's offered tree at ``decide``."""

    index: int              # batch row
    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray       # root children at 1
    conf: np.ndarray        # the proposer's conditional confidence per node
    q_raw: np.ndarray       # path probability before its calibration
    q: np.ndarray           # as the rule reads it (non-increasing down a path)
    ranked: np.ndarray      # the tree shape's node order
    path: list[int]         # the chain shape's nodes
    q_ranked: np.ndarray    # q of the ranked nodes, in that order
    q_path: np.ndarray      # q of the path's nodes


@dataclass
class SentTree:
    """What a request's next step is read against: its offered tree and the
    nodes sent, in the order sent."""

    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray
    conf: np.ndarray
    q_raw: np.ndarray
    layout: np.ndarray
    tree: bool              # sent as a tree (not a chain)
    context_len: int        # the request's context when it was drafted


@dataclass
class TreeStep:
    """The tree rows of the step being decided, for ``_choose``."""

    rows: list[TreeRow]
    q_chain: np.ndarray     # the batch's candidates with trees as their best paths
    valid_chain: np.ndarray
    lengths_chain: np.ndarray
    mode: str = TREE
    layouts: dict = field(default_factory=dict)


class TreeGoodputController(GoodputController):
    """``goodput`` with tree drafts chosen node by node (docs/draft_length_design.md,
    "Trees"). Rows without a tree (chains, or a proposer that does not let
    the policy shape its trees) go through ``GoodputController`` unchanged,
    in the same allocation."""

    name = "goodput"
    _TREE_PROBE_GAP = 64   # steps: at most 1 in 64 forced to verify trees
    # A tree row's node budget: twice the nodes it kept last step, plus this
    # many, so the proposer builds what the rule can keep and the nodes just
    # past its cut (which calibration learns the cut from), not the whole
    # ``num_speculative_tokens`` every step (``max_length``).
    _NODE_MARGIN = 4

    def __init__(self, max_draft: int, options: dict):
        super().__init__(max_draft, options)
        self.path_calibration = OutcomeCalibrator() if options["calibrate_prefix"] else None
        self._sent: dict[str, SentTree] = {}
        self._step_trees: TreeStep | None = None
        self._layouts: dict[int, tuple[list[int], list[int]]] = {}
        self._verified_a_tree = False
        self._tree_probe_at = -self._TREE_PROBE_GAP
        self.tree_probes = 0
        self._kept_nodes: dict[str, int] = {}   # request -> nodes its tree kept last step
        self.tree_rows = 0            # request-steps that offered a tree
        self.tree_nodes_offered = 0
        self.tree_nodes_kept = 0
        self.tree_nodes_observed = 0
        self.shape_steps = {TREE: 0, CHAIN: 0}   # steps that kept tree nodes, by shape

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self._sent.pop(req_id, None)
        self._kept_nodes.pop(req_id, None)

    def max_length(self, req_id: str, observation: Observation) -> int:
        """A tree row's node budget, from what it kept last step (the
        builders are best-first, so the first nodes are the ones the rule
        keeps); the whole budget on exploring steps and tree probes, and for
        a request whose tree has not been read yet."""
        bound = super().max_length(req_id, observation)
        kept = self._kept_nodes.get(req_id)
        if kept is None or observation.explore_cap is not None or self._tree_probe_due():
            return bound
        return min(bound, 2 * kept + self._NODE_MARGIN)

    # ------------------------------------------------------------ observe
    def _learn_trees(self, ctx: StepContext, rows: np.ndarray):
        """Outcomes of every observed node of the trees sent last step."""
        self._verified_a_tree = False
        if not self._sent:
            return None, None
        reqs = ctx.requests
        trees = np.zeros(len(reqs), dtype=bool)
        r_rows, r_counts, j_idx, conf, outcome, q_used, q_outcome = [], [], [], [], [], [], []
        roots, roots_q = [], []   # per tree: a root child accepted, and its foreseen q
        for i, r in enumerate(reqs):
            sent = self._sent.pop(r.req_id, None)
            if sent is None:
                continue
            trees[i] = True
            emitted = np.asarray(r.accepted, np.int64)
            if len(emitted) == 0 or len(r.context) - len(emitted) != sent.context_len:
                continue   # not the step these drafts were verified in
            # The accepted path, the observed nodes (the root's children
            # always) and their outcomes, and the path outcomes of the
            # verified nodes and of the cut ones observed (tree_kernels).
            found, verified_tree, root_hit, idx, depth_j, conf_i, outcome_i, q_i, x_i = \
                read_tree(sent.tokens, sent.parents, sent.depth, sent.conf, sent.q_raw,
                          sent.layout, int(r.num_draft), emitted)
            if sent.tree and verified_tree:
                self._verified_a_tree = True
            if not found:
                continue
            if self.counting_free:
                roots.append(root_hit)
                roots_q.append(min(1.0, float(sent.q_raw[sent.depth == 1].sum())))
            r_rows.append(i)
            r_counts.append(len(idx))
            j_idx.append(depth_j)
            conf.append(conf_i)
            outcome.append(outcome_i)
            self.tree_nodes_observed += len(idx)
            q_used.append(q_i)
            q_outcome.append(x_i)
        if roots:
            self._free_outcome(np.array(roots), np.array(roots_q))
        if not trees.any():
            return None, None
        if len(r_rows) == 1:   # the common case: one tree read
            if self.path_calibration is not None:
                self.path_calibration.learn(q_used[0], q_outcome[0])
            return trees, (np.full(r_counts[0], r_rows[0], np.int64), j_idx[0], conf[0],
                           outcome[0])
        if self.path_calibration is not None and q_used:
            self.path_calibration.learn(np.concatenate(q_used), np.concatenate(q_outcome))
        if not r_rows:
            return trees, None
        r_idx = np.repeat(np.asarray(r_rows, np.int64), r_counts)
        return trees, (r_idx, *(np.concatenate(a) for a in (j_idx, conf, outcome)))

    def _verified_tree(self, ctx: StepContext) -> bool:
        return self._verified_a_tree

    # ------------------------------------------------------------- decide
    def shape(self, ctx: StepContext, drafts: Drafts, observation: Observation) -> Drafts:
        self._layouts = {}
        keep = self.decide(ctx, drafts, observation)
        layouts, self._layouts = self._layouts, {}
        out = trim(drafts, keep)
        for i, (nodes, parents) in layouts.items():
            out.tokens[i] = [int(drafts.tokens[i][v]) for v in nodes]
            out.confidence[i] = np.asarray(drafts.confidence[i])[nodes]
            out.parents[i] = parents
        return out

    def _tree_rows(self, drafts: Drafts, lengths: np.ndarray) -> np.ndarray | None:
        """Rows whose draft is a tree this policy reads node by node: with
        parents and confidences, without probability rows (a stochastic
        tree's acceptance is not what its tokens show), and well formed;
        None where no row can be (chains: the common step)."""
        if (not self.shapes_trees or not self.uses_confidence or drafts.parents is None
                or drafts.confidence is None):
            return None
        out = np.zeros(len(lengths), dtype=bool)
        for i, n in enumerate(lengths):
            if n == 0 or i >= len(drafts.parents) or drafts.parents[i] is None \
                    or drafts.confidence[i] is None:
                continue
            if drafts.probs is not None and i < len(drafts.probs) \
                    and drafts.probs[i] is not None:
                continue
            if len(drafts.confidence[i]) >= n and \
                    well_formed(np.asarray(drafts.parents[i][:n], np.int64), n):
                out[i] = True
        return out

    def _keep(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray,
              observation: Observation, bound: np.ndarray) -> np.ndarray:
        trees = self._tree_rows(drafts, lengths)
        if trees is None or not trees.any():
            return super()._keep(ctx, drafts, lengths, observation, bound)
        rows = self._rows(ctx, lengths, observation)
        chain_lengths = np.where(trees, 0, lengths)
        tree_rows = self._candidates(rows, drafts, lengths, trees)
        # A few rows: Python's max is cheaper than numpy's reduction.
        batch, chain_width = len(lengths), max(chain_lengths.tolist())
        width = max(chain_width, max(len(t.tokens) for t in tree_rows))
        q = np.zeros((batch, width))
        q_raw = conf = None
        if chain_width:
            qc, q_raw, conf = self._prefix_probs(rows, drafts, chain_width, observation)
            q[:, :chain_width] = np.where(trees[:, None], 0.0, qc)
        valid = self._prefixes[chain_lengths, :width]
        q_chain, valid_chain = q.copy(), valid.copy()
        lengths_chain = chain_lengths.copy()
        for t in tree_rows:
            n, k = len(t.tokens), len(t.path)
            q[t.index, :n] = t.q_ranked
            valid[t.index, :n] = True
            q_chain[t.index, :k] = t.q_path
            valid_chain[t.index, :k] = True
            lengths_chain[t.index] = k
        step = self._step_trees = TreeStep(tree_rows, q_chain, valid_chain, lengths_chain)
        try:
            keep = self._choose(lengths, q, valid, observation)
        finally:
            self._step_trees = None
        keep = np.minimum(keep, lengths if step.mode == TREE else lengths_chain)
        kept = self._settle(rows, drafts, chain_lengths, np.where(trees, 0, keep), bound,
                            q_raw, conf)
        self._lay_out(ctx, rows, step, keep)
        return np.where(trees, keep, kept)

    def _candidates(self, rows: np.ndarray, drafts: Drafts, lengths: np.ndarray,
                    trees: np.ndarray) -> list[TreeRow]:
        """Each tree row's nodes with their calibrated path probabilities,
        ranked (the tree shape) and its best path (the chain shape)."""
        calibrator = self.calibrator
        tables = (*calibrator.kernel_state()[1:8], EPS)
        cal = self.path_calibration
        calibrate = cal is not None
        outcomes = ((OutcomeCalibrator.EDGES, cal.s, cal.e) if calibrate
                    else (_NO_EDGES, _NO_EDGES, _NO_EDGES))
        out = []
        for i in np.nonzero(trees)[0].tolist():
            n = int(lengths[i])
            parents = np.asarray(drafts.parents[i][:n], np.int64)
            conf = np.asarray(drafts.confidence[i][:n], np.float64)
            depth, q_raw, q, ranked, path, q_ranked, q_path = price_tree(
                parents, conf, int(rows[i]), calibrator.depth - 1, *tables, calibrate,
                *outcomes, OutcomeCalibrator._STRENGTH, EPS, 1.0 - EPS)
            out.append(TreeRow(i, np.asarray(drafts.tokens[i][:n], np.int64), parents, depth,
                               conf, q_raw, q, ranked, path.tolist(), q_ranked, q_path))
        return out

    def _choose(self, lengths, q, valid, observation) -> np.ndarray:
        step = self._step_trees
        if step is None or observation.explore_cap is None:
            return super()._choose(lengths, q, valid, observation)
        # Exploring: both shapes, so the step model sees tree steps and chain
        # steps of many sizes.
        self.explore_steps += 1
        step.mode = TREE if self.rng.random() < 0.5 else CHAIN
        return np.minimum(lengths if step.mode == TREE else step.lengths_chain,
                          observation.explore_cap)

    def _allocate(self, q, valid, intercept, slope):
        step = self._step_trees
        if step is None:
            return super()._allocate(q, valid, intercept, slope)
        cost, sizes = self.cost, self.sizes.array()
        if self._tree_probe_due():
            # The tree-step cost is fitted only while the window holds a few
            # tree steps: verify the tree the rule would take were it free.
            self._tree_probe_at = self.steps
            self.tree_probes += 1
            step.mode = TREE
            return goodput_allocation(q, valid, intercept, slope, cost.verify_step_s,
                                      cost.new_shape_s, sizes)
        keep, goodput, tokens, step.mode = tree_allocation(
            q, valid, step.q_chain, step.valid_chain, intercept, slope, cost.verify_step_s,
            cost.tree_step_s, cost.new_shape_s, sizes)
        return keep, goodput, tokens

    def _tree_probe_due(self) -> bool:
        return (self.cost.warm and self.steps - self._tree_probe_at >= self._TREE_PROBE_GAP
                and self.cost.needs_tree_step())

    def _lay_out(self, ctx: StepContext, rows: np.ndarray, step: TreeStep,
                 keep: np.ndarray) -> None:
        """Each tree row's kept nodes in the order sent, and what its next
        step is read against."""
        kept_any = False
        for t in step.rows:
            k = int(keep[t.index])
            if step.mode == TREE:
                layout = t.ranked[:k]
                relaid, tree = lay_out(t.parents, layout)
                if len(relaid) != k:
                    _select().relaid_parents(t.parents, layout)   # raises, naming the node
                nodes, parents = layout.tolist(), relaid.tolist()
            else:
                nodes = t.path[:k]
                parents = list(range(-1, k - 1))
                layout, tree = np.asarray(nodes, np.int64), False
            self._layouts[t.index] = (nodes, parents)
            self._kept_nodes[ctx.requests[t.index].req_id] = k
            r = ctx.requests[t.index]
            self._sent[r.req_id] = SentTree(
                t.tokens, t.parents, t.depth, t.conf, t.q_raw, layout, tree, len(r.context))
            self.tree_rows += 1
            self.tree_nodes_offered += len(t.tokens)
            self.tree_nodes_kept += k
            kept_any = kept_any or k > 0
        if kept_any:
            self.shape_steps[step.mode] += 1
        # Confidences come with the drafts: no length bound from history.
        self.slots.arrays["conf_seen"][rows[[t.index for t in step.rows]]] = True

    def stats(self) -> dict:
        out = super().stats()
        rows = self.tree_rows
        out["trees"] = {
            "rows": rows,
            "mean_nodes_offered": self.tree_nodes_offered / rows if rows else 0.0,
            "mean_nodes_kept": self.tree_nodes_kept / rows if rows else 0.0,
            "tree_steps": self.shape_steps[TREE],
            "chain_steps": self.shape_steps[CHAIN],
            "tree_probes": self.tree_probes,
            "nodes_observed": self.tree_nodes_observed,
            "path_calibration": None if self.path_calibration is None
            else self.path_calibration.table(),
        }
        return out


def _select():
    """``vllm_plugins.tree.select``, imported on first use: the tree package
    imports torch, which the chain policies (and the simulator) never need."""
    from vllm_plugins.tree import select

    return select

