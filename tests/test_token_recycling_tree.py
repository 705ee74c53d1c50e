"""Token Recycling's tree builders against plain Python references."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
from vllm_plugins.proposers.token_recycling_tables import RecyclingTables, context_hash
from vllm_plugins.proposers.token_recycling_tree import (BUILDERS, SPAN_MAX_MATCH,
                                                         SPAN_MIN_MATCH, TEMPLATE_PARENTS,
                                                         TEMPLATE_RANKS, TreeBuilder,
                                                         _find_span, learn_tree, span_logp)
from vllm_plugins.step_context import RequestStep, StepContext
from vllm_plugins.tree.sampling import tree_allowed

VOCAB = 40


def random_tables(rng, k=4, order=3, contexts=200, vocab=VOCAB, fill=0.9):
    """Tables with random top-k rows (sorted, distinct successors) and
    random context entries."""
    t = RecyclingTables(vocab, k, order, 4096)
    rows = np.flatnonzero(rng.random(vocab) < fill)
    for row in rows:
        succ = rng.choice(vocab, k, replace=False)
        p = np.sort(rng.dirichlet(np.ones(k + 2))[:k])[::-1]
        t.ids[row] = succ
        t.logp[row] = np.log(p)
    for _ in range(contexts):
        seq = rng.integers(0, vocab, order + 1)
        t.learn_context(seq, order, int(rng.integers(vocab)), float(np.log(rng.uniform(0.05, 1))))
    return t


# ------------------------------------------------------------ references

def ref_span(context, max_len):
    """Tokens after the latest earlier occurrence of the longest matching
    suffix (at most SPAN_MAX_MATCH), and the match length."""
    c = list(context)
    n = len(c)
    best, best_end = 0, -1
    for j in range(n - 2, -1, -1):
        m = 0
        while m < SPAN_MAX_MATCH and j - m >= 0 and c[j - m] == c[n - 1 - m]:
            m += 1
        if m > best:
            best, best_end = m, j
    if best < SPAN_MIN_MATCH:
        return [], 0
    return c[best_end + 1:best_end + 1 + max_len], best


def ref_candidates(t, path, span_tok, span_lp):
    """(token, log-probability) candidates of the node ending ``path``."""
    cands: dict[int, float] = {}
    order_seen: list[int] = []

    def offer(tok, lp):
        if tok in cands:
            cands[tok] = max(cands[tok], lp)
        elif lp > -math.inf:
            cands[tok] = lp
            order_seen.append(tok)

    rest = 0.0
    for n in range(min(t.context_order, len(path)), 1, -1):
        key = context_hash(path[-n:], n)
        if t.ctx_key[key % t.slots] == key:
            tok, lp = int(t.ctx_tok[key % t.slots]), float(t.ctx_logp[key % t.slots])
            offer(tok, lp)
            p = math.exp(lp)
            rest = math.log(1 - p) if p < 1 else -math.inf
            break
    for r in range(t.k):
        tok = int(t.ids[path[-1], r])
        if tok < 0:
            break
        offer(tok, float(t.logp[path[-1], r]) + rest)
    if span_tok is not None:
        offer(span_tok, span_lp)
    # stable sort, descending score
    return sorted(((tok, cands[tok]) for tok in order_seen), key=lambda x: -x[1])


def ref_best_first(t, context, budget, span, span_lp, min_lp=-math.inf):
    """Best-first with a plain list as the frontier: repeatedly take the
    candidate child of highest path log-probability (ties: first offered)."""
    order = max(t.context_order, 1)
    nodes = []   # (token, parent output index, path lp, span index of its span child)

    def path_of(u):  # tokens from the context's tail through node u
        toks = []
        while u >= 0:
            toks.append(nodes[u][0])
            u = nodes[u][1]
        return list(context[-order:]) + toks[::-1]

    def cands(u, s):
        tok = span[s] if s is not None and s < len(span) else None
        return ref_candidates(t, path_of(u)[-order:], tok, span_lp)

    frontier = []  # [lp, push counter, parent, candidate list, next rank]
    counter = itertools.count()
    root_c = cands(-1, 0 if span else None)
    root = {"c": root_c, "lp": 0.0, "s": 0 if span else None}
    info = {-1: root}
    if root_c:
        frontier.append([root_c[0][1], next(counter), -1])
    out_tok, out_par, out_p = [], [], []
    while frontier and len(out_tok) < budget:
        best = max(frontier, key=lambda e: (e[0], -e[1]))
        frontier.remove(best)
        lp, _, u = best
        if lp < min_lp:
            break
        pu = info[u]
        rank = pu.setdefault("next", 0)
        tok, clp = pu["c"][rank]
        pu["next"] = rank + 1
        v = len(out_tok)
        s = pu["s"]
        child_s = s + 1 if s is not None and s < len(span) and span[s] == tok else None
        nodes.append((tok, u, lp, child_s))
        out_tok.append(tok)
        out_par.append(u)
        out_p.append(math.exp(clp))
        if rank + 1 < len(pu["c"]):
            frontier.append([pu["lp"] + pu["c"][rank + 1][1], next(counter), u])
        if len(out_tok) < budget:
            c = cands(v, child_s)
            info[v] = {"c": c, "lp": lp, "s": child_s}
            if c:
                frontier.append([lp + c[0][1], next(counter), v])
    return out_tok, out_par, out_p


def check_tree(tokens, parents):
    assert len(tokens) == len(parents)
    for i, p in enumerate(parents):
        assert -1 <= p < i
    siblings = {}
    for tok, p in zip(tokens, parents):
        assert tok not in siblings.setdefault(p, set()), "duplicate sibling"
        siblings[p].add(tok)


# ----------------------------------------------------------------- tests

def test_template_is_the_papers_shape():
    assert len(TEMPLATE_PARENTS) == 80
    depth = []
    for p in TEMPLATE_PARENTS:
        depth.append(1 if p < 0 else depth[p] + 1)
    assert np.bincount(depth)[1:].tolist() == [8, 21, 25, 15, 8, 3]
    # children of a node take its top candidates, in rank order
    for p in set(TEMPLATE_PARENTS.tolist()):
        ranks = TEMPLATE_RANKS[TEMPLATE_PARENTS == p].tolist()
        assert ranks == list(range(len(ranks)))
    check_tree(list(range(80)), TEMPLATE_PARENTS.tolist())


@pytest.mark.parametrize("seed", range(12))
def test_best_first_matches_the_reference(seed):
    rng = np.random.default_rng(seed)
    t = random_tables(rng, k=int(rng.integers(1, 6)), order=int(rng.integers(1, 4)))
    context = rng.integers(0, 8, int(rng.integers(3, 30)))  # small alphabet: spans
    budget = int(rng.integers(1, 60))
    min_conf = [0.0, 0.02, 0.2][seed % 3]
    for branch in (False, True):
        tok, par, p = TreeBuilder(t, "best_first", branch).build(context, budget, min_conf)
        span, match = ref_span(context, budget) if branch else ([], 0)
        lp = span_logp(match) if span else 0.0
        want = ref_best_first(t, context, budget, span, lp,
                              math.log(min_conf) if min_conf > 0 else -math.inf)
        assert tok.tolist() == want[0]
        assert par.tolist() == want[1]
        np.testing.assert_allclose(p, want[2], rtol=1e-6)
        check_tree(tok.tolist(), par.tolist())
        assert len(tok) <= budget


def test_best_first_takes_the_most_probable_paths():
    """Without contexts or span, the tree is the budget's most probable
    root-down paths of the matrix, found here by enumerating them all."""
    rng = np.random.default_rng(7)
    t = random_tables(rng, k=2, order=1, contexts=0, fill=1.0)
    budget = 9
    tok, par, p = TreeBuilder(t, "best_first", False).build(np.array([3]), budget)
    paths = []
    for depth in range(1, budget + 1):
        for ranks in itertools.product(range(2), repeat=depth):
            last, lp = 3, 0.0
            for r in ranks:
                lp += float(t.logp[last, r])
                last = int(t.ids[last, r])
            paths.append(lp)
    paths.sort(reverse=True)
    path_lp = []
    for i in range(len(tok)):
        path_lp.append(math.log(p[i]) + (path_lp[par[i]] if par[i] >= 0 else 0.0))
    np.testing.assert_allclose(sorted(path_lp, reverse=True), paths[:budget], rtol=1e-6)
    assert path_lp == sorted(path_lp, reverse=True)  # best first


@pytest.mark.parametrize("builder", BUILDERS)
def test_chain_is_the_first_path_with_one_successor(builder):
    """k = 1 and no contexts: every node has one candidate, so the tree is
    a path, and that path is the chain walk's draft."""
    rng = np.random.default_rng(3)
    t = random_tables(rng, k=1, order=1, contexts=0)
    for start in range(VOCAB):
        chain, _ = t.chain([start], 6, 0.02)
        # the template's first path is 6 deep, its first 6 nodes are siblings
        budget = 6 if builder == "best_first" else 80
        tok, par, _ = TreeBuilder(t, builder, False).build(np.array([start]), budget, 0.02)
        assert tok.tolist() == chain
        assert par.tolist() == list(range(-1, len(chain) - 1))


