"""The goodput policy on draft trees: which nodes to verify, from the step
cost (proposers/draft_length/tree_goodput.py): what it reads back from the
trees it sent, the shape it chooses in simulated worlds, and its wiring into
Token Recycling. The selection and the compiled per-tree work it rests on
are checked in tests/test_tree_select.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.draft_length_tree_world import OTHER, TOKEN_BASE, Cost, TreeWorld, make_tree, run
from vllm_plugins.proposers.draft_length import (GoodputController, TreeGoodputController,
                                                 make_controller)
from vllm_plugins.step_context import Drafts, RequestStep, StepContext


def _step(req_id, context, accepted, num_draft, temperature=0.0):
    return RequestStep(req_id=req_id, accepted=np.asarray(accepted, np.int64),
                       context=np.asarray(context, np.int64), num_prompt_tokens=2,
                       num_draft=num_draft, verified_tokens=np.zeros(num_draft + 1, np.int64),
                       topk_ids=None, topk_logprobs=None, temperature=temperature)


def tree_controller(max_draft=8, **options):
    c = make_controller("goodput", options, max_draft)
    c.shapes_trees = True
    return c


def test_controller_reads_node_outcomes_of_the_tree_it_sent():
    c = tree_controller()
    tokens = [5, 6, 7, 8, 9, 7]
    parents = [-1, -1, 0, 0, -1, 1]
    conf = np.array([0.9, 0.5, 0.8, 0.6, 0.3, 0.7], np.float32)
    ctx = StepContext([_step("a", [1, 2], [2], 0)], max_draft=8)
    obs = c.observe(ctx)
    out = c.shape(ctx, Drafts([tokens], None, [conf], [parents]), obs)
    sent = c._sent["a"]
    assert [tokens[v] for v in sent.layout] == out.tokens[0]
    # Next step: the first three sent nodes were verified; the target
    # emitted node 0's token, then one no node carries.
    layout = [int(v) for v in sent.layout]
    k = min(3, len(layout))
    emitted = [5, 42]
    before = c.calibrator.gn.sum()
    ctx2 = StepContext([_step("a", [1, 2, 5, 42], emitted, k)], max_draft=8)
    c.observe(ctx2)
    # Observed: root children 0, 1, 4 and node 0's children 2, 3 (5 nodes).
    assert c.tree_nodes_observed == 5
    assert c.calibrator.gn.sum() == pytest.approx(before + 5)
    # Tree rows teach the per-position chain estimates nothing.
    assert c.estimator.global_rate == make_controller("goodput", {}, 8).estimator.global_rate


# ------------------------------------------------------- the choice of shape

def _shapes(cost, steps=300, tree_cost="token", **world):
    c = tree_controller(16, tree_cost=tree_cost)
    w = TreeWorld(2, cost, nodes=16, **world)
    sent = run(c, w, steps)
    late = sent[steps // 2:]
    trees = sum(any(p is not None and list(p) != list(range(-1, len(p) - 1))
                    for p in (d.parents or [])) for d in late)
    nodes = np.mean([sum(map(len, d.tokens)) for d in late])
    return c, trees / len(late), nodes


def test_trees_where_verified_tokens_are_nearly_free():
    c, tree_share, nodes = _shapes(Cost(0.02, 0.00002, 0.0005))
    assert tree_share > 0.9 and nodes > 28, (tree_share, nodes)   # of 2 x 16


def test_chains_where_the_tree_step_costs_much():
    c, tree_share, nodes = _shapes(Cost(0.02, 0.00002, 0.05), tree_cost="step")
    assert tree_share < 0.1, tree_share
    assert c.stats()["cost_model"]["tree_step_s"] == pytest.approx(0.05, rel=0.3)


def test_chains_where_each_tree_token_costs_much():
    """Tree rows dearer than chain tokens, token for token (this CPU's tree
    attention and gathers): the default fit finds the extra per token and
    the rule lays the trees' best paths out as chains."""
    c, tree_share, nodes = _shapes(Cost(0.02, 0.00002, tree_token=0.004))
    assert tree_share < 0.1, tree_share
    model = c.stats()["cost_model"]
    assert model["tree_token_s"] == pytest.approx(0.004, rel=0.3)
    assert model["tree_step_s"] == 0.0


