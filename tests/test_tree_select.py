"""Selection on draft trees, each piece against a reference: the nodes a
tree keeps and their re-laid parents (vllm_plugins/tree/select.py), the
goodput allocation over a batch against exhaustive search
(tree_goodput.tree_allocation), node outcomes read back from the emitted
tokens, and the compiled per-tree work (proposers/draft_length/tree_kernels.py)
against tree.select. The policy that uses them is tests/test_draft_length_tree.py's."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from tests.test_draft_length_tree import tree_controller
from vllm_plugins.proposers.draft_length.tree_goodput import TREE, tree_allocation
from vllm_plugins.tree import select
from vllm_plugins.tree.draft import path_to


def random_tree(rng, n):
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    cond = rng.uniform(0.05, 0.95, n)
    q = select.path_probabilities(parents, cond)
    return parents, q


def closed_sets(parents):
    """Every node set closed under ancestors (as sorted tuples)."""
    n = len(parents)
    for bits in range(1 << n):
        nodes = [i for i in range(n) if bits >> i & 1]
        if all(parents[v] == -1 or (bits >> parents[v] & 1) for v in nodes):
            yield nodes


def is_path(parents, nodes):
    """Whether a closed node set is one root-down path."""
    s = set(nodes)
    return all(sum(1 for v in nodes if parents[v] == p) <= 1 for p in [-1, *s])


# ------------------------------------------------------------ selection

@pytest.mark.parametrize("seed", range(20))
def test_ranked_prefixes_are_trees_and_relaid_parents_keep_each_path(seed):
    rng = np.random.default_rng(seed)
    parents, q = random_tree(rng, int(rng.integers(1, 12)))
    order = select.rank_nodes(q)
    for k in range(len(order) + 1):
        nodes = [int(v) for v in order[:k]]
        assert select.is_closed(parents, nodes)
        # The top-k set by q is the most probable closed set of its size.
        best = max((sum(q[list(s)]) for s in closed_sets(parents) if len(s) == k))
        assert sum(q[nodes]) == pytest.approx(best)
        relaid = select.relaid_parents(parents, nodes)
        assert all(p < i for i, p in enumerate(relaid))
        for i, v in enumerate(nodes):   # same path, as original indices
            assert [nodes[u] for u in path_to(relaid, i)] == path_to(parents, v)


def test_relaying_a_node_before_its_parent_fails():
    with pytest.raises(ValueError, match="before its parent"):
        select.relaid_parents([-1, 0], [1, 0])
    assert not select.is_closed([-1, 0, 1], [0, 2])


def test_best_path_descends_through_the_most_probable_child():
    parents = [-1, -1, 0, 0, 1, 3]
    q = [0.5, 0.5, 0.2, 0.3, 0.45, 0.1]
    assert select.best_path(parents, q) == [0, 3, 5]   # tie at the root: lower index


# ------------------------------------------------------------ allocation

def _exact(rows, a, b, v, t):
    """Exhaustive search: every closed set per tree row (every prefix per
    chain row), a tree row that keeps a path must keep its best path's
    prefix, the tree term charged when any tree row keeps a non-path."""
    choices = []
    for kind, parents, q in rows:
        if kind == "chain":
            choices.append([list(range(k)) for k in range(len(q) + 1)])
            continue
        path = select.best_path(parents, q)
        choices.append([s for s in closed_sets(parents)
                        if not is_path(parents, s) or s == sorted(path[:len(s)])
                        and s == path[:len(s)]])
    best = -1.0
    for pick in itertools.product(*choices):
        m = sum(len(s) for s in pick)
        tree = any(kind == "tree" and not is_path(parents, s)
                   for (kind, parents, _), s in zip(rows, pick))
        gain = len(rows) + sum(float(np.sum(np.asarray(q)[s])) for (_, _, q), s in zip(rows, pick))
        cost = a + b * (len(rows) + m) + (v if m else 0.0) + (t if tree else 0.0)
        best = max(best, gain / cost)
    return best


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("tree_step_s", [0.0, 0.3])
def test_allocation_matches_exhaustive_search(seed, tree_step_s):
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(2):
        parents, q = random_tree(rng, int(rng.integers(1, 6)))
        rows.append(("tree", parents, q))
    q_chain = np.cumprod(rng.uniform(0.2, 0.95, int(rng.integers(0, 4))))
    rows.append(("chain", None, q_chain))
    width = max(len(q) for _, _, q in rows)
    qa, qb = np.zeros((3, width)), np.zeros((3, width))
    va, vb = np.zeros((3, width), bool), np.zeros((3, width), bool)
    for i, (kind, parents, q) in enumerate(rows):
        order = (np.arange(len(q)) if kind == "chain" else select.rank_nodes(q))
        path = np.arange(len(q)) if kind == "chain" else select.best_path(parents, q)
        qa[i, :len(order)], va[i, :len(order)] = np.asarray(q)[order], True
        qb[i, :len(path)], vb[i, :len(path)] = np.asarray(q)[path], True
    a, b, v = 1.0, float(rng.uniform(0.02, 0.6)), float(rng.choice([0.0, 0.2]))
    keep, goodput, tokens, mode = tree_allocation(qa, va, qb, vb, a, b, v, tree_step_s)
    assert goodput == pytest.approx(_exact(rows, a, b, v, tree_step_s))
    # The claimed goodput is that of what it keeps.
    q_used = qa if mode == TREE else qb
    gain = sum(q_used[i, :keep[i]].sum() for i in range(3))
    assert tokens == pytest.approx(3 + gain)
    if tree_step_s == 0.0:   # no tree term: the optimum over every closed set
        free = max(
            (3 + sum(float(np.sum(np.asarray(q)[s])) for (_, _, q), s in zip(rows, pick)))
            / (a + b * (3 + sum(map(len, pick))) + (v if any(pick) else 0.0))
            for pick in itertools.product(*[
                [list(range(k)) for k in range(len(q) + 1)] if kind == "chain"
                else list(closed_sets(parents)) for kind, parents, q in rows]))
        assert goodput == pytest.approx(free)


# ------------------------------------------------------------- outcomes

def test_outcomes_from_emitted_tokens_on_a_hand_made_tree():
    #          root
    #        /  |   \
    #      0(5) 1(6) 4(9)       tokens in parentheses
    #     /  \    \
    #   2(7) 3(8)  5(7)
    tokens = [5, 6, 7, 8, 9, 7]
    parents = [-1, -1, 0, 0, -1, 1]
    # Verified: 0, 1, 3 (2, 4, 5 cut). Target emitted 5 then 7: node 0 was
    # accepted, node 2 (token 7) was cut, so 7 is the bonus token.
    path = select.accepted_path(tokens, parents, [0, 1, 3], [5, 7])
    assert path == [0]
    observed, accepted = select.node_outcomes(tokens, parents, path, [5, 7])
    # Root children (0, 1, 4) and node 0's children (2, 3) are observed;
    # node 5 (child of the rejected node 1) is not.
    assert observed.tolist() == [True, True, True, True, True, False]
    assert accepted.tolist() == [True, False, True, False, False, False]
    # Had node 2 been verified, the emitted 7 would have been accepted: not
    # a path of this verification.
    assert select.accepted_path(tokens, parents, [0, 2], [5, 7]) is None
    assert select.accepted_path(tokens, parents, [0, 2], [5, 7, 3]) == [0, 2]
    assert select.accepted_path(tokens, parents, [1], [5, 7]) is None
    # Duplicated sibling tokens: the first in the order sent wins.
    assert select.accepted_path([4, 4], [-1, -1], [1, 0], [4, 2]) == [1]


@pytest.mark.parametrize("seed", range(40))
def test_accepted_path_is_the_path_greedy_acceptance_took(seed):
    """Read back from the emitted tokens, the path is the one
    vllm_plugins.tree.acceptance accepted, repeated sibling tokens
    included; every observed node's outcome is whether its token is the
    target's argmax at its parent."""
    import torch

    from vllm_plugins.tree.acceptance import greedy_accept

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 10))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    tokens = rng.integers(0, 3, n).tolist()          # a small alphabet: repeats
    argmax = rng.integers(0, 3, n + 1)               # row 0: the root
    got = greedy_accept([parents], [tokens], torch.as_tensor(argmax))[0]
    path = select.accepted_path(tokens, parents, list(range(n)), got.tokens)
    assert path == got.nodes
    observed, accepted = select.node_outcomes(tokens, parents, path, got.tokens)
    for v in np.nonzero(observed)[0]:
        assert accepted[v] == (tokens[v] == argmax[parents[v] + 1])



