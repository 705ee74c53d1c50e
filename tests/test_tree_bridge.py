"""The tree route on the runner, without an engine: which of vLLM's methods
and attention layers the bridge routes, from when (a runner's first drafted
tree), for which forward (the plan of the step running now), and that the
runner's sampling gives a seeded tree request acceptance's draws alone. The
tree step's pieces themselves are tests/test_tree_step.py's."""

from types import SimpleNamespace
from unittest import mock

import numpy as np
import torch

from tests.processor_fixtures import spec_decode_metadata
from tests.test_tree_step import TREE_A, TREE_B, make_plan
from vllm_plugins.bridge.v1 import tree_step


def test_attention_reads_the_plan_of_the_forward_running_now():
    """A runner's plan reaches the attention layers of its own step's
    forward only: not another runner's forward (here one run inside it, as
    ranks sharing a process could), not a later forward, not a layer run
    outside any forward. Everywhere else the layer runs vLLM's forward."""
    import functools

    from vllm_plugins.bridge.patching import Held
    from vllm_plugins.bridge.state import attach
    from vllm_plugins.bridge.v1 import runner as bridge_runner

    seen = []

    class Impl:   # an attention layer's impl; its class's forward is vLLM's
        attn_type = "decoder"

        def __init__(self, name):
            self.name = name

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output):
            seen.append(("vllm", self.name))

    attention = bridge_runner.wrap_cpu_attention(Impl.forward)

    def runner_with_layers(name, plan):
        runner = SimpleNamespace(impls=[Impl(name), Impl(name)])
        state = attach(runner)
        state.tree_step = plan
        # What route_trees holds: the route bound to each layer with the state.
        state.tree_attention = Held(None, "forward", tuple(runner.impls), tuple(
            (vars(i), functools.partial(attention, i, state)) for i in runner.impls))
        return runner

    def tree_attention(plan, impl, *args):
        seen.append((plan, impl.name))

    def layer(impl):
        impl.forward(None, None, None, None, None, object(), None)

    def model(runner, inside=None):  # two attention layers
        layer(runner.impls[0])
        if inside is not None:
            inside()
        layer(runner.impls[1])

    model_forward = bridge_runner.wrap_model_forward(model)
    plan_a = make_plan([("tree", TREE_A, 3)])[0]
    plan_b = make_plan([("tree", TREE_B, 5)])[0]
    runner_a = runner_with_layers("a", plan_a)
    runner_b = runner_with_layers("b", plan_b)
    with mock.patch.object(tree_step, "attend", tree_attention):
        model_forward(runner_a, lambda: model_forward(runner_b))
        layer(runner_a.impls[0])
        attach(runner_a).tree_step = None  # the step sampled: a chain step next
        model_forward(runner_a)
    assert seen == [(plan_a, "a"), (plan_b, "b"), (plan_b, "b"), (plan_a, "a"),
                    ("vllm", "a"), ("vllm", "a"), ("vllm", "a")]


def test_a_runner_gets_the_tree_route_when_it_drafts_its_first_tree():
    """vLLM's methods and attention stay as they are (no wrapper of ours)
    in a runner until its proposer drafts a tree, and in every other
    runner; from then on the runner's step and every attention layer of its
    model are routed, and a tree step plans."""
    import vllm_plugins.bridge as bridge
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_plugins.bridge.patching import MARK, applied_to
    from vllm_plugins.bridge.patches import named
    from vllm_plugins.bridge.state import attach, state_of
    from vllm_plugins.bridge.v1 import runner as bridge_runner
    from vllm_plugins.bridge.v1 import step

    bridge.install()
    runner_route = [named(n) for n in bridge_runner.RUNNER_TREE_ROUTE]
    attention = named(bridge_runner.ATTENTION_TREE_ROUTE)
    for patch in runner_route + [attention]:
        owner, attr = patch.owner_and_attr()
        assert not hasattr(getattr(owner, attr), MARK)  # the class keeps vLLM's

    def fake_runner():
        impls = [object.__new__(CPUAttentionBackendImpl) for _ in range(3)]
        model = torch.nn.Module()
        for i, impl in enumerate(impls):
            layer = torch.nn.Module()
            layer.impl = impl
            model.add_module(f"layer{i}", layer)
        runner = object.__new__(GPUModelRunner)
        runner.get_model = lambda: model
        return runner, impls

    def routed(runner, impls):
        held = state_of(runner).tree_attention
        ready = [] if held is None else held.objects
        return ([applied_to(p, runner) for p in runner_route],
                [any(i is r for r in ready) for i in impls])

    tree_runner, tree_impls = fake_runner()
    chain_runner, chain_impls = fake_runner()
    state = attach(tree_runner, proposer=object())
    attach(chain_runner, proposer=object())

    def drafts(runner, state, *args):
        if runner is tree_runner and state.counters.steps == 3:
            state.trees = {"r0": object()}   # recorded by step.record_trees
        return [[1, 2]]

    propose = bridge_runner.wrap_propose(lambda *args: None)
    with mock.patch.object(step, "propose", drafts):
        for n in range(1, 5):
            for runner in (tree_runner, chain_runner):
                propose(runner, None, [[1]], None, None, None, None, None)
            if n < 3:
                assert routed(tree_runner, tree_impls) == ([False] * 2, [False] * 3)
    assert routed(tree_runner, tree_impls) == ([True] * 2, [True] * 3)
    assert routed(chain_runner, chain_impls) == ([False] * 2, [False] * 3)
    assert all(n not in vars(chain_runner) for n in ("_prepare_inputs", "_model_forward"))
    assert all("forward" not in vars(i) for i in chain_impls)

    assert tree_runner._prepare_inputs.__func__ is runner_route[0].replacement()
    # The attention route is on the layers for a tree step's forward alone.
    assert all("forward" not in vars(i) for i in tree_impls)
    during = []

    def forward(runner):
        during.append([vars(i).get("forward") for i in tree_impls])

    model_forward = bridge_runner.wrap_model_forward(forward)
    tree_state = state_of(tree_runner)
    tree_state.tree_step = object()
    model_forward(tree_runner)
    tree_state.tree_step = None
    model_forward(tree_runner)
    assert [m.func for m in during[0]] == [attention.replacement()] * 3
    assert [m.args for m in during[0]] == [(i, tree_state) for i in tree_impls]
    assert during[1] == [None] * 3
    assert all("forward" not in vars(i) for i in tree_impls)