def test_a_tree_token_cost_that_pays_keeps_trees_but_fewer_nodes():
    """A tree token a little dearer than a chain's: trees still pay where
    the world branches, with fewer nodes than when its tokens cost a chain's."""
    _, share_even, even = _shapes(Cost(0.02, 0.0004, 0.0))
    _, share_dear, dear = _shapes(Cost(0.02, 0.0004, tree_token=0.0004))
    assert share_even > 0.9 and share_dear > 0.5, (share_even, share_dear)
    assert dear < 0.9 * even, (dear, even)


def test_chains_where_each_token_costs_much():
    c, tree_share, nodes = _shapes(Cost(0.07, 0.03, 0.0))
    assert tree_share < 0.1 and nodes < 8, (tree_share, nodes)


def test_a_cpu_like_curve_keeps_what_pays():
    """This CPU's curve (a 70 ms step, 3.8 ms per verified token, a small
    tree-step cost): fewer nodes than a free curve keeps, more than none."""
    _, _, free = _shapes(Cost(0.02, 0.00002, 0.0005))
    _, _, cpu = _shapes(Cost(0.07, 0.0038, 0.003))
    assert 2 < cpu < 0.8 * free, (cpu, free)


def test_calibration_learns_a_mis_scaled_confidence():
    """Confidences twice the true conditional acceptance: the calibrated
    conditional of a root child comes down to its true rate."""
    c = tree_controller(16)
    w = TreeWorld(2, Cost(0.02, 0.00002, 0.0005), nodes=16, confidence_scale=2.0,
                  root_children=(0.4, 0.1, 0.05), children=(0.45, 0.05))
    run(c, w, 400)
    rows = c.slots.slots(["r0"])
    got = c.calibrator.calibrate_at(rows, np.array([0]), np.array([0.8]))[0]
    assert abs(got - 0.4) < 0.1, got


def test_mixed_batch_of_tree_and_chain_rows():
    """Chain rows (a proposer's refused requests) keep prefixes and learn as
    chains; tree rows are shaped node by node, in one allocation."""
    c = tree_controller(16)
    w = TreeWorld(3, Cost(0.02, 0.00002, 0.0005), nodes=16, tree_rows=2, chain_truth=0.7)
    sent = run(c, w, 200)
    for d in sent[1:]:
        assert d.parents[2] is None                      # the chain row stays a chain
        assert d.tokens[2] == [TOKEN_BASE + i for i in range(len(d.tokens[2]))]
        for i in range(2):   # trees (or paths) laid out parents first
            assert all(-1 <= p < k for k, p in enumerate(d.parents[i]))
    # The chain row learned its positions; its rate is near its truth.
    row = c.slots.slots(["r2"])
    assert abs(float(c.estimator.probs(row)[0, 0]) - 0.7) < 0.15
    assert np.mean([len(d.tokens[2]) for d in sent[100:]]) > 3
    assert c.stats()["trees"]["rows"] > 0


def test_trees_of_a_proposer_that_does_not_let_the_policy_shape_them_are_cut_as_before():
    """shapes_trees false (e.g. STAND): decisions are GoodputController's."""
    cost = Cost(0.02, 0.0004, 0.0)
    a, b = make_controller("goodput", {}, 16), GoodputController(16, _goodput_options())
    assert isinstance(a, TreeGoodputController)
    wa, wb = TreeWorld(2, cost, nodes=16, seed=3), TreeWorld(2, cost, nodes=16, seed=3)
    sa, sb = run(a, wa, 100), run(b, wb, 100)
    assert [d.tokens for d in sa] == [d.tokens for d in sb]


def _goodput_options():
    from vllm_plugins.proposers.draft_length import policy_options

    return policy_options("goodput", {})


