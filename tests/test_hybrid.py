"""The hybrid method's parts without an engine: the merge of the sources'
trees, the sources, a failing source, a source from an entry point, the
per-source calibration, options and per-request speculation."""

import sys
import textwrap
from types import SimpleNamespace

import numpy as np
import pytest

from vllm_plugins.proposers import sources
from vllm_plugins.proposers.hybrid import HybridProposer
from vllm_plugins.proposers.sources import DraftSource, SourceTree
from vllm_plugins.proposers.sources.calibrate import SourceCalibrator
from vllm_plugins.proposers.sources.lookup import LookupSource
from vllm_plugins.proposers.sources.merge import Merger
from vllm_plugins.proposers.sources.request import (admit, chosen_sources, parse_speculation,
                                                     worker_speculation)
from vllm_plugins.registry import translate, vllm_method_names
from vllm_plugins.step_context import RequestStep, StepContext

VOCAB = 1000


def tree(tokens, parents, conf):
    return SourceTree(np.array(tokens, np.int64), np.array(parents, np.int64),
                      np.array(conf, np.float64))


class Uncalibrated(SourceCalibrator):
    """A calibration that has seen nothing and trusts the raw estimates."""

    def __init__(self):
        super().__init__(4, 8)
        self.strength = 1e12


def merge(trees, budget):
    return Merger(4).merge(trees, Uncalibrated(), budget)


def request(context, accepted=(), req_id="a", prompt=None, params=None, max_draft=8):
    """One request's step as the bridge builds it (its ``speculation``
    parsed against an engine of ``max_draft`` drafts)."""
    context = np.asarray(context, np.int64)
    accepted = np.asarray(accepted if len(accepted) else context[-1:], np.int64)
    return RequestStep(req_id, accepted, context, prompt or len(context) - len(accepted),
                       0, context[-1:], None, None, 0.0, sampling_params=params,
                       speculation=worker_speculation(params, max_draft))


def hybrid(**options):
    p = HybridProposer(None, {"draft_length": "fixed", **options}, vocab_size=VOCAB)
    p.load_model(None)
    return p


# ------------------------------------------------------------------ merge
def test_identical_prefixes_merge_into_one_node_with_the_best_estimate():
    a = tree([5, 6, 7], [-1, 0, 1], [0.9, 0.5, 0.4])
    b = tree([5, 6, 8], [-1, 0, 1], [0.6, 0.8, 0.9])
    tok, par, cond, mask, depth, q, raw = merge([(0, a), (2, b)], 10)
    assert tok.tolist() == [5, 6, 8, 7]
    assert par.tolist() == [-1, 0, 1, 1]
    assert cond.tolist() == [0.9, 0.8, 0.9, 0.4]
    assert mask.tolist() == [0b101, 0b101, 0b100, 0b001]
    assert depth.tolist() == [1, 2, 3, 3]
    np.testing.assert_allclose(q, [0.9, 0.72, 0.648, 0.288])
    assert raw[1, 0] == 0.5 and raw[1, 2] == 0.8 and np.isnan(raw[2, 0])


def test_merged_nodes_are_best_first_topological_and_cut_to_the_budget():
    rng = np.random.default_rng(0)
    for _ in range(200):
        trees = []
        for s in range(3):
            n = int(rng.integers(0, 12))
            par = [int(rng.integers(-1, i)) for i in range(n)]
            trees.append((s, tree(rng.integers(0, 3, n), par, rng.uniform(0, 1, n))))
        budget = int(rng.integers(1, 20))
        tok, par, cond, mask, depth, q, _ = merge(trees, budget)
        full = merge(trees, 100)
        assert len(tok) == min(budget, len(full[0]))
        assert all(-1 <= p < i for i, p in enumerate(par.tolist()))
        assert np.all(np.diff(q) <= 0)
        # one node per (parent, token), and every source path is in the trie
        assert len({(p, t) for p, t in zip(par.tolist(), tok.tolist())}) == len(tok)
        paths = set()
        for i in range(len(full[0])):
            p, path = i, []
            while p >= 0:
                path.append(int(full[0][p]))
                p = int(full[1][p])
            paths.add(tuple(reversed(path)))
        for _, t in trees:
            for i in range(len(t)):
                p, path = i, []
                while p >= 0:
                    path.append(int(t.tokens[p]))
                    p = int(t.parents[p])
                assert tuple(reversed(path)) in paths
        # the cut keeps the budget's best nodes of the whole trie
        np.testing.assert_allclose(q, full[5][:len(q)])


