"""SWIFT and DEL inside vllm.LLM: lossless against vLLM's own greedy tokens.

The same checks as tests/test_e2e_speculative.py (12 Spec-Bench prompts at
batch 1; batch 8 with mixed lengths and an abort midway; a sampled run; a
grammar request decoded as without speculation), run on the two
self-drafting methods, whose drafts come from the target's own layers inside
vLLM's paged KV cache. The reference
engine is the session's (tests/conftest.py), shared with that module.
"""

import pytest

from tests.conftest import shutdown
from tests.test_e2e_speculative import (  # noqa: F401  (collected here too)
    N_PROMPTS, engine, prompts, test_batch1_greedy_identical,
    test_batch8_mixed_lengths_with_abort_identical,
    test_grammar_request_decodes_as_without_speculation,
    test_sampled_run_completes_with_seed)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=[
    # A short search so the chosen skip set drafts for most of the test.
    {"method": "swift", "num_speculative_tokens": 4, "skip_ratio": 0.2,
     "search_rounds": 8},
    # min_value 0: draft even where the measured costs say it does not pay
    # on this CPU, so every draft path is verified against vLLM.
    {"method": "del", "num_speculative_tokens": 4, "min_value": 0.0},
], ids=["swift", "del"])
def spec(request, model_path):
    llm = engine(model_path, request.param)
    llm.n_prompts = N_PROMPTS
    llm.max_tokens = 32  # drafting runs eagerly layer by layer: keep CI short
    yield llm
    shutdown(llm)


def test_self_draft_reports_its_choices(spec, prompts):
    """The engine-side metrics name what the method chose (skip set or exit
    layers), and the drafts were produced by the target's layers."""
    from vllm_plugins.bench.engines import engine_stats, run_batch

    run_batch(spec, prompts[:2], __import__("vllm").SamplingParams(
        temperature=0.0, max_tokens=48))
    proposer = engine_stats(spec)["proposer"]
    assert proposer["num_errors"] == 0
    assert proposer["drafted"] > 0
    if "skip_attn" in proposer:  # swift
        skipped = len(proposer["skip_attn"]) + len(proposer["skip_mlp"])
        assert skipped == round(0.2 * 60)
        assert proposer["candidates_scored"] >= 8
    else:  # del
        assert sum(proposer["shadow_trials"]) > 0
        assert proposer["chosen_exits"]
