"""The hybrid method inside vLLM's engine: greedy output token for token
that of plain decoding, as trees under the goodput policy and as chains
(with STAND's store among the sources),
with per-request narrowing (``extra_args["speculation"]``), and with a
source added through the ``vllm_plugins.draft_sources`` entry-point group
(the example of docs/hybrid.md, ``tests/hybrid_example_source.py``).

Prompts: two that repeat themselves (where every source has something to
say) and Spec-Bench dev prompts of three categories, rendered with the
default model's chat template.
"""

import pytest

from tests.conftest import shutdown
from tests.test_hybrid import install_example_source

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
REPEATS = [
    "Monday: eggs. Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. "
    "Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. Tuesday:",
    "The cat sat on the mat. The dog sat on the rug. The cat sat on the mat. "
    "The dog sat on the rug. The cat sat on the mat. The dog sat on the",
]
CATEGORIES = ["summarization", "rag", "coding"]


def engine(model_path, spec):
    from vllm import LLM

    return LLM(model=model_path, dtype="float32", max_model_len=1024, max_num_seqs=4,
               enforce_eager=True, seed=0, speculative_config=spec,
               use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def prompts(model_path):
    from transformers import AutoTokenizer

    from vllm_plugins.bench.data import load_questions, render

    tok = AutoTokenizer.from_pretrained(model_path)
    ids = [tok(p)["input_ids"] for p in REPEATS]
    return ids + [render(tok, q) for q in load_questions(CATEGORIES, per_category=1)]


def run(llm, prompts, extra=None):
    from vllm import SamplingParams

    extra = extra or [None] * len(prompts)
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=e) for e in extra]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


SCHEMA = {"type": "object", "properties": {"day": {"type": "string", "maxLength": 12},
                                          "meal": {"type": "string", "maxLength": 12}},
          "required": ["day", "meal"], "additionalProperties": False}


def run_json(llm, prompts):
    """Greedy requests under vLLM's own structured outputs (a JSON schema)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain(base, prompts):
    """Plain decoding on the session's engine without speculation
    (tests/conftest.py): no engine start of its own."""
    return run(base, prompts)


@pytest.fixture(scope="module")
def plain_json(base, prompts):
    """The first prompts under the schema, without speculation."""
    return run_json(base, prompts[:2])


def summary(stats) -> str:
    """Tokens per engine step (the batch's) and the share of drafts accepted."""
    return (f"tokens/step {stats['tokens'] / max(stats['steps'], 1):.2f}, accepted "
            f"{stats['accepted']}/{stats['drafted']} drafts")


def test_hybrid_trees_and_narrowed_requests_are_plain_decoding(model_path, prompts, plain,
                                                               base):
    from vllm.exceptions import VLLMValidationError

    from vllm_plugins.bench.engines import engine_stats

    llm = engine(model_path, {"method": "hybrid", "num_speculative_tokens": 16})
    try:
        # The process's other engine does not speculate: it refuses the key by
        # name, though an engine of ours was configured since.
        with pytest.raises(VLLMValidationError, match=r'extra_args\["speculation"\] needs an '
                                             r".*does not speculate"):
            run(base, prompts[:1], [{"speculation": {"max_draft": 1}}])
        got = run(llm, prompts)
        stats = engine_stats(llm)
        narrowed = run(llm, prompts, [{"speculation": {"max_draft": 0}},
                                      {"speculation": {"sources": ["ngram"]}},
                                      {"speculation": {"max_draft": 3}},
                                      {"speculation": {"sources": ["suffix"],
                                                       "max_draft": 16}},
                                      None])
        after = engine_stats(llm)
    finally:
        shutdown(llm)
    proposer = stats["proposer"]
    assert proposer["num_errors"] == 0, proposer
    assert all(s["errors"] == 0 for s in proposer["sources"].values()), proposer
    assert sum(s["accepted"] for s in proposer["sources"].values()) > 0, proposer
    assert stats["tree_steps"] > 0, stats
    print("hybrid trees:", summary(stats), proposer["sources"])
    for i, (g, w) in enumerate(zip(got, plain)):
        assert g == w, i
    assert after["proposer"]["request_errors"] == 0, after["proposer"]
    for i, (g, w) in enumerate(zip(narrowed, plain)):
        assert g == w, ("narrowed", i)


def test_hybrid_chains_with_a_source_from_an_entry_point_are_plain_decoding(
        model_path, prompts, plain, tmp_path, monkeypatch):
    from vllm_plugins.bench.engines import engine_stats

    install_example_source(tmp_path, monkeypatch)
    llm = engine(model_path, {"method": "hybrid", "num_speculative_tokens": 8,
                              "draft_shape": "chain",
                              "sources": ["bigram", "ngram", "stand"]})
    try:
        got, stats = run(llm, prompts), engine_stats(llm)
    finally:
        shutdown(llm)
    proposer = stats["proposer"]
    assert proposer["num_errors"] == 0, proposer
    assert proposer["sources"]["bigram"]["errors"] == 0, proposer
    assert proposer["sources"]["stand"]["errors"] == 0, proposer
    assert proposer["sources"]["stand"]["accepted"] > 0, proposer
    assert proposer["sources"]["bigram"]["accepted"] > 0, proposer
    assert stats.get("tree_steps", 0) == 0, stats
    print("hybrid chains (bigram, ngram, stand):", summary(stats), proposer["sources"])
    for i, (g, w) in enumerate(zip(got, plain)):
        assert g == w, i


def test_grammar_forced_around_hybrid_is_structured_plain_decoding(model_path, prompts,
                                                                   plain_json):
    """``grammar_forced`` with ``"inner": "hybrid"``: the grammar's forced
    text, then the hybrid's drafts the grammar allows; output as vLLM's
    structured output without speculation."""
    from vllm_plugins.bench.engines import engine_stats

    llm = engine(model_path, {"method": "grammar_forced", "num_speculative_tokens": 8,
                              "inner": "hybrid"})
    try:
        got, stats = run_json(llm, prompts[:2]), engine_stats(llm)
    finally:
        shutdown(llm)
    assert stats["proposer"]["num_errors"] == 0, stats["proposer"]
    assert stats["accepted"] > 0, stats
    for i, (g, w) in enumerate(zip(got, plain_json)):
        assert g == w, i