def test_the_merge_calibrates_each_candidate_as_the_calibrator_does():
    rng = np.random.default_rng(1)
    cal = SourceCalibrator(3, 8)
    n = 400
    cal.learn(rng.integers(0, 3, n), rng.integers(1, 9, n), rng.uniform(0, 1, n),
              rng.integers(0, 2, n))
    t = tree([1, 2, 3, 4, 5], [-1, 0, 0, 2, -1], [0.95, 0.3, 0.55, 0.05, 0.7])
    tok, par, cond, mask, depth, q, raw = Merger(3).merge([(2, t)], cal, 10)
    want = cal.calibrate(2, np.array([1, 2, 2, 3, 1]), t.confidence)
    order = [tok.tolist().index(x) for x in (1, 2, 3, 4, 5)]
    np.testing.assert_allclose(cond[order], want)


def test_best_chain_takes_the_path_with_most_expected_accepted_tokens():
    # a greedy descent would take node 0 (q .6) and stop; 1 -> 2 -> 3 is worth more
    par = np.array([-1, -1, 1, 2])
    q = np.array([0.6, 0.5, 0.45, 0.4])
    assert Merger(1).chain(par, q).tolist() == [1, 2, 3]
    assert Merger(1).chain(np.array([-1, -1]), np.array([0.5, 0.5])).tolist() == [0]


# ---------------------------------------------------------------- sources
def test_lookup_branches_where_the_context_disagrees_with_itself():
    src = LookupSource({"prompt_lookup_min": 2, "prompt_lookup_max": 5, "max_matches": 4},
                       VOCAB, 8)
    # "1 2" (the longest repeated suffix) came three times, always followed
    # by 3, then by 7, 8 and 9: a chain that branches, latest first
    t = src.propose_context([1, 2, 3, 7, 1, 2, 3, 8, 1, 2, 3, 9, 1, 2], 6)
    assert t.tokens[t.parents == -1].tolist() == [3]
    assert t.confidence[0] == pytest.approx(2 / 3)
    assert t.tokens[t.parents == 0].tolist() == [9, 8]
    np.testing.assert_allclose(t.confidence[t.parents == 0], [1 / 3, 1 / 3])
    assert len(t) <= 6
    assert len(src.propose_context([1, 2, 3, 4], 6)) == 0


@pytest.mark.skipif(not sources.suffix_available(), reason="arctic-inference not installed")
def test_suffix_source_gives_conditional_estimates_and_catches_up_on_skipped_steps():
    src = sources.source_class("suffix")(
        {"max_tree_depth": 24, "max_cached_requests": 16, "max_spec_factor": 4.0,
         "min_token_prob": 0.0}, VOCAB, 8)
    prompt = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    t = src.propose(request(prompt, prompt[-1:], prompt=len(prompt)), 8)
    assert t.tokens[0] == 3 and t.confidence[0] == pytest.approx(1.0, abs=0.34)
    assert t.check(8) is not None
    kids = t.confidence[t.parents == 0]
    assert kids.sum() == pytest.approx(1.0)       # 4 and 5 after "1 2 3": conditional
    # two steps' tokens at once: the cache holds the whole context
    ctx = prompt + [3, 6]
    src.propose(request(ctx, [3, 6], prompt=len(prompt)), 8)
    assert src._told["a"] == len(ctx)
    src.free("a")
    assert "a" not in src.cache.active_requests


