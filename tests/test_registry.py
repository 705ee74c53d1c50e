import pytest

from vllm_plugins.registry import translate


def test_our_method_becomes_custom_class_with_options():
    spec, opts = translate({"method": "token_recycling", "num_speculative_tokens": 4,
                            "topk": 4, "draft_length": "acceptance"})
    assert spec["method"] == "custom_class"
    assert spec["model"].endswith("TokenRecyclingProposer")
    assert spec["num_speculative_tokens"] == 4
    assert "topk" not in spec and opts["topk"] == 4
    assert opts["draft_length"] == "acceptance" and opts["method"] == "token_recycling"


def test_defaults_fill_in():
    spec, opts = translate({"method": "token_recycling"})
    assert spec["num_speculative_tokens"] == 6
    # goodput where it was measured to beat fixed drafts (docs/benchmarks.md)
    assert opts["draft_length"] == "goodput"
    assert translate({"method": "ngram_adaptive"})[1]["draft_length"] == "goodput"
    assert translate({"method": "stand"})[1]["draft_length"] == "goodput"
    assert translate({"method": "swift"})[1]["draft_length"] == "fixed"
    assert translate({"method": "token_recycling", "draft_length": "fixed"}
                     )[1]["draft_length"] == "fixed"


def test_vllm_methods_pass_through_untouched():
    user = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    spec, opts = translate(user)
    assert opts is None and spec == user


def test_dotted_path_route_uses_defaults():
    path = "vllm_plugins.proposers.token_recycling.TokenRecyclingProposer"
    spec, opts = translate({"method": "custom_class", "model": path,
                            "num_speculative_tokens": 3})
    assert spec["model"] == path and opts["method"] == "token_recycling"


def test_each_method_lives_in_a_module_and_class_of_its_name():
    """``del`` is a Python keyword: its module is ``del_`` (PEP 8)."""
    from vllm_plugins.registry import METHODS

    for name, method in METHODS.items():
        module, cls = method.class_path.rsplit(".", 1)
        stem = name.removesuffix("_forced")  # grammar_forced: proposers/grammar.py
        assert module.rsplit(".", 1)[1].rstrip("_") == stem, method
        assert cls.lower() == stem.replace("_", "") + "proposer", method
        assert method.proposer_class().__name__ == cls


@pytest.mark.parametrize("old,method", [
    ("vllm_plugins.proposers.vllm_ngram.AdaptiveNgramProposer", "ngram_adaptive"),
    ("vllm_plugins.proposers.layer_skip.dynamic_exit.DynamicExitProposer", "del"),
])
def test_former_class_paths_still_reach_their_method(old, method):
    from vllm_plugins.registry import METHODS

    spec, opts = translate({"method": "custom_class", "model": old})
    assert opts["method"] == method and spec["model"] == METHODS[method].class_path


def test_declared_option_wins_over_vllm_field_of_same_name():
    spec, opts = translate({"method": "ngram_adaptive", "prompt_lookup_min": 3})
    assert opts["prompt_lookup_min"] == 3 and "prompt_lookup_min" not in spec


@pytest.mark.parametrize("bad, name", [
    ({"topk": 0}, "topk"),
    ({"topk": "8"}, "topk"),
    ({"min_confidence": 2.0}, "min_confidence"),
    ({"draft_length": "sometimes"}, "draft_length"),
    ({"no_such_option": 1}, "no_such_option"),
    ({"draft_length": "goodput", "draft_length_options": {"bogus": 1}}, "bogus"),
])
def test_bad_option_names_itself(bad, name):
    with pytest.raises(ValueError, match=name):
        translate({"method": "token_recycling", **bad})


@pytest.mark.parametrize("version", ["0.32.0+cpu", "0.32.1", "0.33.0",
                                     "0.33.2.dev7+g1234abc"])
def test_version_gate_admits_checked_minors(version):
    from vllm_plugins import check_vllm_version

    check_vllm_version(version)


@pytest.mark.parametrize("version", ["0.31.2", "0.34.0", "0.34.0rc1", "1.0.0",
                                     "not-a-version"])
def test_version_gate_names_both_versions(version):
    from vllm_plugins import check_vllm_version

    with pytest.raises(RuntimeError, match=r">=0\.32,<0\.34") as err:
        check_vllm_version(version)
    assert version in str(err.value)


@pytest.mark.parametrize("spec", [
    {"method": "ngram_adaptive", "prompt_lookup_min": 6, "prompt_lookup_max": 3},
    {"method": "grammar_forced",
     "inner": {"method": "ngram_adaptive", "prompt_lookup_min": 6,
               "prompt_lookup_max": 3}},
])
def test_rules_between_options_are_checked_before_a_model_loads(spec):
    with pytest.raises(ValueError, match="'prompt_lookup_min' of method '.*ngram_adaptive"):
        translate(spec)


SCHEDULE = [[1, 1, 2], [2, 64, 1]]


def test_the_batch_size_schedule_is_vllms_and_passes_through():
    from vllm_plugins.registry import VLLM_FIELDS_BY_RELEASE, vllm_speculative_fields

    # Every vLLM the bridge is checked against has it (0.32 and 0.33).
    assert set(VLLM_FIELDS_BY_RELEASE) <= vllm_speculative_fields()
    spec, opts = translate({"method": "token_recycling", "num_speculative_tokens": 2,
                            "num_speculative_tokens_per_batch_size": SCHEDULE})
    assert spec["num_speculative_tokens_per_batch_size"] == SCHEDULE
    assert "num_speculative_tokens_per_batch_size" not in opts
    spec, _ = translate({"method": "stand",
                         "num-speculative-tokens-per-batch-size": SCHEDULE})
    assert spec["num_speculative_tokens_per_batch_size"] == SCHEDULE


def test_a_vllm_without_the_schedule_refuses_it_by_name(monkeypatch):
    import vllm

    from vllm_plugins import registry

    fields = registry.vllm_speculative_fields() - {"num_speculative_tokens_per_batch_size"}
    monkeypatch.setattr(registry, "vllm_speculative_fields", lambda: fields)
    with pytest.raises(ValueError, match="'num_speculative_tokens_per_batch_size'") as err:
        translate({"method": "token_recycling",
                   "num_speculative_tokens_per_batch_size": SCHEDULE})
    assert f"vLLM {vllm.__version__}" in str(err.value)
    assert "unknown" not in str(err.value)