def test_a_scheduler_cut_and_a_stale_record_are_read_safely():
    """The scheduler verified a prefix of the sent nodes; a record whose
    request's context moved on by other means teaches nothing."""
    c = tree_controller()
    parents, truth = make_tree(6, (0.6, 0.3), (0.8, 0.1))
    tokens = [TOKEN_BASE + i for i in range(6)]
    ctx = StepContext([_step("a", [1, 2], [2], 0)], max_draft=8)
    out = c.shape(ctx, Drafts([tokens], None, [truth.astype(np.float32)], [parents]),
                  c.observe(ctx))
    first = out.tokens[0][0]
    # Only the first sent node verified, and accepted; the bonus is OTHER.
    ctx2 = StepContext([_step("a", [1, 2, first, OTHER], [first, OTHER], 1)], max_draft=8)
    seen = c.tree_nodes_observed
    c.shape(ctx2, Drafts([tokens], None, [truth.astype(np.float32)], [parents]),
            c.observe(ctx2))
    assert c.tree_nodes_observed > seen
    # A context that does not continue the drafted one: nothing learned.
    seen = c.tree_nodes_observed
    ctx3 = StepContext([_step("a", [9, 9, 9, 9, 9, 9, 9, 9], [first], 2)], max_draft=8)
    c.observe(ctx3)
    assert c.tree_nodes_observed == seen


# ------------------------------------------------------------------ wiring

def test_token_recycling_tree_defaults_to_the_tree_policy_and_refuses_chain_readers():
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    p = TokenRecyclingProposer(options={"draft_shape": "tree"}, vocab_size=64)
    assert isinstance(p.controller, TreeGoodputController) and p.controller.shapes_trees
    for policy in ("acceptance", "confidence"):
        with pytest.raises(ValueError, match="'draft_length'"):
            TokenRecyclingProposer(options={"draft_shape": "tree", "draft_length": policy},
                                   vocab_size=64)
    TokenRecyclingProposer(options={"draft_shape": "tree", "draft_length": "fixed"},
                           vocab_size=64)
    TokenRecyclingProposer(options={"draft_length": "acceptance"}, vocab_size=64)


def test_trees_price_steps_at_their_context_unless_told_otherwise():
    """Goodput over trees fits the step cost with the context term by
    default (docs/draft_length_design.md, "Trees"); over chains without it; an
    explicit ``cost_features`` wins either way."""
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    def context_term(**options):
        return TokenRecyclingProposer(options=options, vocab_size=64).controller.cost.use_context

    assert context_term(draft_shape="tree")
    assert not context_term()
    assert not context_term(draft_shape="tree",
                            draft_length_options={"cost_features": "tokens+batch"})
    assert context_term(draft_length_options={"cost_features": "tokens+batch+context",
                                              "explore": 0.0})