@pytest.mark.skipif(not sources.suffix_available(), reason="arctic-inference not installed")
def test_suffix_source_drafts_what_the_library_drafts_fed_plainly():
    """Steps of one to several tokens, contexts shorter and longer than
    the tree depth: the source's trees are those of a cache told the whole
    prompt, then each step's new tokens, and matched against the context's
    last ``max_tree_depth`` tokens."""
    from arctic_inference.suffix_decoding import SuffixDecodingCache

    from vllm_plugins.proposers.sources.suffix import conditional

    rng = np.random.default_rng(3)
    opts = {"max_tree_depth": 5, "max_cached_requests": 16, "max_spec_factor": 4.0,
            "min_token_prob": 0.0}
    for trial in range(20):
        src = sources.source_class("suffix")(opts, VOCAB, 8)
        ref = SuffixDecodingCache(max_tree_depth=5, max_cached_requests=16)
        ctx = [int(t) for t in rng.integers(0, 6, int(rng.integers(2, 9)))]
        prompt = len(ctx)
        ref.start_request("a", np.array(ctx, np.int32))
        told = prompt
        for _ in range(12):
            t = src.propose(request(ctx, ctx[-1:], prompt=prompt), 8)
            if len(ctx) > told:
                ref.add_active_response("a", np.array(ctx[told:], np.int32))
                told = len(ctx)
            want = ref.speculate("a", np.array(ctx[-5:], np.int32), max_spec_tokens=8,
                                 max_spec_factor=4.0, min_token_prob=0.0, use_tree_spec=True)
            assert t.tokens.tolist() == want.token_ids, trial
            assert t.parents.tolist() == want.parents, trial
            assert t.confidence.tolist() == conditional(want.parents, want.probs), trial
            ctx += [int(x) for x in rng.integers(0, 6, int(rng.integers(1, 4)))]
        src.free("a")


# ------------------------------------------------------- failing sources
class BrokenSource(DraftSource):
    name = "broken"

    def propose(self, request, budget):
        raise RuntimeError("broken on purpose")


class TooManySource(DraftSource):
    name = "too_many"

    def propose(self, request, budget):
        return SourceTree.chain(np.arange(budget + 1), np.full(budget + 1, 0.5))


def test_a_failing_source_costs_only_its_own_candidates(monkeypatch, caplog):
    monkeypatch.setitem(sources.BUILTIN, "broken", f"{__name__}:BrokenSource")
    monkeypatch.setitem(sources.BUILTIN, "too_many", f"{__name__}:TooManySource")
    p = hybrid(sources=["broken", "ngram", "too_many"])
    context = [7, 8, 9, 7, 8, 9, 7, 8]
    for _ in range(3):
        d = p.step(StepContext([request(context)], max_draft=8))
    assert d.tokens[0][:2] == [9, 7]          # ngram's draft
    m = p.metrics()
    assert m["num_errors"] == 0
    assert m["sources"]["broken"]["errors"] == 3 and m["sources"]["too_many"]["errors"] == 3
    assert m["sources"]["ngram"]["errors"] == 0
    assert sum("broken" in r.getMessage() for r in caplog.records) == 1   # logged once


class KeepingSource(DraftSource):
    """A source with state: it learns each step and hears what was sent."""
    name = "keeping"
    heard: list = []

    def learn(self, ctx):
        self.heard.append("learn")

    def propose(self, request, budget):
        return SourceTree.chain([1], [0.5])

    def sent(self, ctx, drafts):
        self.heard.append("sent")


def test_only_sources_that_keep_state_learn_and_hear_what_was_sent(monkeypatch):
    """A source that inherits ``DraftSource``'s empty ``learn`` and ``sent``
    (prompt lookup) is neither called nor timed for them; one that keeps
    state is, every step."""
    monkeypatch.setitem(sources.BUILTIN, "keeping", f"{__name__}:KeepingSource")
    monkeypatch.setattr(KeepingSource, "heard", [])
    p = hybrid(sources=["keeping", "ngram"])
    timed = []
    monkeypatch.setattr(p.costs, "add", lambda k, seconds: timed.append(k))
    for _ in range(3):
        p.step(StepContext([request([7, 8, 9, 7, 8])], max_draft=8))   # learn, draft, sent
    assert KeepingSource.heard == ["learn", "sent"] * 3
    assert timed == [0, 0] * 3


