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
tree, whose tokens each pay the fitted ``tree_token_s`` beyond a chain's
(the bridge's masked attention rows and K/V moves; ``tree_step_s`` a step
with ``tree_cost: "step"``), and each tree's best path re-laid as a
chain, which vLLM verifies on its own path. Where verified tokens are
nearly free (a GPU) trees grow; where each costs nearly a token's forward
(this CPU) the rule keeps what pays, down to a chain or nothing.

Every node whose parent is on the accepted path is observed exactly, kept
or not: the target emitted its own token after that parent. So tree rows
need no probes, and the calibration sees the nodes the rule cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_plugins.proposers.array_table import ArrayTable
from vllm_plugins.proposers.draft_length.acceptance import EPS
from vllm_plugins.proposers.draft_length.calibration import OutcomeCalibrator
from vllm_plugins.proposers.draft_length.controllers import Observation, trim
from vllm_plugins.proposers.draft_length.goodput import (_NO_COUNTS, _NO_SIZES,
                                                        GoodputController, _allocation,
                                                        goodput_allocation)
from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.draft_length.tree_kernels import (PRICE_SCALARS, PRICE_TABLE,
                                                              lay_out, price_tree_table,
                                                              read_tree, well_formed)

if TYPE_CHECKING:
    from vllm_plugins.step_context import Drafts, StepContext

TREE, CHAIN = "tree", "chain"
_NO_EDGES = np.zeros(0)


def tree_allocation(q: np.ndarray, valid: np.ndarray, q_chain: np.ndarray,
                    valid_chain: np.ndarray, intercept: float, slope: float,
                    verify_step_s: float = 0.0, tree_step_s: float = 0.0,
                    new_shape_s: float = 0.0, warm_tokens: np.ndarray | None = None,
                    tree_token_s: float = 0.0, by_count: np.ndarray | None = None
                    ) -> tuple[np.ndarray, float, float, str]:
    """The better of the step's two shapes: (kept per row, expected
    goodput, expected tokens, ``TREE`` or ``CHAIN``).

    ``q``/``valid``: per row the candidates in the order they are kept, a
    tree row's nodes ranked by path probability (``select.rank_nodes``), a
    chain row's drafts; ``q_chain``/``valid_chain``: the same with each tree
    row replaced by its best path (``select.best_path``). The tree shape pays
    ``tree_step_s`` on top of ``verify_step_s`` and ``tree_token_s`` on top of
    the slope for each of its tokens. Exact over every choice of
    node sets closed under ancestors whose rows that keep a path keep their
    best path's: a tree allocation that keeps only paths keeps the best
    paths (the M nodes of highest q form a path only along it), which the
    chain allocation prices without the tree terms, so charging them to
    every tree allocation never loses the optimum. ``by_count``: as
    ``goodput_allocation`` takes it, in both shapes.
    """
    warm = _NO_SIZES if warm_tokens is None or new_shape_s <= 0 else warm_tokens
    keep, goodput, tokens, as_tree = _both_shapes(
        np.ascontiguousarray(q, np.float64), np.ascontiguousarray(valid, np.bool_),
        np.ascontiguousarray(q_chain, np.float64), np.ascontiguousarray(valid_chain, np.bool_),
        float(intercept), float(slope), float(verify_step_s), float(tree_step_s),
        float(new_shape_s), np.asarray(warm, np.int64), warm_tokens is not None,
        float(tree_token_s), _NO_COUNTS if by_count is None else np.asarray(by_count, np.float64))
    return keep, goodput, tokens, TREE if as_tree else CHAIN


@cached_njit
def _both_shapes(q, valid, q_chain, valid_chain, intercept, slope, verify_step_s, tree_step_s,
                 new_shape_s, warm_tokens, shapes_known, tree_token_s, by_count):
    """``tree_allocation``'s two allocations (``goodput._allocation``) in one
    call: (kept per row, expected goodput, expected tokens, the tree shape
    won). One compiled call a step rather than two behind their wrappers'
    conversions."""
    as_tree = _allocation(q, valid, intercept, slope + tree_token_s,
                          verify_step_s + tree_step_s, new_shape_s, warm_tokens, shapes_known,
                          by_count)
    as_chain = _allocation(q_chain, valid_chain, intercept, slope, verify_step_s,
                           new_shape_s, warm_tokens, shapes_known, by_count)
    if as_tree[1] > as_chain[1]:
        return as_tree[0], as_tree[1], as_tree[2], True
    return as_chain[0], as_chain[1], as_chain[2], False