def test_token_recycling_learns_the_tree_it_sent():
    """Under the tree policy the proposer records the nodes sent (a subset
    of its tree, re-laid), so the next step's verified rows are read
    against them."""
    from tests.test_token_recycling_tree import VOCAB, random_tables
    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

    p = TokenRecyclingProposer(options={"draft_shape": "tree"}, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    src = random_tables(rng, k=8, order=1, contexts=0, fill=1.0)
    p.tables.ids[...] = src.ids
    p.tables.logp[...] = src.logp
    ctx = StepContext([_step("a", [1, 2, 3, 4, 5], [5], 0)], max_draft=16)
    d = p.step(ctx)
    assert p.num_errors == 0 and d.parents[0] is not None and d.tokens[0]
    tokens, parents = p._drafted_trees["a"]
    assert tokens.tolist() == d.tokens[0] and parents.tolist() == d.parents[0]
    assert p.controller.stats()["trees"]["rows"] == 1
    n = len(d.tokens[0])
    ids = np.stack([rng.choice(VOCAB, 8, replace=False) for _ in range(n + 1)]).astype(np.int32)
    lps = np.log(np.full((n + 1, 8), 0.1, np.float32))
    step = RequestStep("a", np.asarray([d.tokens[0][0], 9]),
                       np.asarray([1, 2, 3, 4, 5, d.tokens[0][0], 9]), 2, n,
                       np.asarray([5] + d.tokens[0]), ids, lps, 0.0)
    p.learn(StepContext([step], max_draft=16))
    assert n >= 2 and parents.tolist() != list(range(-1, n - 1))   # a tree went out
    last_row = {tok: i + 1 for i, tok in enumerate(d.tokens[0])}   # learned node by node
    for tok, row in last_row.items():
        assert p.tables.ids[tok].tolist() == ids[row].tolist()


def test_token_recycling_trees_under_goodput_decode_as_the_target_does():
    """Token Recycling drafting trees, the policy shaping them, the tree
    path's greedy acceptance (vllm_plugins.tree.acceptance) and a
    synthetic target whose next token depends on the last two: the output
    is the target's own greedy sequence, with a chain request (sampling
    the tree path refuses) in the same batch."""
    from types import SimpleNamespace

    import torch

    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
    from vllm_plugins.tree.acceptance import greedy_accept
    from vllm_plugins.tree.draft import path_to

    vocab, k = 40, 8
    rng = np.random.default_rng(0)
    table = rng.integers(0, vocab, (vocab, vocab))
    table[rng.random((vocab, vocab)) < 0.5] = 0      # a few hot successors
    others = rng.integers(0, vocab, (vocab, k - 1))

    def target(seq):
        top = int(table[seq[-2], seq[-1]])
        ids = np.concatenate([[top], [t for t in others[seq[-1]] if t != top]])[:k]
        ids = np.pad(ids, (0, k - len(ids)), constant_values=ids[-1])
        return ids.astype(np.int32), np.log(np.linspace(0.5, 0.01, k)).astype(np.float32)

    plain = SimpleNamespace(structured_outputs=None, logprobs=None, prompt_logprobs=None,
                            presence_penalty=0.0, frequency_penalty=0.0,
                            repetition_penalty=1.0, bad_words=[], min_tokens=0)
    refused = SimpleNamespace(**{**vars(plain), "logprobs": 1})
    params = [plain, refused]
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 3, 1, 4], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8]]
    want = []
    for prompt in prompts:
        seq = list(prompt)
        while len(seq) < len(prompt) + 16 * 41:
            seq.append(int(target(seq)[0][0]))
        want.append(seq[len(prompt):])

    p = TokenRecyclingProposer(options={"draft_shape": "tree"}, vocab_size=vocab)
    p.max_draft = 16
    p.controller = make_controller("goodput", {}, 16)
    p.controller.can_rest, p.controller.shapes_trees = True, True
    contexts = [list(pr) + [int(target(pr)[0][0])] for pr in prompts]
    steps = [RequestStep(f"r{i}", np.asarray(c[-1:]), np.asarray(c), len(pr), 0,
                         np.asarray(c[-2:-1]), *[np.stack([a]) for a in target(c[:-1])],
                         0.0, params[i]) for i, (c, pr) in enumerate(zip(contexts, prompts))]
    seconds = None
    for _ in range(40):
        ctx = StepContext(steps, max_draft=16, last_step_seconds=seconds,
                          last_step_tokens=sum(len(s.verified_tokens) for s in steps))
        d = p.step(ctx)
        assert p.num_errors == 0
        steps, tree = [], False
        for i, (c, pr) in enumerate(zip(contexts, prompts)):
            toks = d.tokens[i]
            par = d.parents[i] if d.parents is not None and d.parents[i] is not None \
                else list(range(-1, len(toks) - 1))
            if params[i] is refused:
                assert par == list(range(-1, len(toks) - 1))
            tree |= par != list(range(-1, len(toks) - 1))
            rows = [target(c)] + [target(c + [toks[u] for u in path_to(par, v)])
                                  for v in range(len(toks))]
            got = greedy_accept([par], [toks], torch.as_tensor([r[0][0] for r in rows]))[0]
            contexts[i] = c + got.tokens
            steps.append(RequestStep(f"r{i}", np.asarray(got.tokens), np.asarray(contexts[i]),
                                     len(pr), len(toks), np.asarray([c[-1]] + toks),
                                     np.stack([r[0] for r in rows]),
                                     np.stack([r[1] for r in rows]), 0.0, params[i]))
        n = sum(len(s.verified_tokens) for s in steps)
        seconds = 0.07 + 0.0038 * n + (0.003 if tree else 0.0)
    for c, pr, w in zip(contexts, prompts, want):
        out = c[len(pr):]
        assert out == w[:len(out)]
    trees = p.controller.stats()["trees"]
    assert trees["rows"] > 0 and trees["mean_nodes_kept"] > 0 and trees["nodes_observed"] > 0