def install_example_source(tmp_path, monkeypatch, name="bigram",
                           value="tests.hybrid_example_source:BigramSource"):
    """tests/hybrid_example_source.py's BigramSource installed as another
    package would install it: a distribution whose entry point in the
    ``vllm_plugins.draft_sources`` group names it ``bigram``."""
    dist = tmp_path / "example_source-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-source\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [vllm_plugins.draft_sources]
        {name} = {value}
        """))
    monkeypatch.syspath_prepend(str(tmp_path))


def test_what_a_source_cannot_start_with_is_refused_by_translate(tmp_path, monkeypatch):
    """Refused in the front end, before a model loads, naming the option:
    options that fit each bound but not each other, and a source from an
    entry point whose module does not import."""
    with pytest.raises(ValueError, match=r"'source_options' of method 'hybrid'.*"
                                         r"'prompt_lookup_min' of source 'ngram' must be <= "
                                         r"'prompt_lookup_max' \(5\), got 6"):
        translate({"method": "hybrid", "sources": ["ngram"],
                   "source_options": {"ngram": {"prompt_lookup_min": 6}}})
    with pytest.raises(ValueError, match=r"'source_options' of method 'hybrid' \(inner of"):
        translate({"method": "grammar_forced", "inner": {
            "method": "hybrid", "sources": ["ngram"],
            "source_options": {"ngram": {"prompt_lookup_min": 6}}}})
    install_example_source(tmp_path, monkeypatch, "missing",
                           "no_such_package_here.source:Missing")
    with pytest.raises(ValueError, match=r"option 'sources' of method 'hybrid': draft "
                                         r"source 'missing' \(entry point "
                                         r"no_such_package_here.source:Missing in group "
                                         r"vllm_plugins.draft_sources\) cannot be loaded: "
                                         r"ModuleNotFoundError"):
        translate({"method": "hybrid", "sources": ["missing", "ngram"]})


def test_a_source_from_an_entry_point_is_usable_by_name(tmp_path, monkeypatch):
    install_example_source(tmp_path, monkeypatch)
    assert "bigram" in sources.available()
    _, options = translate({"method": "hybrid", "sources": ["bigram", "ngram"],
                            "source_options": {"bigram": {"min_count": 1}}})
    assert options["sources"] == ["bigram", "ngram"]
    p = hybrid(sources=["bigram"], source_options={"bigram": {"min_count": 1}})
    d = p.step(StepContext([request([4, 5, 6, 4, 5])], max_draft=4))
    assert d.tokens[0] == [6, 4, 5, 6]
    with pytest.raises(ValueError, match="'min_count' of draft source 'bigram'"):
        translate({"method": "hybrid", "sources": ["bigram"],
                   "source_options": {"bigram": {"min_count": 0}}})
    assert "tests.hybrid_example_source" in sys.modules


# ------------------------------------------------------------ calibration
def test_calibration_learns_which_source_is_right():
    """Two sources disagree at the root with the same raw estimate; the
    target always takes source 'right's token. Soon the merged tree ranks
    it first, and the accepted tokens are counted to it."""

    class Fixed(DraftSource):
        def propose(self, request, budget):
            return SourceTree.chain([self.options["token"]], [0.5])

    p = hybrid(sources=["ngram"])
    p.sources = [Fixed({"token": 1}, VOCAB, 4), Fixed({"token": 2}, VOCAB, 4)]
    p.source_names = ("wrong", "right")
    p.merger, p.calibrator = Merger(2), type(p.calibrator)(2, 4)
    p.costs = type(p.costs)(2)
    for name in ("source_errors", "source_nodes", "source_accepted", "source_alone"):
        setattr(p, name, np.zeros(2, int))
    context, emitted = [9, 9], [9]
    for _ in range(20):
        d = p.step(StepContext([request(context, emitted)], max_draft=4))
        emitted = [2, 2]          # the right draft accepted, and the target's next
        context = context + emitted
    assert d.tokens[0][0] == 2 and d.confidence[0][0] > 0.8
    assert d.confidence[0][1] < 0.2
    assert p.source_accepted.tolist() == [0, 19]


# ----------------------------------------------------- options, requests
def test_hybrid_is_not_a_vllm_method_name_and_options_are_checked(monkeypatch):
    assert "hybrid" not in vllm_method_names()
    vllm, options = translate({"method": "hybrid", "sources": ["ngram", "token_recycling"],
                               "num_speculative_tokens": 8})
    assert vllm["method"] == "custom_class" and options["sources"] == ["ngram",
                                                                      "token_recycling"]
    for bad, needle in ((["nope"], "unknown draft source 'nope'"),
                        (["ngram", "ngram"], "names a source twice"),
                        ([], "non-empty list")):
        with pytest.raises(ValueError, match=needle):
            translate({"method": "hybrid", "sources": bad})
    with pytest.raises(ValueError, match="not among the sources"):
        translate({"method": "hybrid", "sources": ["ngram"],
                   "source_options": {"suffix": {}}})
    with pytest.raises(ValueError, match="'prompt_lookup_max' of draft source 'ngram'"):
        translate({"method": "hybrid", "sources": ["ngram"],
                   "source_options": {"ngram": {"prompt_lookup_max": 0}}})
    monkeypatch.setattr(sources, "suffix_available", lambda: False)
    with pytest.raises(ValueError, match="'suffix' needs arctic-inference"):
        translate({"method": "hybrid", "sources": ["suffix"]})
    assert "suffix" not in sources.default_sources()


def speculation(spec):
    return SimpleNamespace(extra_args={"speculation": spec})


def narrowed(spec, max_draft, engine):
    """(cap, sources) of a request against an engine's draft length and sources."""
    parsed = parse_speculation(speculation(spec), max_draft)
    return parsed.max_draft, chosen_sources(parsed, engine)