def tree_sample_step(batch, seed, tree_rows, tree_tokens):
    """One step of ``runner.tree_sample`` with vLLM's own ``_sample`` (its
    rejection sampler on CPU tensors): ``batch`` is a list of ("tree", 0),
    ("chain", drafts) or ("prefill", prompt tokens); every request samples
    at temperature 1, each seeded (the tree request with ``seed``). Returns
    the tree request's emitted tokens."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_plugins.bridge.v1 import runner as bridge_runner
    from vllm_plugins.bridge.state import attach

    vocab = tree_rows.shape[1]
    other = torch.Generator().manual_seed(99)
    req_ids, num_sched, drafts, trees, rows, layout = [], [], {}, {}, [], []
    for b, (kind, n) in enumerate(batch):
        rid = f"r{b}"
        req_ids.append(rid)
        if kind == "tree":
            trees[rid] = tree_step.ProposedTree(list(tree_tokens), list(TREE_A), None)
            drafts[rid] = list(tree_tokens)
            num_sched.append(len(TREE_A) + 1)
            rows.append(tree_rows)
            layout.append(list(tree_tokens))
        elif kind == "chain":
            drafts[rid] = [1 + k % (vocab - 1) for k in range(n)]
            num_sched.append(n + 1)
            rows.append(torch.randn(n + 1, vocab, generator=other))
            layout.append(drafts[rid])
        else:  # a prefill: one row, no drafts
            num_sched.append(n)
            rows.append(torch.randn(1, vocab, generator=other))
            layout.append([])
    total = sum(num_sched)
    plan = tree_step.plan(trees, req_ids, np.array(num_sched), np.full(len(batch), 8),
                          drafts, np.arange(total))
    meta = spec_decode_metadata(layout)
    n = len(batch)
    tree_index = [k for k, _ in batch].index("tree")
    gens = {b: torch.Generator().manual_seed(seed if b == tree_index else 1000 + b)
            for b in range(n)}
    sm = SamplingMetadata(
        temperature=torch.ones(n), all_greedy=False, all_random=True, top_p=None,
        top_k=None, generators=gens, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors())
    runner = SimpleNamespace(
        input_batch=SimpleNamespace(sampling_metadata=sm,
                                    update_async_output_token_ids=lambda: None),
        use_async_scheduling=False, _get_spec_decode_draft_probs=lambda m: None,
        rejection_sampler=RejectionSampler(Sampler()), sampler=Sampler(),
        requests={rid: SimpleNamespace(sampling_params=SimpleNamespace(temperature=1.0))
                  for rid in req_ids},
        kv_caches=[])
    attach(runner)
    original = getattr(GPUModelRunner._sample, "__wrapped__", GPUModelRunner._sample)
    out = bridge_runner.tree_sample(runner, original, plan, torch.cat(rows), meta)
    row = out.sampled_token_ids[tree_index].tolist()
    return [t for t in row if t != tree_step.PLACEHOLDER_TOKEN_ID]


def test_a_seeded_tree_request_draws_the_same_alone_and_beside_others():
    """vLLM's rejection sampler draws from the generator of every seeded
    request with drafts (bonus, uniform and recovered draws); for a tree
    request tree acceptance draws again. Its tokens must be acceptance's
    draws alone: the same seed gives the same tokens in a step of its own,
    beside a prefill and beside chain requests."""
    import vllm_plugins

    from vllm.platforms import current_platform

    vllm_plugins.register()  # vLLM's CPU build needs the bridge's expand fix
    # Without Triton, vLLM's rejection kernels are C++ overrides, which the
    # CPU platform registers as a worker starts.
    current_platform.register_triton_kernel_overrides()
    vocab = 12
    tokens = [3, 5, 7, 9, 11, 2]
    gen = torch.Generator().manual_seed(0)
    tree_rows = torch.randn(len(TREE_A) + 1, vocab, generator=gen)
    # The target likes the tree's nodes: paths get accepted, not only roots.
    for i, p in enumerate(TREE_A):
        tree_rows[p + 1, tokens[i]] += 2.0
    mixes = {"alone": [("tree", 0)],
             "beside a prefill": [("prefill", 5), ("tree", 0)],
             "beside chains": [("chain", 3), ("tree", 0), ("chain", 1)]}
    accepted = 0
    for seed in range(24):
        got = {name: tree_sample_step(batch, seed, tree_rows, tokens)
               for name, batch in mixes.items()}
        assert got["beside a prefill"] == got["alone"], (seed, got)
        assert got["beside chains"] == got["alone"], (seed, got)
        accepted += len(got["alone"]) - 1
    assert accepted > 0