@pytest.mark.parametrize("accepted", [True, False])
def test_a_rest_ends_when_a_root_child_it_cut_would_have_been_accepted(accepted):
    """A tree decision that keeps no node, and a rest from the next step:
    the rest's first step still learns the root's children (the target's
    own token after the root). One of them carrying it, where the tree
    foresaw about 0.1, ends the rest; none carrying it does not."""
    c = tree_controller()
    c.can_rest = True
    for i in range(32):                      # each verified token costs a step
        tokens = 1 + i % 4
        c.cost.observe(tokens, 1, 0.05 * tokens + (0.01 if tokens > 1 else 0.0), tokens > 1)
    tokens, parents = [5, 6, 7], [-1, -1, 0]
    conf = np.array([0.05, 0.05, 0.5], np.float32)
    ctx = StepContext([_step("a", [1, 2], [2], 0)], max_draft=8)
    out = c.shape(ctx, Drafts([tokens], None, [conf], [parents]), c.observe(ctx))
    assert out.tokens[0] == [] and "a" in c._sent
    c.rest.left = c.rest.length = 8          # the decision began a rest
    c.rest.batch_ids = frozenset({"a"})
    emitted = [6 if accepted else 42]
    before = c.tree_nodes_observed
    obs = c.observe(StepContext([_step("a", [1, 2] + emitted, emitted, 0)], max_draft=8))
    assert obs.resting and c.tree_nodes_observed == before + 2   # both root children
    assert (c.rest.left == 0) == accepted, c.rest.left
    assert c.rest.length == (c.rest._REST_MIN if accepted else 8)


def _drafted_to_budget(cost, steps: int, budgeted: bool, **world):
    """(tokens per second, mean nodes drafted a step over the second half)
    of the tree policy in a world whose trees are best first, each row's
    tree cut to ``max_length`` when ``budgeted`` (as Token Recycling builds
    it) or offered whole."""
    c = tree_controller(16)
    w = TreeWorld(2, cost, nodes=16, **world)
    out, drafted = None, []
    for _ in range(steps):
        ctx = w.context_for(out)
        observation = c.observe(ctx)
        if observation.resting:
            out = Drafts([[] for _ in ctx.requests])
            continue
        d = w.drafts()
        if budgeted:
            for i, r in enumerate(ctx.requests):
                b = c.max_length(r.req_id, observation)
                d.tokens[i], d.parents[i] = d.tokens[i][:b], d.parents[i][:b]
                d.confidence[i] = d.confidence[i][:b]
        drafted.append(sum(map(len, d.tokens)))
        out = c.shape(ctx, d, observation)
    return w.emitted_total / w.seconds_total, float(np.mean(drafted[len(drafted) // 2:]))


@pytest.mark.parametrize("cost,fewer", [(Cost(0.07, 0.0038, 0.003), True),
                                         (Cost(0.02, 0.00002, 0.0005), False)])
def test_trees_are_drafted_to_what_the_rule_keeps(cost, fewer):
    """A tree row's budget follows the nodes the rule kept: where drafts are
    often wrong and each verified token costs (this CPU's curve) the
    proposer builds about half of ``num_speculative_tokens``, at the same
    goodput; where verified tokens are nearly free, all of it."""
    world = {"root_children": (0.3, 0.1, 0.05), "children": (0.5, 0.1)}
    whole_rate, whole_nodes = _drafted_to_budget(cost, 400, False, **world)
    rate, nodes = _drafted_to_budget(cost, 400, True, **world)
    assert whole_nodes == 32
    if fewer:
        assert nodes < 0.6 * whole_nodes, nodes
    else:
        assert nodes > 0.9 * whole_nodes, nodes
    assert rate > 0.97 * whole_rate, (rate, whole_rate)


def test_a_tree_steps_matrices_start_zeroed_and_apart_whatever_the_last_step_left():
    """The every-row-a-tree step's matrices are views of one kept buffer:
    each call hands them back zeroed, each its own memory, of the dtypes
    and shapes the pricing kernel writes."""
    c = make_controller("goodput", {}, 16)
    kinds = (np.float64, np.float64, np.int64, np.int64, np.bool_, np.bool_)
    for batch, width in ((1, 5), (3, 7), (1, 5)):
        got = c._empty_matrices(batch, width)
        for a, kind in zip(got, kinds):
            assert a.dtype == kind and a.flags.c_contiguous and a.flags.writeable
            assert a.shape == ((batch,) if kind is np.int64 else (batch, width))
            assert not a.any()
        for n, a in enumerate(got):   # what a step leaves behind
            a[...] = n + 1
        for n, a in enumerate(got):
            assert (a == (True if a.dtype == np.bool_ else n + 1)).all()
    again = c._empty_matrices(1, 5)
    assert all(not a.any() for a in again)