def test_per_request_speculation_narrows_and_names_what_is_wrong():
    engine = ("suffix", "token_recycling", "ngram")
    assert parse_speculation(SimpleNamespace(extra_args=None), 8) is None
    assert narrowed({"max_draft": 0}, 8, engine) == (0, None)
    assert narrowed({"sources": ["ngram", "suffix"]}, 8, engine) == (None, ("suffix", "ngram"))
    for spec, needle in (({"max_drafts": 1}, r"unknown key\(s\) \['max_drafts'\]"),
                         ({"max_draft": 9}, r'\["max_draft"\] must be an integer in \[0, 8\]'),
                         ({"max_draft": -1}, r'\["max_draft"\]'),
                         ({"max_draft": True}, r'\["max_draft"\]'),
                         ({"sources": ["bigram"]}, r"names \['bigram'\]"),
                         ({"sources": []}, r'\["sources"\] must be a non-empty'),
                         ("fast", "not valid JSON text"),
                         (5, "must be an object"),
                         # keys of mixed types, through the Python API
                         ({1: 0, "a": 0}, r"unknown key\(s\) \[1, 'a'\]"),
                         # JSON text nested past the parser's recursion limit
                         ("[" * 5000 + "]" * 5000, "nested too deeply")):
        with pytest.raises(ValueError, match=needle):
            narrowed(spec, 8, engine)
    with pytest.raises(ValueError, match="hybrid method only"):
        narrowed({"sources": ["ngram"]}, 8, None)
    # the OpenAI server's vllm_xargs carry it as JSON text
    assert narrowed('{"max_draft": 2}', 8, None) == (2, None)


def test_admission_checks_against_the_engine_that_serves_the_request():
    from vllm_plugins.bridge.config import speculation_engine
    from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

    def vllm_config(user):
        """A config as the engine-args patch leaves it: vLLM's fields and ours."""
        if user is None:
            return SimpleNamespace(speculative_config=None)
        fields, options = translate(user)
        spec = SimpleNamespace(**fields)
        if options is not None:
            setattr(spec, PLUGIN_OPTIONS_ATTR, options)
        return SimpleNamespace(speculative_config=spec)

    def admit_to(config, spec):
        admit(speculation(spec), *speculation_engine(config))

    hybrid4 = vllm_config({"method": "hybrid", "sources": ["ngram"],
                           "num_speculative_tokens": 4})
    composed = vllm_config({"method": "grammar_forced", "num_speculative_tokens": 5,
                            "inner": {"method": "hybrid",
                                      "sources": ["ngram", "token_recycling"]}})
    recycling = vllm_config({"method": "token_recycling", "num_speculative_tokens": 6})
    ngram = vllm_config({"method": "ngram", "num_speculative_tokens": 3,
                         "prompt_lookup_max": 3})
    plain = vllm_config(None)
    admit_to(hybrid4, {"max_draft": 4, "sources": ["ngram"]})
    with pytest.raises(ValueError, match=r'\["max_draft"\] must be an integer in \[0, 4\]'):
        admit_to(hybrid4, {"max_draft": 5})
    with pytest.raises(ValueError, match=r"names \['suffix'\]"):
        admit_to(hybrid4, {"sources": ["suffix"]})
    admit_to(composed, {"max_draft": 5, "sources": ["ngram"]})
    with pytest.raises(ValueError, match=r"names \['suffix'\]"):
        admit_to(composed, {"sources": ["suffix"]})
    admit_to(recycling, {"max_draft": 6})
    with pytest.raises(ValueError, match="hybrid method only"):
        admit_to(recycling, {"sources": ["ngram"]})
    # Engines configured earlier in the process change nothing: each engine
    # admits against its own config, and one that does not draft with our
    # methods refuses the key by name.
    with pytest.raises(ValueError, match=r"""extra_args\["speculation"\] needs an engine.*"""
                                         r"""vLLM's 'ngram'"""):
        admit_to(ngram, {"max_draft": 1})
    with pytest.raises(ValueError, match="does not speculate"):
        admit_to(plain, {"max_draft": 1})
    admit(SimpleNamespace(extra_args={"other": 1}), *speculation_engine(plain))
    admit_to(hybrid4, {"max_draft": 4})


