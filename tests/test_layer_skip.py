"""SWIFT's skip-set search, DEL's exit choice, and their options, without an
engine (tests/test_layer_skip_e2e.py runs them inside vLLM)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_plugins.proposers.layer_skip.base import DraftVocab
from vllm_plugins.proposers.layer_skip.del_ import DelProposer
from vllm_plugins.proposers.layer_skip.skip_search import SkipSetSearch, mask_to_skips
from vllm_plugins.registry import translate
from vllm_plugins.self_draft import LayerPlan


# ------------------------------------------------------------------ plans
def test_layer_plans_and_their_cost():
    assert LayerPlan.full(4).cost() == 1.0
    assert LayerPlan.early_exit(4, 1).cost() == 0.25
    plan = LayerPlan.skipping(4, skip_attn=(1,), skip_mlp=(1, 2))
    assert plan.attn == (True, False, True, True)
    assert plan.mlp == (True, False, False, True)
    assert plan.cost() == 5 / 8 and plan.depth == 4


# ----------------------------------------------------------------- search
def _objective(mask: np.ndarray, harmful: np.ndarray) -> float:
    """Agreement falls with every harmful sublayer skipped."""
    return 1.0 - 0.1 * float((mask & harmful).sum())


def test_search_keeps_the_skip_budget_and_protected_layers():
    search = SkipSetSearch(10, 0.3, seed=1, protect=(0, 9))
    for mask in search.propose(20):
        assert mask.sum() == 6
        assert not mask[[0, 1, 18, 19]].any()
    attn, mlp = mask_to_skips(np.array([1, 0, 0, 1, 0, 0], dtype=bool))
    assert attn == (0,) and mlp == (1,)


def test_search_rejects_a_budget_it_cannot_meet():
    with pytest.raises(ValueError, match="skip_ratio"):
        SkipSetSearch(3, 0.8, protect=(0, 2))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bayesian_rounds_beat_random_search(seed):
    """With the same number of evaluations, the GP-guided search ends at a
    better skip set than pure random sampling (which the first rounds are)."""
    rng = np.random.default_rng(100 + seed)
    harmful = np.zeros(60, dtype=bool)
    harmful[rng.choice(np.arange(2, 58), 30, replace=False)] = True
    guided = SkipSetSearch(30, 0.25, seed=seed, random_rounds=8, protect=(0, 29))
    pure = SkipSetSearch(30, 0.25, seed=seed, random_rounds=10**6, protect=(0, 29))
    for search in (guided, pure):
        for _ in range(20):
            for mask in search.propose(2):
                search.record(mask, _objective(mask, harmful))
    assert guided.best()[1] > pure.best()[1]
    assert guided.best()[1] >= 0.7  # 15 skips, at most 3 of them harmful


def test_repeated_scores_average():
    search = SkipSetSearch(4, 0.25, protect=())
    mask = search.random_mask()
    search.record(mask, 0.2)
    search.record(mask, 0.6)
    best, score = search.best()
    assert np.array_equal(best, mask) and score == pytest.approx(0.4)


# ---------------------------------------------------------------------- DEL
class _FakeLayer(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.self_attn = torch.nn.Linear(hidden, hidden, bias=False)
        self.mlp = torch.nn.Linear(hidden, hidden, bias=False)
        self.input_layernorm = self.post_attention_layernorm = torch.nn.Identity()


def llama_like_model(num_layers: int = 12, hidden: int = 8) -> SimpleNamespace:
    """The parts of a Llama-style vLLM model that ``load_model`` inspects."""
    inner = torch.nn.Module()
    inner.layers = torch.nn.ModuleList(_FakeLayer(hidden) for _ in range(num_layers))
    inner.start_layer, inner.end_layer = 0, num_layers
    inner.norm = SimpleNamespace(weight=torch.ones(hidden))
    inner.embed_input_ids = lambda ids: ids
    return SimpleNamespace(model=inner)


def test_self_drafting_needs_a_llama_style_model():
    target = llama_like_model()
    del target.model.layers[0].mlp
    with pytest.raises(ValueError, match="Llama-style"):
        DelProposer(options={"draft_vocab": 0}, vocab_size=32).load_model(target)


def _del(**options):
    opts = {"draft_vocab": 0, **options}
    proposer = DelProposer(options=opts, vocab_size=32)
    proposer.load_model(llama_like_model())
    return proposer


def test_del_candidates_and_costs_follow_the_layers():
    p = _del()
    assert p.aux_layers == tuple(p.exits.tolist()) == (4, 6, 8, 10)
    assert np.all(np.diff(p.cost) > 0)  # deeper exits cost more


def test_del_rejects_exit_layers_beyond_the_model():
    with pytest.raises(ValueError, match="exit_layers"):
        _del(exit_layers=[4, 12])


def test_del_drafts_nothing_when_no_exit_agrees():
    p = _del()
    j, k, _ = p.choose(np.full(len(p.exits), 0.02), max_k=5)
    assert k == 0
    always = _del(min_value=0.0)  # the knob that makes it draft regardless
    assert always.choose(np.full(len(p.exits), 0.02), max_k=5)[1] >= 1


def test_del_costs_follow_the_measured_draft_and_step_times():
    from vllm_plugins.self_draft import LayerPlan

    p = _del()
    assert np.allclose(p.step_costs(), p.cost)  # nothing timed yet: parameters
    p.step_seconds = 0.1
    p.forward_seconds[LayerPlan.early_exit(12, 8)] = 0.16  # slower than a step
    costs = p.step_costs()
    j = list(p.exits).index(8)
    assert costs[j] == pytest.approx(1.6)
    ratio = costs / (p.cost - p.options["draft_step_overhead"])
    assert np.allclose(ratio, ratio[0])  # other exits scaled alike
    # A draft forward dearer than a step never pays, however good the exit.
    assert p.choose(np.full(len(p.exits), 0.99), max_k=5)[1] == 0


def test_del_drafts_long_and_cheap_when_exits_agree():
    p = _del()
    j, k, _ = p.choose(np.full(len(p.exits), 0.98), max_k=5)
    assert k == 5 and p.exits[j] == p.exits.min()  # same agreement: cheapest exit
    # A deeper exit that agrees a little more does not pay for its layers.
    alpha = np.array([0.1, 0.2, 0.97, 0.99])
    j, k, _ = p.choose(alpha, max_k=5)
    assert p.exits[j] == 8 and k >= 1


def test_del_acceptance_is_per_request_shrunk_to_the_engine_rate():
    p = _del(prior_strength=4.0)
    p.hits[:] = 50.0
    p.trials[:] = 100.0
    counts = p._counts("r1")
    counts[0, -1], counts[1, -1] = 40.0, 40.0  # this request: always accepted
    glob = p.acceptance()
    mine = p.acceptance("r1")
    assert mine[-1] > 0.9 and mine[0] == pytest.approx(glob[0])
    p.free("r1")
    assert np.allclose(p.acceptance("r1"), glob)


# -------------------------------------------------------------------- vocab
def test_draft_vocab_shortlist_matches_full_head_inside_it():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    target = SimpleNamespace(
        model=SimpleNamespace(logits_processor=SimpleNamespace(scale=1.0, soft_cap=None),
                              lm_head=head),
        vocab_size=32, logits=lambda h: h @ head.weight.T)
    vocab = DraftVocab(32, 5)
    vocab.observe(np.array([3, 3, 3, 7, 7, 9, 11, 30, 30, 30, 30]))
    hidden = torch.randn(2, 8)
    with torch.no_grad():
        small, ids = vocab.logits(target, hidden)
        full = target.logits(hidden)
    assert ids.tolist() == [3, 7, 9, 11, 30]
    assert torch.allclose(small, full[:, ids], atol=1e-6)
    # with no plain head matrix, the full head is used
    target.model.logits_processor.soft_cap = 30.0
    out, none = vocab.logits(target, hidden)
    assert none is None and out.shape == (2, 32)


# ------------------------------------------------------------------ options
@pytest.mark.parametrize("user, name", [
    ({"method": "swift", "skip_ratio": 0.95}, "skip_ratio"),
    ({"method": "swift", "skip_layers": {"attn": [1, -2]}}, "skip_layers"),
    ({"method": "swift", "stop_below": 2}, "stop_below"),
    ({"method": "del", "exit_layers": []}, "exit_layers"),
    ({"method": "del", "shadow_rows": 0}, "shadow_rows"),
    ({"method": "del", "draft_vocab": -1}, "draft_vocab"),
])
def test_bad_options_name_themselves(user, name):
    with pytest.raises(ValueError, match=name):
        translate(user)


def test_self_drafting_methods_translate_to_custom_class():
    spec, opts = translate({"method": "swift", "skip_ratio": 0.3})
    assert spec["method"] == "custom_class" and spec["model"].endswith("SwiftProposer")
    assert spec["num_speculative_tokens"] == 5 and opts["skip_ratio"] == 0.3
    spec, opts = translate({"method": "del", "exit_layers": [10, 20]})
    assert spec["model"].endswith("DelProposer") and opts["exit_layers"] == [10, 20]


def test_grammar_around_a_self_drafting_method_exposes_it_to_the_bridge():
    from vllm_plugins.proposers.grammar import GrammarProposer

    outer = GrammarProposer(options={"inner": {"method": "del", "draft_vocab": 0}},
                            vocab_size=32)
    assert outer.SELF_DRAFT
    outer.load_model(llama_like_model())
    assert outer.aux_layers == (4, 6, 8, 10)
    assert not GrammarProposer(options={"inner": "token_recycling"},
                               vocab_size=32).SELF_DRAFT