@pytest.mark.parametrize("builder", BUILDERS)
def test_node_budget_is_respected(builder):
    rng = np.random.default_rng(11)
    t = random_tables(rng, k=8, order=3)
    tb = TreeBuilder(t, builder, True)
    for budget in (1, 2, 5, 17, 64, 80, 120):
        tok, par, p = tb.build(rng.integers(0, VOCAB, 12), budget)
        assert len(tok) <= min(budget, 80 if builder == "template" else budget)
        check_tree(tok.tolist(), par.tolist())
        assert np.all((p > 0) & (p <= 1))
    if builder == "best_first":  # a full matrix fills any budget
        assert len(tb.build(np.array([1, 2]), 120)[0]) == 120


@pytest.mark.parametrize("builder", BUILDERS)
def test_template_nodes_follow_the_ranks(builder):
    rng = np.random.default_rng(5)
    t = random_tables(rng, k=8, order=1, contexts=0, fill=1.0)
    tok, par, _ = TreeBuilder(t, "template", False).build(np.array([4]), 80)
    assert len(tok) == 80 and par.tolist() == TEMPLATE_PARENTS.tolist()
    for i, (p, r) in enumerate(zip(TEMPLATE_PARENTS, TEMPLATE_RANKS)):
        last = 4 if p < 0 else tok[p]
        assert tok[i] == t.ids[last, r]


