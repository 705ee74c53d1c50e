"""The tree step's pieces without an engine, each against a plain reference:
positions by depth, per-batch masks, attention over a paged CPU cache,
acceptance written into vLLM's output, the K/V move's slots, and the rules
that send a request's tree to vLLM as a chain. How the runner routes a step
through them is tests/test_tree_bridge.py's."""

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from vllm_plugins.bridge.v1 import tree_step
from vllm_plugins.kernels.cache_layout import cpu_cache_views
from vllm_plugins.step_context import Drafts
from vllm_plugins.tree.sampling import tree_allowed

TREE_A = [-1, -1, 0, 0, 2, 1]  # two root children, a deeper left branch
TREE_B = [-1, 0, 0, 1]


def ref_ancestors(parents, i):
    """Nodes on the path root -> i (i included), by walking parent links."""
    out = []
    while i >= 0:
        out.append(i)
        i = parents[i]
    return out


def make_plan(batch, block_size=4, num_blocks=32, seed=0):
    """batch: list of (kind, query_len or parents, num_computed). Returns the
    plan, the trees dict and the per-request slots (from a block table)."""
    rng = np.random.default_rng(seed)
    req_ids, num_sched, num_comp, drafts, trees = [], [], [], {}, {}
    tables = []
    free = list(rng.permutation(num_blocks))
    slot_mapping = []
    for b, (kind, spec, nc) in enumerate(batch):
        rid = f"r{b}"
        req_ids.append(rid)
        q = len(spec) + 1 if kind == "tree" else int(spec)
        num_sched.append(q)
        num_comp.append(nc)
        blocks = [free.pop() for _ in range(-(-(nc + q) // block_size))]
        tables.append(blocks)
        slot_mapping += [blocks[p // block_size] * block_size + p % block_size
                         for p in range(nc, nc + q)]
        if kind == "tree":
            toks = [int(t) for t in rng.integers(5, 50, len(spec))]
            trees[rid] = tree_step.ProposedTree(toks, list(spec), None)
            drafts[rid] = toks
        elif kind == "chain" and q > 1:
            drafts[rid] = [int(t) for t in rng.integers(5, 50, q - 1)]
    plan = tree_step.plan(trees, req_ids, np.array(num_sched), np.array(num_comp),
                          drafts, np.array(slot_mapping))
    return plan, trees, tables, num_sched, num_comp


def test_positions_by_depth_against_ancestor_count():
    batch = [("chain", 5, 7), ("tree", TREE_A, 12), ("chain", 3, 4), ("tree", TREE_B, 0)]
    plan, _, _, num_sched, num_comp = make_plan(batch)
    assert [r.batch_index for r in plan.requests] == [1, 3]
    total = sum(num_sched)
    standard = torch.cat([torch.arange(nc, nc + q) for q, nc in zip(num_sched, num_comp)])
    positions = standard.clone()
    tree_step.depth_positions(plan, positions)
    start = 0
    for (kind, spec, nc), q in zip(batch, num_sched):
        got = positions[start:start + q].tolist()
        if kind == "tree":
            want = [nc] + [nc + len(ref_ancestors(spec, i)) for i in range(len(spec))]
        else:
            want = list(range(nc, nc + q))
        assert got == want, (kind, got, want)
        start += q
    assert start == total


def test_step_mask_against_ancestry_reference():
    parents_list = [None, TREE_A, None, TREE_B]
    lens = [5, len(TREE_A) + 1, 1, len(TREE_B) + 1]
    mask = tree_step.step_mask(parents_list, lens)
    assert mask.shape == (sum(lens), max(lens))
    start = 0
    for parents, q in zip(parents_list, lens):
        for t in range(q):
            for s in range(mask.shape[1]):
                if parents is None:
                    want = s <= t
                elif s >= q:
                    want = False
                elif t == 0 or s == 0:
                    want = s == 0
                else:
                    want = (s - 1) in ref_ancestors(parents, t - 1)
                assert bool(mask[start + t, s]) == want, (parents, t, s)
        start += q
    # One tree alone (the common step) is its own block.
    for parents in (TREE_A, TREE_B):
        q = len(parents) + 1
        got = tree_step.step_mask([parents], [q])
        start = sum(lens[:parents_list.index(parents)])
        assert got.shape == (q, q) and got.dtype == np.bool_
        assert np.array_equal(got, mask[start:start + q, :q])
    with pytest.raises(ValueError, match="query tokens"):
        tree_step.step_mask([TREE_B], [3])


def ref_attention(q, keys, values, scale):
    """q [Hq, D], keys/values [n, H, D]: plain softmax attention with GQA."""
    hq, h = q.shape[0], keys.shape[1]
    out = torch.empty_like(q)
    for head in range(hq):
        kv = head // (hq // h)
        w = torch.softmax((keys[:, kv] @ q[head]) * scale, dim=0)
        out[head] = w @ values[:, kv]
    return out


def cpu_attention_step(batch, block_size=32, num_blocks=32, heads=4, kv_heads=2, dim=64):
    """A planned step over a random CPU-layout cache, with vLLM's own CPU
    attention (impl, layer, full-batch metadata) around it."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackendImpl, CPUAttentionMetadata, _get_attn_isa)

    plan, trees, tables, num_sched, num_comp = make_plan(batch, block_size, num_blocks)
    gen = torch.Generator().manual_seed(0)
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * dim, generator=gen)
    total = sum(num_sched)
    query = torch.randn(total, heads, dim, generator=gen)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    seq_lens = torch.tensor([q + nc for q, nc in zip(num_sched, num_comp)], dtype=torch.int32)
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(num_sched)]), dtype=torch.int32)
    isa = _get_attn_isa(torch.float32, block_size, dim)
    # The impl reads the model's dtype from the current vLLM config at init.
    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.float32))
    with mock.patch("vllm.v1.attention.backends.cpu_attn.get_current_vllm_config",
                    return_value=config):
        impl = CPUAttentionBackendImpl(heads, dim, 0.3, kv_heads, None, None, "auto")
    layer = SimpleNamespace(isa=isa, _k_scale_float=1.0, _v_scale_float=1.0)
    meta = CPUAttentionMetadata(
        num_actual_tokens=total, max_query_len=max(num_sched), query_start_loc=qsl,
        max_seq_len=int(seq_lens.max()), seq_lens=seq_lens, block_table=block_table,
        slot_mapping=torch.zeros(total, dtype=torch.int64),
        scheduler_metadata=ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(batch), num_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
            seq_lens=seq_lens, dtype=torch.float32, query_start_loc=qsl, causal=True,
            sliding_window_size=-1, isa=isa, enable_kv_split=False))
    return SimpleNamespace(plan=plan, tables=tables, num_sched=num_sched, kv_cache=kv_cache,
                           query=query, meta=meta, impl=impl, layer=layer,
                           block_size=block_size, total=total)


def run_attend(s):
    """The step through tree_step.attend with vLLM's forward for the other
    requests; returns the output and the rows vLLM's forward was given."""
    seen = []

    def vllm_forward(impl, layer, q, key, value, kv_cache, metadata, out):
        seen.append(int(metadata.num_actual_tokens))
        impl.forward(layer, q, key, value, kv_cache, metadata, out)

    output = torch.full((s.total, *s.query.shape[1:]), 7.0)
    tree_step.attend(s.plan, s.impl, s.layer, s.query, None, None, s.kv_cache, s.meta, output,
                     vllm_forward)
    return output, seen


def test_attend_computes_tree_rows_by_ancestry_and_other_rows_once_by_vllm():
    batch = [("chain", 3, 6), ("tree", TREE_A, 40), ("chain", 1, 70), ("tree", TREE_B, 2)]
    s = cpu_attention_step(batch)
    output, seen = run_attend(s)
    assert seen == [3 + 1]  # vLLM's op ran once, on the chain rows only
    vllm_all = torch.zeros_like(output)
    s.impl.forward(s.layer, s.query, None, None, s.kv_cache, s.meta, vllm_all)
    keys, values = cpu_cache_views(s.kv_cache)

    def kv_at(b, pos):
        blk = s.tables[b][pos // s.block_size]
        return keys[blk, pos % s.block_size], values[blk, pos % s.block_size]

    start = 0
    for b, ((kind, spec, nc), q) in enumerate(zip(batch, s.num_sched)):
        for t in range(q):
            row = output[start + t]
            if kind != "tree":  # as vLLM's op over the whole batch gives it
                torch.testing.assert_close(row, vllm_all[start + t], rtol=1e-5, atol=1e-5)
                continue
            visible = list(range(nc))  # committed prefix
            visible += [nc] if t == 0 else [nc] + sorted(
                nc + 1 + i for i in ref_ancestors(spec, t - 1))
            ks = torch.stack([kv_at(b, p)[0] for p in visible])
            vs = torch.stack([kv_at(b, p)[1] for p in visible])
            want = ref_attention(s.query[start + t], ks, vs, 0.3)
            torch.testing.assert_close(row, want, rtol=1e-5, atol=1e-5)
            if t > 1 and spec[t - 1] != t - 2:  # a branch: vLLM's causal row differs
                assert (vllm_all[start + t] - want).abs().max() > 1e-3
        start += q
    s.meta.num_actual_tokens = s.total + 1
    with pytest.raises(RuntimeError, match="planned"):
        run_attend(s)


def test_attend_runs_no_vllm_attention_when_every_request_is_a_tree():
    s = cpu_attention_step([("tree", TREE_A, 33), ("tree", TREE_B, 5)])
    output, seen = run_attend(s)
    assert seen == []
    assert not torch.any(output == 7.0)


def test_kv_move_puts_the_accepted_path_at_chain_slots():
    block_size, num_blocks, kv_heads, dim = 4, 32, 2, 8
    plan, _, tables, num_sched, num_comp = make_plan(
        [("tree", TREE_A, 5), ("chain", 2, 3), ("tree", TREE_B, 14)], block_size, num_blocks)
    gen = torch.Generator().manual_seed(1)
    cache = torch.randn(num_blocks, kv_heads, block_size, 2 * dim, generator=gen)
    before = cache.clone()
    paths = [[1, 5], [0, 2]]  # TREE_A: right branch; TREE_B: second child of node 0
    src, dst = [], []
    for r, path in zip(plan.requests, paths):
        s, d = tree_step.kv_moves(r, path)
        # Plain reference: node i sits at position nc + 1 + i, depth j at nc + j.
        b = r.batch_index

        def slot(pos):
            return tables[b][pos // block_size] * block_size + pos % block_size
        want = [(slot(r.num_computed + 1 + i), slot(r.num_computed + 1 + j))
                for j, i in enumerate(path) if i != j]
        assert list(zip(s, d)) == want
        src += s
        dst += d
    tree_step.move_accepted_kv([cache, cache], src, dst)  # shared caches move once
    k0, v0 = cpu_cache_views(before)
    k1, v1 = cpu_cache_views(cache)
    nb = lambda s: (s // block_size, s % block_size)  # noqa: E731
    for s, d in zip(src, dst):
        assert torch.equal(k1[nb(d)], k0[nb(s)]) and torch.equal(v1[nb(d)], v0[nb(s)])
    moved = {nb(d) for d in dst}
    for blk in range(num_blocks):
        for off in range(block_size):
            if (blk, off) not in moved:
                assert torch.equal(k1[blk, off], k0[blk, off])


def test_accept_writes_emitted_tokens_into_vllm_output():
    plan, trees, _, num_sched, _ = make_plan(
        [("chain", 3, 4), ("tree", TREE_A, 8), ("tree", TREE_B, 1)])
    vocab = 64
    num_draft = [2, len(TREE_A), len(TREE_B)]
    starts = tree_step.request_rows(plan, num_draft)
    assert starts == [3, 3 + len(TREE_A) + 1]
    logits = torch.randn(sum(n + 1 for n in num_draft), vocab)
    ra, rb = plan.requests
    # Tree A: the target agrees with node 1 at the root, then node 5 at
    # node 1, then says 3 (not node 5's child: none): path [1, 5], bonus 3.
    logits[starts[0] + 0, ra.tokens[1]] = 100
    logits[starts[0] + 2, ra.tokens[5]] = 100
    logits[starts[0] + 6, 3] = 100
    # Tree B: the target rejects every root child.
    wrong = next(t for t in range(vocab) if t != rb.tokens[0])
    logits[starts[1] + 0, wrong] = 100
    index = torch.cat([torch.arange(s, s + len(r.tokens) + 1)
                       for s, r in zip(starts, plan.requests)])
    greedy = SimpleNamespace(temperature=0.0)
    results = tree_step.accept(plan, [greedy, greedy], logits[index], num_draft, None)
    assert results[0].nodes == [1, 5] and results[0].tokens == [ra.tokens[1], ra.tokens[5], 3]
    assert results[1].nodes == [] and results[1].tokens == [wrong]
    out = torch.full((3, max(num_draft) + 1), 11, dtype=torch.int32)
    tree_step.write_output(out, plan, results)
    assert out[0].tolist() == [11] * out.shape[1]  # the chain's row is vLLM's
    assert out[1].tolist() == [ra.tokens[1], ra.tokens[5], 3] + [-1] * (out.shape[1] - 3)
    assert out[2].tolist() == [wrong] + [-1] * (out.shape[1] - 1)
    with pytest.raises(RuntimeError, match="drafts"):
        tree_step.request_rows(plan, [2, len(TREE_A) - 1, len(TREE_B)])


def test_plan_follows_the_scheduler_cut_and_ignores_what_it_did_not_propose():
    trees = {"a": tree_step.ProposedTree([5, 6, 7, 8], [-1, -1, 0, 1], None),
             "b": tree_step.ProposedTree([5, 6, 7], [-1, 0, -1], None)}
    slots = np.arange(100)
    # a: cut to 2 nodes, still a tree; b: cut to 2 nodes, a chain: vLLM's.
    plan = tree_step.plan(trees, ["a", "b"], np.array([3, 3]), np.array([4, 9]),
                          {"a": [5, 6], "b": [5, 6]}, slots)
    assert [r.req_id for r in plan.requests] == ["a"]
    assert plan.requests[0].parents == [-1, -1] and plan.requests[0].tokens == [5, 6]
    assert plan.requests[0].slots.tolist() == [0, 1, 2]
    # Scheduled tokens that are not what we proposed: no tree step.
    assert tree_step.plan(trees, ["a"], np.array([3]), np.array([4]),
                          {"a": [5, 9]}, slots) is None
    # A prompt chunk (query longer than drafts + 1): no tree step.
    assert tree_step.plan(trees, ["a"], np.array([5]), np.array([4]),
                          {"a": [5, 6]}, slots) is None


def test_requests_the_tree_cannot_serve_go_out_as_their_chain_prefix():
    from vllm import SamplingParams

    tokens = [[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7], [5, 6]]
    parents = [[-1, 0, 0, 2], [-1, 0, 0, 2], [-1, 0, 1], None]
    probs = [np.ones((4, 3)), np.ones((4, 3)), None, None]
    params = {"plain": SamplingParams(temperature=0.0),
              "logprobs": SamplingParams(temperature=0.0, logprobs=1),
              "chain": SamplingParams(), "none": SamplingParams()}
    req_ids = list(params)
    trees = {"stale": None, "logprobs": "old"}
    out, out_probs = tree_step.record_drafts(trees, req_ids, Drafts(tokens, probs, None, parents),
                                             params.get, capable=True)
    assert out == [[5, 6, 7, 8], [5, 6], [5, 6, 7], [5, 6]]
    assert out_probs[1].shape == (2, 3) and out_probs[0].shape == (4, 3)
    assert set(trees) == {"plain", "stale"}  # 'logprobs' dropped, chains not kept
    assert trees["plain"].parents == [-1, 0, 0, 2]
    # A runner that cannot verify trees: every tree goes out as its chain.
    trees = {}
    out, _ = tree_step.record_drafts(trees, req_ids, Drafts(tokens, probs, None, parents),
                                     params.get, capable=False)
    assert out == [[5, 6], [5, 6], [5, 6, 7], [5, 6]] and trees == {}
    for p in (SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=3),
              SamplingParams(bad_words=["x"]), SamplingParams(logit_bias={1: 1.0}),
              SamplingParams(repetition_penalty=1.2), SamplingParams(min_p=0.1)):
        assert not tree_allowed(p), p
    assert tree_allowed(SamplingParams(temperature=0.7, top_k=5, seed=3))


def test_the_kept_host_move_follows_the_runners_caches():
    """The runner's kept views (``host_layers_of``) serve a step's move on
    the caches it was made for, and a new list of caches is prepared
    afresh: a move lands in the caches of the list it is given, bf16 and
    float32 alike, and nowhere else."""
    views = {}
    src, dst = [9, 3], [3, 4]   # slot 3 is read before it is written
    for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
        gen = torch.Generator().manual_seed(7)
        caches = [torch.randn(6, 2, 4, 2 * 8, generator=gen).to(dtype) for _ in range(3)]
        before = [c.clone() for c in caches]
        tree_step.move_accepted_kv(caches, src, dst, views)
        for cache, old in zip(caches, before):
            k0, v0 = cpu_cache_views(old)
            k1, v1 = cpu_cache_views(cache)
            for s, d in zip(src, dst):
                assert torch.equal(k1[d // 4, d % 4], k0[s // 4, s % 4])
                assert torch.equal(v1[d // 4, d % 4], v0[s // 4, s % 4])
            untouched = [b * 4 + o for b in range(6) for o in range(4) if b * 4 + o not in dst]
            for slot in untouched:
                assert torch.equal(k1[slot // 4, slot % 4], k0[slot // 4, slot % 4])


def test_a_tree_with_bad_parents_goes_out_as_its_chain_prefix():
    trees = {}
    out, _ = tree_step.record_drafts(trees, ["a"], Drafts([[5, 6, 7, 8]], None, None,
                                                          [[-1, 0, 3, 1]]),
                                     lambda _: None, capable=True)
    assert out == [[5, 6]] and trees == {}


def sampling_metadata(temperature, top_k, generators):
    from vllm.v1.sample.metadata import SamplingMetadata

    b = len(temperature)
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32), all_greedy=False,
        all_random=False, top_p=None, top_k=torch.tensor(top_k, dtype=torch.int32),
        generators=generators, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(b),
        presence_penalties=torch.zeros(b), repetition_penalties=torch.ones(b),
        output_token_ids=[[] for _ in range(b)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=None)


def test_sampled_acceptance_draws_from_vllms_processed_rows():
    """First emitted token of a sampled tree request against vLLM's own
    processing (temperature, then top-k) of its root row; the unprocessed
    row, the control, is told apart. A seeded request draws from its own
    generator only."""
    import vllm_plugins
    from tests.test_stand import chi2_pvalue

    vllm_plugins.register()  # vLLM's CPU build needs the bridge's expand fix
    plan, _, _, _, _ = make_plan([("chain", 2, 3), ("tree", TREE_A, 5), ("tree", TREE_B, 7)])
    vocab = 12
    temps, top_k = [0.0, 0.5, 1.0], [vocab, 4, vocab]
    num_draft = [1, len(TREE_A), len(TREE_B)]
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(n + 1 for n in num_draft), vocab, generator=gen) * 2
    starts = tree_step.request_rows(plan, num_draft)
    index = torch.cat([torch.arange(s, s + len(r.tokens) + 1)
                       for s, r in zip(starts, plan.requests)])
    tree_logits = logits[index]
    params = [SimpleNamespace(temperature=0.5), SimpleNamespace(temperature=1.0)]
    trials = 1500
    torch.manual_seed(0)
    counts = np.zeros(vocab)
    seeded = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a thread pool only adds waiting
    try:
        for t in range(trials):
            meta = sampling_metadata(temps, top_k, {2: torch.Generator().manual_seed(t % 7)})
            got = tree_step.accept(plan, params, tree_logits, num_draft, meta)
            counts[got[0].tokens[0]] += 1
            seeded.append(tuple(got[1].tokens))
    finally:
        torch.set_num_threads(threads)
    root = tree_logits[0] / 0.5
    kth = root.topk(4).values[-1]
    want = torch.softmax(root.masked_fill(root < kth, float("-inf")), dim=-1).numpy()
    assert chi2_pvalue(counts[want > 0], want[want > 0]) > 1e-3
    assert counts[want == 0].sum() == 0
    control = torch.softmax(tree_logits[0], dim=-1).numpy()
    assert chi2_pvalue(counts, control) < 1e-6
    # Same seed, same draw, whatever the unseeded request drew.
    for t in range(7, trials, 97):
        assert seeded[t] == seeded[t % 7]


def test_acceptance_reads_the_same_argmax_from_the_topk_stash():
    """Greedy tree rows' argmax read from the step's top-k stash (the
    blocked host path) accepts what a pass over the rows does: ties go to
    the lower id, and a request whose rows hold a NaN or an infinity is
    read whole."""
    from vllm_plugins.topk import first_is_argmax, topk_logprobs_numpy

    plan, _, _, _, _ = make_plan([("chain", 3, 4), ("tree", TREE_A, 8), ("tree", TREE_B, 1)])
    num_draft = [2, len(TREE_A), len(TREE_B)]
    starts = tree_step.request_rows(plan, num_draft)
    rng = np.random.default_rng(5)
    greedy = SimpleNamespace(temperature=0.0)
    for trial in range(20):
        logits = torch.from_numpy(rng.normal(size=(sum(n + 1 for n in num_draft), 1280))
                                  .astype(np.float32))
        for s, r in zip(starts, plan.requests):
            for j, node in enumerate(r.tokens):   # the target agrees on some nodes
                if rng.random() < 0.6:
                    logits[s + 1 + r.parents[j], node] = 30.0
        row = starts[0] + int(rng.integers(0, len(TREE_A) + 1))
        logits[row, 700] = logits[row, 1100] = 60.0   # a tie: the lower id wins
        if trial % 3 == 0:
            logits[starts[1] + 1, int(rng.integers(0, 1280))] = \
                float("nan") if trial % 2 else float("inf")
        assert first_is_argmax(logits, 8)
        lps, ids = topk_logprobs_numpy(logits, 8)
        top1 = tree_step.stash_top1(ids, lps, starts, plan)
        assert (top1[1] is None) == (trial % 3 == 0)
        index = torch.cat([torch.arange(s, s + len(r.tokens) + 1)
                           for s, r in zip(starts, plan.requests)])
        want = tree_step.accept(plan, [greedy, greedy], logits[index], num_draft, None)
        got = tree_step.accept(plan, [greedy, greedy], logits[index], num_draft, None, top1)
        assert [(a.nodes, a.tokens) for a in got] == [(a.nodes, a.tokens) for a in want]


def test_a_step_of_trees_only_makes_the_output_write_output_fills():
    plan, _, _, _, _ = make_plan([("tree", TREE_A, 8), ("tree", TREE_B, 1)])
    results = [SimpleNamespace(tokens=[4, 5, 6]), SimpleNamespace(tokens=[9])]
    made = tree_step.trees_output(plan, results, 2, 7, "cpu").sampled_token_ids
    out = torch.full((2, 8), -1, dtype=torch.int32)
    tree_step.write_output(out, plan, results)
    assert made.dtype == torch.int32 and torch.equal(made, out)
    assert made[plan.requests[0].batch_index].tolist() == [4, 5, 6] + [-1] * 5
