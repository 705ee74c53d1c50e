"""STAND's Gumbel-top-k tree (proposers/stand_tree.py): structure, the rows
the draws came from, and exact sampled output through the tree acceptance
rule (fast; no engine)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_stand import chi2_pvalue, req
from vllm_plugins.proposers.stand import (KindCalibration, StandProposer,
                                          draft_distribution)
from vllm_plugins.proposers.stand_store import NgramStore, context_keys
from vllm_plugins.proposers.stand_tree import dense_rows, grow_tree, observed_nodes
from vllm_plugins.step_context import StepContext
from vllm_plugins.tree import children, path_to, sample_accept_with_probs, validate

V = 12
# Order-1 entries: last token -> (ids, probabilities), stored as the target
# would have shown them.
ENTRIES = {3: ([4, 6, 7], [0.5, 0.25, 0.08]), 4: ([5, 8], [0.6, 0.2]),
           6: ([9], [0.9])}


def make_store(entries=ENTRIES):
    store = NgramStore(width=4, capacity=256, history=16)
    for last, (ids, probs) in entries.items():
        store.observe(context_keys([last], 1)[0], np.array(ids), np.array(probs))
    return store


def grow(store, budget, sampled=False, rng=None, min_path_prob=0.05, temperature=1.0,
         tail=(3,)):
    return grow_tree(store, list(tail), budget, sampled=sampled,
                     temperature=temperature, top_k=0, top_p=1.0, rng=rng,
                     max_order=1, calibration=KindCalibration(1), calibrate=False,
                     min_path_prob=min_path_prob)


def test_greedy_tree_is_best_first_by_path_probability():
    tree = grow(make_store(), budget=5)
    # Scores: 4 (.5), 4->5 (.5*.6), 6 (.25), 6->9 (.25*.9), 4->8 (.5*.2);
    # 7 (.08) would come next.
    assert tree.tokens == [4, 5, 6, 9, 8]
    assert tree.parents == [-1, 0, -1, 2, 0]
    assert tree.scores == pytest.approx([0.5, 0.3, 0.25, 0.225, 0.1], rel=1e-6)
    assert np.cumprod(tree.confidence) == pytest.approx(tree.scores, rel=1e-6)
    assert tree.rows == []
    assert grow(make_store(), budget=5, min_path_prob=0.2).tokens == [4, 5, 6, 9]


def random_entries(rng, vocab=V, width=4):
    out = {}
    for last in range(vocab):
        ids = rng.choice(vocab, size=width, replace=False)
        probs = np.sort(rng.dirichlet(np.ones(width + 1))[:width])[::-1]
        out[int(last)] = (ids, probs)
    return out


@pytest.mark.parametrize("sampled", [False, True])
def test_tree_structure_is_valid_and_prefixes_are_best(sampled):
    rng = np.random.default_rng(0)
    for trial in range(30):
        store = make_store(random_entries(rng))
        budget = int(rng.integers(1, 40))
        tree = grow(store, budget, sampled, np.random.default_rng(trial),
                    min_path_prob=0.0)
        validate(tree.parents)
        assert 1 <= len(tree.tokens) <= budget
        kids = children(tree.parents)
        for siblings in kids:
            toks = [tree.tokens[c] for c in siblings]
            assert len(set(toks)) == len(toks)  # drawn without replacement
        # Scores never increase, so each prefix is the best tree of its size.
        assert all(a >= b for a, b in zip(tree.scores, tree.scores[1:]))
        assert np.cumprod(tree.confidence) == pytest.approx(tree.scores, rel=1e-5)
        assert len(tree.rows) == (len(tree.tokens) if sampled else 0)


def test_rows_are_the_distributions_the_nodes_were_drawn_from():
    entries = random_entries(np.random.default_rng(1))
    store = make_store(entries)
    for trial in range(20):
        tree = grow(store, 30, True, np.random.default_rng(trial), min_path_prob=0.0,
                    temperature=0.7)
        rows = dense_rows(tree.rows, V)
        for i, parent in enumerate(tree.parents):
            last = 3 if parent == -1 else tree.tokens[parent]
            ids, probs = entries[last]
            q, _ = draft_distribution(np.asarray(probs, np.float32), 0.7)
            want = np.zeros(V, np.float32)
            want[np.asarray(ids)[:len(q)]] = q
            assert rows[i] == pytest.approx(want, abs=1e-6)
            assert rows[i, tree.tokens[i]] > 0
            if parent >= 0:  # the node's context is its path
                assert [tree.tokens[j] for j in path_to(tree.parents, i)][-2] == last


def test_siblings_are_draws_without_replacement_in_draw_order():
    """The first two root children over many seeds: (a, b) must come out with
    q(a) q(b) / (1 - q(a)), the law the acceptance rule conditions on; a
    with-replacement reading, q(a) q(b) renormalised over a != b, is the
    control the same test rejects."""
    ids, probs = [4, 6, 7, 9], [0.5, 0.25, 0.15, 0.1]
    store = make_store({3: (ids, probs)})
    q = np.array(probs) / sum(probs)
    counts = np.zeros((4, 4))
    for trial in range(4000):
        tree = grow(store, 2, True, np.random.default_rng(trial), min_path_prob=0.0)
        a, b = (ids.index(t) for t in tree.tokens)
        counts[a, b] += 1
    without = q[:, None] * q[None, :] / (1 - q[:, None])
    np.fill_diagonal(without, 0)
    with_repl = q[:, None] * q[None, :]
    np.fill_diagonal(with_repl, 0)
    with_repl /= with_repl.sum()
    keep = ~np.eye(4, dtype=bool)
    assert chi2_pvalue(counts[keep], without[keep]) > 1e-3
    assert chi2_pvalue(counts[keep], with_repl[keep]) < 1e-6


# ------------------------------------------------------------ exactness
def target_after(last):
    rng = np.random.default_rng([7, last])
    return rng.dirichlet(np.ones(V) * 0.5)


def first_two_tokens(store, draws, uniform_rows=False, chain_prefix=False):
    """Emitted tokens of a STAND tree verified by the tree acceptance rule,
    a second step drawn from the target when the first emitted one.
    ``chain_prefix``: the tree cut to its longest chain prefix, as the bridge
    cuts trees it cannot verify (then verified as a chain)."""
    gen = torch.Generator().manual_seed(0)
    counts = np.zeros((V, V))
    for trial in range(draws):
        rng = np.random.default_rng(trial)
        tree = grow(store, 6, True, rng, min_path_prob=0.0)
        if chain_prefix:
            n = next((i for i, p in enumerate(tree.parents) if p != i - 1),
                     len(tree.parents))
            tree.tokens, tree.parents, tree.rows = (
                tree.tokens[:n], tree.parents[:n], tree.rows[:n])
        rows = dense_rows(tree.rows, V)
        if uniform_rows:  # the dishonest control: not what was drawn from
            rows = (rows > 0) / (rows > 0).sum(1, keepdims=True)
        paths = [[]] + [path_to(tree.parents, i) for i in range(len(tree.tokens))]
        target = torch.tensor(np.stack(
            [target_after(tree.tokens[p[-1]] if p else 3) for p in paths]),
            dtype=torch.float32)
        out = sample_accept_with_probs([tree.parents], [tree.tokens], target,
                                       [rows], gen)[0].tokens
        if len(out) < 2:
            out.append(int(rng.choice(V, p=target_after(out[0]))))
        counts[out[0], out[1]] += 1
    return counts


@pytest.mark.parametrize("uniform_rows, chain_prefix", [
    (False, False), (True, False), (False, True)],
    ids=["tree", "tree-uniform-rows", "chain-prefix"])
def test_sampled_output_through_a_stand_tree_is_the_targets(uniform_rows, chain_prefix):
    store = make_store(random_entries(np.random.default_rng(2)))
    counts = first_two_tokens(store, 3000, uniform_rows, chain_prefix)
    want = target_after(3)[:, None] * np.stack([target_after(t) for t in range(V)])
    pv = min(chi2_pvalue(counts.sum(1), target_after(3)),
             chi2_pvalue(counts.ravel(), want.ravel()))
    if uniform_rows:
        assert pv < 1e-6, pv
    else:
        assert pv > 1e-3, pv


# ------------------------------------------------------------ the proposer
def stand(**opts):
    base = {"draft_length": "fixed", "topk": 4, "max_order": 1, "calibrate": False,
            "min_path_prob": 0.05, "share": "request"}
    return StandProposer(None, {**base, **opts}, vocab_size=V)


def learn_entries(p, req_id, temperature):
    """One step whose target rows fill the request's store with ENTRIES."""
    lasts = list(ENTRIES)
    ctx = StepContext([req(req_id, [1, 2, *lasts], lasts[1:], verified=lasts,
                           topk=[list(zip(*ENTRIES[t])) for t in lasts],
                           num_prompt=2, temperature=temperature)], max_draft=5)
    p.step(ctx)