@dataclass
class TreeRow:
    """One request's offered tree at ``decide`` (the q the rule reads of
    its nodes went straight into the step's matrices: ``price_tree_table``)."""

    index: int              # batch row
    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray       # root children at 1
    conf: np.ndarray        # the proposer's conditional confidence per node
    q_raw: np.ndarray       # path probability before its calibration
    ranked: np.ndarray      # the tree shape's node order
    path: np.ndarray        # the chain shape's nodes


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
        # Batch row -> (nodes sent, their parents as sent, the nodes as an array).
        self._layouts: dict[int, tuple[list[int], list[int], np.ndarray]] = {}
        self._price_capacity = -1   # _price_state
        self._matrices: dict[tuple[int, int], tuple] = {}   # _empty_matrices
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
        trees = None
        # Per tree read: (batch row, its observed nodes' depth - 1, their
        # confidences, their outcomes, path probabilities, path outcomes).
        read = []
        roots, roots_q = [], []   # per tree: a root child accepted, and its foreseen q
        for i, r in enumerate(reqs):
            sent = self._sent.pop(r.req_id, None)
            if sent is None:
                continue
            if trees is None:
                trees = np.zeros(len(reqs), dtype=bool)
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
            read.append((i, depth_j, conf_i, outcome_i, q_i, x_i))
            self.tree_nodes_observed += len(idx)
        if roots:
            self._free_outcome(np.array(roots), np.array(roots_q))
        if trees is None:
            return None, None
        cal = self.path_calibration
        if len(read) == 1:   # the common case: one tree read
            i, depth_j, conf_i, outcome_i, q_i, x_i = read[0]
            if cal is not None:
                cal.learn(q_i, x_i)
            r_idx = np.empty(len(depth_j), np.int64)
            r_idx.fill(i)   # np.full's Python layer costs more than this
            return trees, (r_idx, depth_j, conf_i, outcome_i)
        if cal is not None and read:
            cal.learn(np.concatenate([t[4] for t in read]), np.concatenate([t[5] for t in read]))
        if not read:
            return trees, None
        r_idx = np.repeat(np.asarray([t[0] for t in read], np.int64), [len(t[1]) for t in read])
        return trees, (r_idx, *(np.concatenate([t[k] for t in read]) for k in (1, 2, 3)))

    def _verified_tree(self, ctx: StepContext) -> bool:
        return self._verified_a_tree

    # ------------------------------------------------------------- decide
    def shape(self, ctx: StepContext, drafts: Drafts, observation: Observation) -> Drafts:
        self._layouts = {}
        keep = self.decide(ctx, drafts, observation)
        layouts, self._layouts = self._layouts, {}
        if layouts and len(layouts) == len(keep):
            # Every row a tree (the common step): ``trim``'s prefixes of the
            # tokens, confidences and parents would all be replaced.
            tokens, conf, parents = [], [], []
            for i in range(len(keep)):
                row_tokens, row_parents, layout = layouts[i]
                tokens.append(row_tokens)
                conf.append(np.asarray(drafts.confidence[i])[layout])
                parents.append(row_parents)
            probs = None if drafts.probs is None else \
                [None if p is None else p[:k] for p, k in zip(drafts.probs, keep)]
            return type(drafts)(tokens, probs, conf, parents)
        out = trim(drafts, keep)
        for i, (tokens, parents, layout) in layouts.items():
            out.tokens[i] = tokens
            out.confidence[i] = np.asarray(drafts.confidence[i])[layout]
            out.parents[i] = parents
        return out

    def _tree_rows(self, drafts: Drafts, lengths: np.ndarray
                   ) -> list[tuple[int, np.ndarray]] | None:
        """(batch row, its parents as an array) of each row whose draft is a
        tree this policy reads node by node: with parents and confidences,
        without probability rows (a stochastic tree's acceptance is not what
        its tokens show), and well formed; None where no row can be
        (chains)."""
        if (not self.shapes_trees or not self.uses_confidence or drafts.parents is None
                or drafts.confidence is None):
            return None
        out = []
        for i, n in enumerate(lengths.tolist()):
            if n == 0 or i >= len(drafts.parents) or drafts.parents[i] is None \
                    or drafts.confidence[i] is None:
                continue
            if drafts.probs is not None and i < len(drafts.probs) \
                    and drafts.probs[i] is not None:
                continue
            if len(drafts.confidence[i]) >= n:
                parents = np.asarray(drafts.parents[i][:n], np.int64)
                if well_formed(parents, n):
                    out.append((i, parents))
        return out

    def _keep(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray,
              observation: Observation, bound: np.ndarray) -> np.ndarray:
        found = self._tree_rows(drafts, lengths)
        if not found:
            return super()._keep(ctx, drafts, lengths, observation, bound)
        rows = self._rows(ctx, lengths, observation)
        batch = len(lengths)
        # A tree row offers lengths[i] nodes, a chain row lengths[i] drafts.
        # A few rows: Python's max is cheaper than numpy's reduction.
        width = max(lengths.tolist())
        q_raw = conf = None
        every_row = len(found) == batch   # the common step: every row a tree
        if every_row:   # no chain candidates: the matrices start empty
            q, q_chain, chain_lengths, lengths_chain, valid, valid_chain = \
                self._empty_matrices(batch, width)
        else:
            trees = np.zeros(batch, dtype=bool)
            for i, _ in found:
                trees[i] = True
            chain_lengths = np.where(trees, 0, lengths)
            chain_width = max(chain_lengths.tolist())
            q = np.zeros((batch, width))
            if chain_width:
                qc, q_raw, conf = self._prefix_probs(rows, drafts, chain_width, observation)
                q[:, :chain_width] = np.where(trees[:, None], 0.0, qc)
            valid = self._prefixes[chain_lengths, :width]
            q_chain, valid_chain = q.copy(), valid.copy()
            lengths_chain = chain_lengths.copy()
        tree_rows = self._candidates(rows, drafts, lengths, found, q, valid, q_chain,
                                     valid_chain, lengths_chain)
        step = self._step_trees = TreeStep(tree_rows, q_chain, valid_chain, lengths_chain)
        try:
            keep = self._choose(lengths, q, valid, observation)
        finally:
            self._step_trees = None
        keep = np.minimum(keep, lengths if step.mode == TREE else lengths_chain)
        if every_row:
            self._settle(rows, drafts, chain_lengths, chain_lengths, bound, q_raw, conf)
            self._lay_out(ctx, rows, step, keep)
            return keep
        kept = self._settle(rows, drafts, chain_lengths, np.where(trees, 0, keep), bound,
                            q_raw, conf)
        self._lay_out(ctx, rows, step, keep)
        return np.where(trees, keep, kept)

    def _empty_matrices(self, batch: int, width: int) -> tuple:
        """Zeroed ``q``, ``q_chain`` [batch, width] float64, ``chain_lengths``,
        ``lengths_chain`` [batch] int64, ``valid``, ``valid_chain`` [batch,
        width] bool, for a step whose every row is a tree: views of one
        buffer kept by shape, zeroed in one call (six arrays made afresh
        cost six numpy calls, each slow after a forward). Nothing holds them
        past the step (``TreeStep`` goes with it)."""
        kept = self._matrices.get((batch, width))
        if kept is None:
            if len(self._matrices) >= 64:
                self._matrices.clear()
            cells = batch * width
            raw = np.zeros(8 * (2 * cells + 2 * batch) + 2 * cells, np.uint8)
            floats = raw[:16 * cells].view(np.float64).reshape(2, batch, width)
            ints = raw[16 * cells:16 * cells + 16 * batch].view(np.int64).reshape(2, batch)
            flags = raw[16 * cells + 16 * batch:].view(np.bool_).reshape(2, batch, width)
            kept = self._matrices[(batch, width)] = (
                raw, (floats[0], floats[1], ints[0], ints[1], flags[0], flags[1]))
        else:
            kept[0].fill(0)
        return kept[1]

    def _candidates(self, rows: np.ndarray, drafts: Drafts, lengths: np.ndarray,
                    found: list[tuple[int, np.ndarray]], q: np.ndarray, valid: np.ndarray,
                    q_chain: np.ndarray, valid_chain: np.ndarray, lengths_chain: np.ndarray
                    ) -> list[TreeRow]:
        """Each tree row's nodes with their calibrated path probabilities,
        ranked (the tree shape, into ``q``/``valid``) and its best path (the
        chain shape, into ``q_chain``/``valid_chain``/``lengths_chain``)."""
        table, scalars, calibrate = self._price_state()
        out = []
        for i, parents in found:
            n = int(lengths[i])
            conf = np.asarray(drafts.confidence[i][:n], np.float64)
            depth, q_raw, ranked, path = price_tree_table(
                parents, conf, int(rows[i]), table.table, scalars, calibrate, i, q, valid,
                q_chain, valid_chain, lengths_chain)
            out.append(TreeRow(i, np.asarray(drafts.tokens[i][:n], np.int64), parents, depth,
                               conf, q_raw, ranked, path))
        return out

    def _price_state(self) -> tuple:
        """``price_tree_table``'s state: (the confidence calibration's tables
        (``_kernel_state``, whose slot arrays are replaced when the slots
        grow) and the outcome calibration's, which are updated in place, as
        an ``ArrayTable``; their scalars (``PRICE_SCALARS``); whether the
        outcome calibration is on)."""
        cal_state = self._kernel_state()[3]
        if self._price_capacity != self._state_capacity:
            cal = self.path_calibration
            calibrate = cal is not None
            outcomes = ((OutcomeCalibrator.EDGES, cal.s, cal.e) if calibrate
                        else (_NO_EDGES, _NO_EDGES, _NO_EDGES))
            scalars = (self.calibrator.depth - 1, cal_state[7], EPS,
                       OutcomeCalibrator._STRENGTH, EPS, 1.0 - EPS)
            if len(scalars) != len(PRICE_SCALARS):
                raise ValueError(f"{len(scalars)} scalars for PRICE_SCALARS' "
                                 f"{len(PRICE_SCALARS)}")
            self._price = (ArrayTable((*cal_state[1:7], *outcomes), PRICE_TABLE),
                           np.array(scalars, np.float64), calibrate)
            self._price_capacity = self._state_capacity
        return self._price

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
                                      cost.new_shape_s, sizes, cost.by_count)
        keep, goodput, tokens, step.mode = tree_allocation(
            q, valid, step.q_chain, step.valid_chain, intercept, slope, cost.verify_step_s,
            cost.tree_step_s, cost.new_shape_s, sizes, cost.tree_token_s, cost.by_count)
        return keep, goodput, tokens

    def _tree_probe_due(self) -> bool:
        return (self.cost.warm and self.steps - self._tree_probe_at >= self._TREE_PROBE_GAP
                and self.cost.needs_tree_step())

    def _lay_out(self, ctx: StepContext, rows: np.ndarray, step: TreeStep,
                 keep: np.ndarray) -> None:
        """Each tree row's kept nodes in the order sent, and what its next
        step is read against."""
        kept_any = False
        # Confidences come with the drafts: no length bound from history.
        conf_seen = self.slots.arrays["conf_seen"]
        as_tree = step.mode == TREE
        for t in step.rows:
            k = int(keep[t.index])
            if as_tree:
                layout = t.ranked[:k]
                relaid, tree = lay_out(t.parents, layout)
                if len(relaid) != k:
                    _select().relaid_parents(t.parents, layout)   # raises, naming the node
                parents = relaid.tolist()
            else:
                layout = t.path[:k]
                parents = list(range(-1, k - 1))
                tree = False
            # The sent tokens, as Python ints.
            self._layouts[t.index] = (t.tokens[layout].tolist(), parents, layout)
            r = ctx.requests[t.index]
            self._kept_nodes[r.req_id] = k
            self._sent[r.req_id] = SentTree(
                t.tokens, t.parents, t.depth, t.conf, t.q_raw, layout, tree, len(r.context))
            self.tree_rows += 1
            self.tree_nodes_offered += len(t.tokens)
            self.tree_nodes_kept += k
            kept_any = kept_any or k > 0
            conf_seen[rows[t.index]] = True
        if kept_any:
            self.shape_steps[step.mode] += 1

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

