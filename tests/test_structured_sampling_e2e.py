"""STAND's sampled drafts on structured-output requests keep the target's
distribution (proposers/stand.py, rule 3).

vLLM's scheduler cuts such a draft at the first token the request's grammar
rejects, so STAND hands those drafts over without probability rows. The
reference is plain decoding with the same structured output (the session's
engine without speculation); a request marked to get dishonest rows anyway is
the control the same test must catch.
"""

import pytest

from tests.test_stand_e2e import RGB, homogeneity_pvalue, stand_engine

pytestmark = pytest.mark.slow

# Drafts the mode, hands rows as if drawn: output leans to the mode.
DISHONEST = {"stand_debug_probs": "argmax"}
# The prompt's words, and one it never shows: every position is constrained,
# and STAND's stored distributions (the prompt's n-grams and the target's
# top-k) hold tokens the grammar rejects, so drafts are cut by the grammar.
REGEX = r"( red| blue| green| yellow){4}"
SAMPLES = 384
TOKENS = 4


def structured_samples(llm, prompt, seed0, extra_args=None, batch=64):
    """First three tokens of SAMPLES seeded temperature-1 answers."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    eng = llm.llm_engine
    out = []
    for b0 in range(0, SAMPLES, batch):
        ids = [f"so{seed0}-{i}" for i in range(b0, min(SAMPLES, b0 + batch))]
        toks = {r: [] for r in ids}
        for k, r in enumerate(ids):
            sp = SamplingParams(temperature=1.0, max_tokens=TOKENS, seed=seed0 + b0 + k,
                                structured_outputs=StructuredOutputsParams(regex=REGEX),
                                extra_args=extra_args, output_kind=RequestOutputKind.DELTA)
            eng.add_request(r, {"prompt_token_ids": prompt}, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks[o.request_id].extend(o.outputs[0].token_ids)
        out += [tuple(toks[r][:3]) for r in ids]
    return out


@pytest.fixture(scope="module")
def prompt(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)(RGB)["input_ids"]


@pytest.fixture(scope="module")
def reference(base, prompt):
    return structured_samples(base, prompt, seed0=0)


@pytest.fixture(scope="module")
def stand(model_path, reference, shared_engines):
    """tests/test_stand_e2e.py's engine (same group: the same worker)."""
    return shared_engines.get(stand_engine, model_path)


def _run(llm, prompt, seed0, extra_args=None):
    from vllm_plugins.bench.engines import engine_stats

    before = engine_stats(llm)
    samples = structured_samples(llm, prompt, seed0, extra_args)
    after = engine_stats(llm)

    def delta(get):
        return get(after) - get(before)
    return samples, {
        "drafted": delta(lambda s: s.get("drafted", 0)),
        "accepted": delta(lambda s: s.get("accepted", 0)),
        "one_hot": delta(lambda s: s["proposer"]["stand"]["drafted"]["sampled_one_hot"]),
        "sampled": delta(lambda s: s["proposer"]["stand"]["drafted"]["sampled"]),
        "errors": after["proposer"]["num_errors"],
    }


def test_structured_sampled_drafts_keep_the_target_distribution(reference, stand, prompt):
    samples, counts = _run(stand, prompt, seed0=0)
    p = homogeneity_pvalue(reference, samples)
    print(f"one-hot: {counts}, p = {p:.3g}")
    # Drafts went out without rows and were verified: the test has teeth.
    assert counts["one_hot"] == counts["sampled"] > SAMPLES, counts
    assert counts["drafted"] > SAMPLES and counts["accepted"] > SAMPLES // 4, counts
    assert counts["errors"] == 0
    assert p > 0.01, (p, counts)


def test_the_same_check_catches_dishonest_rows_on_structured_requests(
        reference, stand, prompt):
    samples, counts = _run(stand, prompt, seed0=100_000, extra_args=DISHONEST)
    p = homogeneity_pvalue(reference, samples)
    print(f"dishonest: {counts}, p = {p:.3g}")
    assert counts["one_hot"] == 0 and counts["drafted"] > SAMPLES, counts
    assert p < 1e-4, (p, counts)
