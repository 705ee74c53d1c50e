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
    assert translate({"method": "stand"})[1]["draft_length"] == "fixed"
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