@pytest.mark.parametrize("builder", BUILDERS)
def test_context_branch_when_the_context_repeats(builder):
    rng = np.random.default_rng(2)
    t = random_tables(rng, k=8, order=3)
    phrase = rng.integers(0, VOCAB, 24)
    context = np.concatenate([rng.integers(0, VOCAB, 10), phrase, rng.integers(0, VOCAB, 5),
                              phrase[:10]])
    span = phrase[10:].tolist()
    budget = 32 if builder == "best_first" else 80  # the template's 6 levels
    tok, par, _ = TreeBuilder(t, builder, True).build(context, budget)
    # the span is a root-down path of the tree
    node = -1
    for s in span[:6]:
        kids = [i for i in range(len(tok)) if par[i] == node and tok[i] == s]
        assert kids, f"span token {s} missing under node {node}"
        node = kids[0]
    off, _, _ = TreeBuilder(t, builder, False).build(context, budget)
    assert not np.array_equal(off, tok)


def test_span_lookup_matches_the_reference():
    rng = np.random.default_rng(4)
    out = np.zeros(64, np.int64)
    for _ in range(300):
        context = rng.integers(0, 4, int(rng.integers(1, 60)))
        n, match = _find_span(context, SPAN_MIN_MATCH, SPAN_MAX_MATCH, 64, out)
        want, want_match = ref_span(context, 64)
        assert out[:n].tolist() == want and (match == want_match or not want)