def test_a_draft_cap_holds_for_every_method_and_trees_still_serve_the_request():
    from types import SimpleNamespace

    from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
    from vllm_plugins.tree.sampling import tree_allowed

    p = TokenRecyclingProposer(None, {"draft_length": "fixed", "draft_shape": "tree"},
                               vocab_size=VOCAB)
    context = [7, 8, 9, 7, 8, 9, 7, 8]
    params = SimpleNamespace(extra_args={"speculation": {"max_draft": 1}}, temperature=0.0)
    assert tree_allowed(params)
    assert not tree_allowed(SimpleNamespace(extra_args={"speculation": {}, "other": 1}))
    d = p.step(StepContext([request(context), request(context, req_id="b", params=params)],
                           max_draft=6))
    assert len(d.tokens[0]) > 1 and len(d.tokens[1]) == 1


def test_a_request_narrows_the_hybrid_to_its_sources_and_draft_cap():
    from types import SimpleNamespace

    p = hybrid(sources=["ngram", "token_recycling"])
    context = [7, 8, 9, 7, 8, 9, 7, 8]

    def drafts(extra):
        params = SimpleNamespace(extra_args=extra, temperature=0.0)
        return p.step(StepContext([request(context, params=params)], max_draft=8)).tokens[0]

    assert len(drafts(None)) > 2
    assert drafts({"speculation": {"max_draft": 0}}) == []
    assert len(drafts({"speculation": {"max_draft": 2}})) == 2
    before = p.source_nodes.copy()
    drafts({"speculation": {"sources": ["ngram"]}})
    assert p.source_nodes[1] == before[1] and p.source_nodes[0] > before[0]
    assert drafts({"speculation": {"max_draft": 99}}) == [] and p.request_errors == 1


def test_the_documented_example_source_is_the_tested_one():
    """docs/hybrid.md shows tests/hybrid_example_source.py whole: the code
    a reader copies is the code the e2e test proves lossless."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "hybrid.md").read_text()
    block = doc.split("(`tests/hybrid_example_source.py`):\n\n```python\n", 1)[1]
    block = block.split("```", 1)[0]
    assert block == (root / "tests" / "hybrid_example_source.py").read_text()


def test_stand_source_drafts_what_the_target_showed_for_a_prompt():
    """STAND's store learns the target's top-k at a verified row; the next
    request of the same prompt drafts it (the store is per prompt)."""
    src = sources.source_class("stand")(
        {"topk": 2, "max_order": 2, "min_path_prob": 0.05, "prompt_prob": 0.5,
         "history": 16, "max_entries": 1024, "max_stores": 4, "share": "prompt"}, VOCAB, 4)
    src.load()
    # after "11 12" the target put 40 first (0.9) and emitted it
    context = np.array([11, 12, 40], np.int64)
    r = RequestStep("a", np.array([40]), context, 2, 0, np.array([12]),
                    np.array([[40, 41]]), np.log(np.array([[0.9, 0.1]])), 0.0)
    src.learn(StepContext([r], max_draft=4))
    t = src.propose(request([11, 12], req_id="a"), 4)
    assert t.tokens[:1].tolist() == [40] and t.confidence[0] == pytest.approx(0.9, abs=0.01)
    src.free("a")
    p = hybrid(sources=["stand", "ngram"])
    d = p.step(StepContext([request([5, 6, 5, 6, 5])], max_draft=4))
    assert d.tokens[0][:1] == [6] and p.metrics()["sources"]["stand"]["errors"] == 0