# ------------------------------------------------ the compiled per-tree work

@pytest.mark.parametrize("seed", range(30))
def test_compiled_tree_pricing_and_layout_equal_the_selection_functions(seed):
    """proposers/draft_length/tree_kernels.py against vllm_plugins.tree.select
    and OutcomeCalibrator: the same values, ties and path included."""
    from vllm_plugins.proposers.draft_length.acceptance import EPS, clip
    from vllm_plugins.proposers.draft_length.calibration import OutcomeCalibrator
    from vllm_plugins.proposers.draft_length.tree_kernels import (lay_out, price_tree,
                                                                  tree_depths, well_formed)
    from vllm_plugins.tree.draft import depths

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    par = np.asarray(parents, np.int64)
    conf = rng.choice([0.2, 0.5, 0.9], n) if seed % 3 == 0 else rng.uniform(0.01, 1.0, n)
    assert tree_depths(par).tolist() == depths(parents)
    assert well_formed(par, n) and not well_formed(par, n + 1)
    assert not well_formed(np.asarray(parents[:-1] + [n - 1], np.int64), n)
    # A confidence calibration that has learned something, at slot row 1.
    controller = tree_controller(8)
    confidence = controller.calibrator
    row = 1
    for _ in range(3):
        confidence.slots.arrays["cal_s"][row] += rng.uniform(0, 3)
        confidence.slots.arrays["cal_e"][row] += rng.uniform(0, 3)
        confidence.gps[:] += rng.uniform(0, 1, confidence.gps.shape)
        confidence.gpn[:] += rng.uniform(1, 2, confidence.gpn.shape)
    cond = confidence.calibrate_at(np.full(n, row), tree_depths(par) - 1, conf)
    tables = (*confidence.kernel_state()[1:8], EPS)
    cal = OutcomeCalibrator()
    cal.s[:] = rng.uniform(0, 5, len(cal.s))
    cal.e[:] = rng.uniform(0, 5, len(cal.e))
    for calibrate in (False, True):
        depth, q_raw, q, ranked, path, q_ranked, q_path = price_tree(
            par, conf, row, confidence.depth - 1, *tables, calibrate, cal.EDGES, cal.s,
            cal.e, cal._STRENGTH, EPS, 1.0 - EPS)
        assert depth.tolist() == depths(parents)
        want_raw = select.path_probabilities(parents, cond)
        want = want_raw
        if calibrate:
            want = clip(want_raw * cal.factor(want_raw), EPS, 1.0 - EPS)
        want = select.cap_by_parent(parents, want)
        assert q_raw.tolist() == want_raw.tolist() and q.tolist() == want.tolist()
        assert ranked.tolist() == select.rank_nodes(want).tolist()
        assert path.tolist() == select.best_path(parents, want)
        assert q_ranked.tolist() == want[ranked].tolist()
        assert q_path.tolist() == want[path].tolist()
        for k in range(n + 1):
            relaid, tree = lay_out(par, ranked[:k])
            want_relaid = select.relaid_parents(parents, ranked[:k].tolist())
            assert relaid.tolist() == want_relaid
            assert tree == (want_relaid != list(range(-1, k - 1)))
    for v in range(n):   # a node without its parent, or before it: no layout
        if parents[v] >= 0:
            assert len(lay_out(par, np.asarray([v], np.int64))[0]) == 0
            assert len(lay_out(par, np.asarray([v, parents[v]], np.int64))[0]) == 0