def test_default_shape_is_a_chain_and_tree_drafts_carry_parents():
    for shape, temperature in (("chain", 0.0), ("tree", 0.0), ("tree", 1.0)):
        p = stand(**({} if shape == "chain" else {"draft_shape": shape}))
        learn_entries(p, "a", temperature)
        d = p.step(StepContext([req("a", [1, 2, 3], [3], verified=[2], num_prompt=2,
                                    temperature=temperature)], max_draft=5))
        if shape == "chain":
            assert d.parents is None and d.tokens[0] == [4, 5]
            continue
        validate(d.parents[0])
        assert len(d.tokens[0]) == len(d.parents[0]) == len(d.confidence[0]) <= 5
        if temperature == 0.0:
            assert d.tokens[0] == [4, 5, 6, 9, 8] and d.probs is None
        else:
            assert d.probs[0].shape == (len(d.tokens[0]), V)
            assert d.probs[0].sum(1) == pytest.approx(1.0, abs=1e-6)


def test_structured_output_requests_keep_chains():
    p = stand(draft_shape="tree")
    learn_entries(p, "a", 1.0)
    r = req("a", [1, 2, 3], [3], verified=[2], num_prompt=2, temperature=1.0)
    r.sampling_params.structured_outputs = SimpleNamespace(regex="...")
    d = p.step(StepContext([r], max_draft=5))
    assert d.parents is None and d.probs is None