def test_learn_tree_writes_each_nodes_path():
    rng = np.random.default_rng(6)
    t = RecyclingTables(VOCAB, 4, 3, 1 << 16)
    context = rng.integers(0, VOCAB, 8)
    tokens = np.array([5, 6, 7, 8, 9])
    parents = np.array([-1, -1, 0, 1, 2])
    ids = np.stack([rng.choice(VOCAB, 4, replace=False) for _ in range(6)]).astype(np.int32)
    lps = np.log(np.sort(rng.dirichlet(np.ones(5), 6)[:, :4])[:, ::-1]).astype(np.float32)
    learn_tree(t, context, tokens, parents, ids, lps)
    paths = {-1: [int(context[-1])]}
    for i, p in enumerate(parents):
        paths[i] = paths[p] + [int(tokens[i])]
    for i in range(-1, len(tokens)):
        seq = list(context[:-1]) + paths[i]
        assert t.next_token(seq) == (ids[i + 1, 0], pytest.approx(lps[i + 1, 0]))
        assert t.ids[seq[-1]].tolist() == ids[i + 1].tolist()


# ---------------------------------------------------------- the proposer

def _step(req_id, context, accepted, sampling_params=None, verified=None, topk=None):
    verified = np.asarray(verified if verified is not None else context[-len(accepted) - 1:][:1])
    ids, lps = topk if topk is not None else (None, None)
    return RequestStep(req_id, np.asarray(accepted), np.asarray(context), 4, len(verified) - 1,
                       verified, ids, lps, 0.0, sampling_params)


def test_proposer_drafts_trees_and_chains_where_trees_cannot_serve():
    p = TokenRecyclingProposer(options={"draft_shape": "tree", "draft_length": "fixed"},
                               vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    src = random_tables(rng, k=8, order=1, contexts=0, fill=1.0)
    p.tables.ids[...] = src.ids
    p.tables.logp[...] = src.logp
    plain = SimpleNamespace(structured_outputs=None, logprobs=None, prompt_logprobs=None,
                            presence_penalty=0.0, frequency_penalty=0.0,
                            repetition_penalty=1.0, bad_words=[], min_tokens=0)
    penalised = SimpleNamespace(**{**vars(plain), "repetition_penalty": 1.2})
    assert tree_allowed(plain) and not tree_allowed(penalised)
    ctx = StepContext([_step("a", [1, 2, 3, 4, 5], [5], plain),
                       _step("b", [1, 2, 3, 4, 5], [5], penalised)], max_draft=16)
    d = p.step(ctx)
    assert len(d.tokens[0]) == 16 and d.parents[0] is not None
    check_tree(d.tokens[0], d.parents[0])
    assert d.parents[1] is None and 0 < len(d.tokens[1]) <= 16
    assert d.tokens[1] == p.tables.chain([5], 16, 0.02)[0]

    # the next step verified the whole tree: every node's row is learned
    tokens, parents = d.tokens[0], d.parents[0]
    ids = np.stack([rng.choice(VOCAB, 8, replace=False)
                    for _ in range(17)]).astype(np.int32)
    lps = np.log(np.full((17, 8), 0.1, np.float32))
    ctx = StepContext([_step("a", [1, 2, 3, 4, 5, tokens[0], 9], [tokens[0], 9], plain,
                             verified=[5] + tokens, topk=(ids, lps))], max_draft=16)
    p.learn(ctx)
    last_row = {tok: i + 1 for i, tok in enumerate(tokens)}  # a later node overwrites
    for tok, row in last_row.items():
        assert p.tables.ids[tok].tolist() == ids[row].tolist()


def test_bad_tree_options_name_the_option():
    with pytest.raises(ValueError, match="draft_shape"):
        TokenRecyclingProposer(options={"draft_shape": "forest"}, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="tree_builder"):
        TokenRecyclingProposer(options={"tree_builder": "dfs"}, vocab_size=VOCAB)