@pytest.mark.parametrize("seed", range(40))
def test_compiled_tree_reading_equals_the_selection_functions(seed):
    """tree_kernels.read_tree against select.accepted_path and
    select.node_outcomes, with repeated sibling tokens, part of the tree
    verified and emitted tokens from another verification."""
    from vllm_plugins.proposers.draft_length.tree_kernels import read_tree, tree_depths

    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    parents = [-1] + [int(rng.integers(-1, i)) for i in range(1, n)]
    tokens = rng.integers(0, 3, n)
    par = np.asarray(parents, np.int64)
    depth = tree_depths(par)
    conf = rng.uniform(0, 1, n)
    q_raw = select.path_probabilities(parents, rng.uniform(0.1, 1, n))
    layout = select.rank_nodes(q_raw)
    for num_draft in (0, n // 2, n, n + 3):
        verified = layout[:min(num_draft, n)]
        for _ in range(6):
            emitted = rng.integers(0, 3, int(rng.integers(1, 5))).astype(np.int64)
            found, verified_tree, root_hit, idx, j, c, x, q_used, q_x = read_tree(
                tokens, par, depth, conf, q_raw, layout, num_draft, emitted)
            v = len(verified)
            chain = np.concatenate(([-1], verified[:-1]))
            assert verified_tree == (v > 0 and not bool((par[verified] == chain).all()))
            path = select.accepted_path(tokens, parents, verified, emitted)
            assert found == (path is not None)
            if path is None:
                continue
            observed, accepted = select.node_outcomes(tokens, parents, path, emitted, depth)
            want = np.nonzero(observed)[0]
            assert idx.tolist() == want.tolist()
            assert j.tolist() == (depth[want] - 1).tolist()
            assert c.tolist() == conf[want].tolist()
            assert x.tolist() == accepted[want].astype(np.float64).tolist()
            assert root_hit == bool(accepted[depth == 1].any())
            on_path = np.zeros(n, bool)
            on_path[path] = True
            known = observed.copy()
            known[verified] = True
            assert q_used.tolist() == q_raw[known].tolist()
            assert q_x.tolist() == np.where(observed, accepted, on_path)[known].tolist()


def test_the_compiled_outcome_calibration_learns_as_bincount_did():
    from vllm_plugins.proposers.draft_length.calibration import OutcomeCalibrator

    rng = np.random.default_rng(0)
    cal, s, e = OutcomeCalibrator(), np.zeros(12), np.zeros(12)
    for _ in range(20):
        q = rng.uniform(0, 1, int(rng.integers(2, 30)))
        q[:2] = (0.1, 0.9)   # on edges
        x = (rng.uniform(0, 1, len(q)) < q).astype(np.float64)
        cal.learn(q, x)
        b = np.searchsorted(cal.EDGES, q)
        s = s * cal._decay + np.bincount(b, weights=x, minlength=12)
        e = e * cal._decay + np.bincount(b, weights=q, minlength=12)
        assert cal.s.tolist() == s.tolist() and cal.e.tolist() == e.tolist()