def test_tree_outcomes_calibrate_the_nodes_tried():
    # Tree [4, 5, 6, 9, 8] with parents [-1, 0, -1, 2, 0]; emitted 6, 9, then 1:
    # 4 was tried first and rejected, 6 accepted, 9 accepted, nothing below 9.
    parents, tokens = [-1, 0, -1, 2, 0], [4, 5, 6, 9, 8]
    assert observed_nodes(parents, tokens, [6, 9, 1]) == [(0, False), (2, True), (3, True)]
    # Emitted 4 then 2: 4 accepted, its children 5 and 8 tried and rejected.
    assert observed_nodes(parents, tokens, [4, 2]) == [(0, True), (1, False), (4, False)]


def test_a_verified_tree_is_learned_under_each_nodes_own_path():
    p = stand(draft_shape="tree", max_order=2)
    learn_entries(p, "a", 0.0)
    d = p.step(StepContext([req("a", [1, 2, 3], [3], verified=[2], num_prompt=2)],
                           max_draft=5))
    tokens, parents = d.tokens[0], d.parents[0]
    assert parents != list(range(-1, len(tokens) - 1))  # a real tree
    # The target's rows after the root and after each node; node 2 (token 6)
    # hangs from the root, so its context is (3, 6), not (5, 6).
    rows = [[(10 + j, 0.7), (11, 0.2)] for j in range(len(tokens) + 1)]
    p.step(StepContext([req("a", [1, 2, 3, 4, 5, 1], [4, 5, 1],
                            verified=[3, *tokens], topk=rows, num_prompt=2)],
                       max_draft=5))
    store = next(iter(p.stores.values()))
    for node in range(len(tokens)):
        path = [tokens[j] for j in path_to(parents, node)]
        slot, order = store.find(([3] + path)[-2:], 2, touch=False)
        assert order == 2 and store.entry(slot)[0][0] == 11 + node
    assert tokens[2] == 6 and parents[2] == -1
    assert store.find([5, 6], 2, touch=False)[1] < 2
