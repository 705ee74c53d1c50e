"""STAND inside vllm.LLM: lossless greedy, exact sampling, shared stores.

The reference is the session's engine without speculation
(tests/conftest.py); everything it must produce is computed in one fixture.
"""

import os
from collections import Counter
from unittest import mock

import numpy as np
import pytest

# One worker runs this module and tests/test_structured_sampling_e2e.py
# (tests/conftest.py, MODULE_GROUPS), which drafts with the same stand_engine.
pytestmark = pytest.mark.slow

N_PROMPTS = 10
MAX_TOKENS = 32
# Exactness: many seeded samples of the first tokens after a prompt with an
# obvious pattern. All samples share one store (same prompt), so from the
# second batch on STAND drafts the tokens at positions 2.. from the target's
# own stored distributions and vLLM verifies them with our probability rows.
RGB = "red blue green red blue green red blue green red blue green red blue"
CHI_SAMPLES = 384
CHI_TOKENS = 4
# draft_length "fixed": what STAND drafts (its own calibrated path rule still
# shapes each draft) is verified whatever the host's step timings are; the
# default "goodput" trims by measured step cost, which would make these
# tests' power depend on the machine's load.
SPEC = {"method": "stand", "draft_length": "fixed"}
# The dishonest-rows control is a test hook (proposers/stand_debug.py), set
# while the engine builds its proposer: requests marked DISHONEST get it.
DEBUG_HOOK = {"VLLM_PLUGINS_STAND_DEBUG_PROBS": "per_request"}
DISHONEST = {"stand_debug_probs": "uniform"}


def engine(model_path, spec):
    from vllm_plugins.bench.engines import build_engine

    return build_engine(model_path, spec, max_num_seqs=64, max_model_len=1024)


def greedy(max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    from vllm_plugins.bench.data import load_questions, render

    qs = load_questions(per_category=1)[:N_PROMPTS]
    return [render(tokenizer, q) for q in qs]


BATCH8_LENGTHS = [16, 32, 24, 8, 32, 20, 32, 32]
BATCH8_SAMPLED = {6, 7}  # two sampled requests ride along; only greedy rows compared


def run_batch8(llm, prompts, tag):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    ids = [f"{tag}-{i}" for i in range(8)]
    toks = {r: [] for r in ids}
    for i, (r, p, n) in enumerate(zip(ids, prompts[:8], BATCH8_LENGTHS)):
        sp = SamplingParams(temperature=1.0 if i in BATCH8_SAMPLED else 0.0,
                            seed=i, max_tokens=n, output_kind=RequestOutputKind.DELTA)
        eng.add_request(r, {"prompt_token_ids": p}, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.request_id].extend(o.outputs[0].token_ids)
    return [toks[r] for r in ids]


def sample_first_tokens(llm, prompt, n, seed0, extra_args=None, batch=64):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    out = []
    for b0 in range(0, n, batch):
        ids = [f"chi{seed0}-{i}" for i in range(b0, min(n, b0 + batch))]
        toks = {r: [] for r in ids}
        for k, r in enumerate(ids):
            sp = SamplingParams(temperature=1.0, max_tokens=CHI_TOKENS, ignore_eos=True,
                                seed=seed0 + b0 + k, extra_args=extra_args,
                                output_kind=RequestOutputKind.DELTA)
            eng.add_request(r, {"prompt_token_ids": prompt}, sp)
        while eng.has_unfinished_requests():
            for o in eng.step():
                toks[o.request_id].extend(o.outputs[0].token_ids)
        out += [tuple(toks[r][:3]) for r in ids]
    return out


def homogeneity_pvalue(a, b, min_count=10) -> float:
    """Two-sample chi-square test of one categorical distribution; categories
    seen fewer than min_count times in both samples together are pooled."""
    import torch

    ca, cb = Counter(a), Counter(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    ra, rb, pa, pb = [], [], 0, 0
    for k in keys:
        if ca[k] + cb[k] >= min_count:
            ra.append(ca[k])
            rb.append(cb[k])
        else:
            pa += ca[k]
            pb += cb[k]
    if pa + pb:
        ra.append(pa)
        rb.append(pb)
    t = np.array([ra, rb], dtype=np.float64)
    exp = t.sum(0, keepdims=True) * t.sum(1, keepdims=True) / t.sum()
    stat = float(((t - exp) ** 2 / exp).sum())
    df = t.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def reference(base, prompts, tokenizer):
    """Everything the tests compare against, from vLLM without speculation.
    Neither seeded samples nor greedy tokens depend on the batch they ran
    in, so the batch-1 references run as one batch (several times faster
    than one by one)."""
    from vllm_plugins.bench.engines import run_batch

    return {
        "batch1": [r.token_ids for r in run_batch(base, prompts, greedy())[0]],
        "batch8": run_batch8(base, prompts, "stand-ref"),
        "samples": sample_first_tokens(base, tokenizer(RGB)["input_ids"],
                                       CHI_SAMPLES, seed0=0),
    }


def stand_engine(model_path):
    """STAND at a fixed draft length, with the dishonest-rows hook."""
    with mock.patch.dict(os.environ, DEBUG_HOOK):
        return engine(model_path, SPEC)


@pytest.fixture(scope="module")
def stand(model_path, reference, shared_engines):
    return shared_engines.get(stand_engine, model_path)


def test_greedy_batch1_identical(reference, stand, prompts):
    from vllm_plugins.bench.engines import engine_stats, run_batch

    for p, want in zip(prompts, reference["batch1"]):
        got, _ = run_batch(stand, [p], greedy())
        assert got[0].token_ids == want
    stats = engine_stats(stand)
    assert stats["drafted"] > 0 and stats["accepted"] > 0, stats
    assert stats["proposer"]["num_errors"] == 0
    assert stats["proposer"]["stand"]["drafted"]["greedy"] > 0


def test_greedy_batch8_identical_beside_sampled_requests(reference, stand, prompts):
    from vllm_plugins.bench.engines import engine_stats

    got = run_batch8(stand, prompts, "stand")
    for i in range(8):
        if i in BATCH8_SAMPLED:
            assert len(got[i]) <= BATCH8_LENGTHS[i]
            continue
        assert got[i] == reference["batch8"][i], i
        assert len(got[i]) <= BATCH8_LENGTHS[i]
    assert engine_stats(stand)["proposer"]["num_errors"] == 0


def _chi_run(stand, tokenizer, seed0, extra_args=None):
    from vllm_plugins.bench.engines import engine_stats

    before = engine_stats(stand)
    samples = sample_first_tokens(stand, tokenizer(RGB)["input_ids"], CHI_SAMPLES,
                                  seed0=seed0, extra_args=extra_args)
    after = engine_stats(stand)
    drafted = after.get("drafted", 0) - before.get("drafted", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    sampled = (after["proposer"]["stand"]["drafted"]["sampled"]
               - before["proposer"]["stand"]["drafted"]["sampled"])
    return samples, drafted, accepted, sampled


def test_sampled_first_tokens_keep_the_target_distribution(reference, stand, tokenizer):
    samples, drafted, accepted, sampled = _chi_run(stand, tokenizer, seed0=0)
    print(f"honest: drafted {drafted}, accepted {accepted}, "
          f"p = {homogeneity_pvalue(reference['samples'], samples):.3g}")
    # Drafts were verified at these positions: the test has teeth.
    assert sampled > CHI_SAMPLES and drafted > CHI_SAMPLES and accepted > CHI_SAMPLES // 4
    p = homogeneity_pvalue(reference["samples"], samples)
    assert p > 0.01, (p, drafted, accepted)


def test_the_same_check_catches_dishonest_draft_probs(reference, stand, tokenizer):
    samples, drafted, accepted, _ = _chi_run(stand, tokenizer, seed0=100_000,
                                             extra_args=DISHONEST)
    assert drafted > CHI_SAMPLES, (drafted, accepted)
    p = homogeneity_pvalue(reference["samples"], samples)
    print(f"dishonest: drafted {drafted}, accepted {accepted}, p = {p:.3g}")
    assert p < 1e-4, (p, drafted, accepted)


def _render_salted(tokenizer, q, salt):
    msgs = [{"role": "user", "content": q["turns"][0] + salt}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _run_sampled(llm, prompts, n, seed, tag):
    """All prompts at once (n samples each); engine-stat deltas and tokens."""
    from collections import defaultdict

    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_plugins.bench.engines import engine_stats

    eng = llm.llm_engine
    before = engine_stats(llm)
    tokens = defaultdict(int)
    for i, p in enumerate(prompts):
        sp = SamplingParams(n=n, temperature=0.6, max_tokens=96, seed=seed + 100 * i,
                            output_kind=RequestOutputKind.DELTA)
        eng.add_request(f"{tag}-{seed}-{i}", {"prompt_token_ids": p}, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            for c in o.outputs:
                tokens[(o.request_id, c.index)] += len(c.token_ids)
    after = engine_stats(llm)
    return {
        "drafted": after.get("drafted", 0) - before.get("drafted", 0),
        "accepted": after.get("accepted", 0) - before.get("accepted", 0),
        "tokens": sum(tokens.values()), "sequences": len(tokens),
        "stores": (after["proposer"]["stand"]["stores_created"]
                   - before["proposer"]["stand"]["stores_created"]),
    }


def test_samples_of_one_prompt_share_one_store(stand, tokenizer):
    """n=4 samples of a prompt (vLLM's parallel sampling) use one store."""
    from vllm_plugins.bench.data import load_questions

    qs = load_questions(["math_reasoning", "reasoning", "coding", "qa"], 1)
    out = _run_sampled(stand, [_render_salted(tokenizer, q, "\t") for q in qs], 4, 7, "n4")
    assert out["sequences"] == 16 and out["stores"] == 4, out
    assert out["accepted"] > 0


def test_shared_store_raises_acceptance(stand, tokenizer):
    """Four waves of samples of the same four questions (T=0.6, 4 at a time):
    identical prompts share a store and later samples draft from earlier
    ones' target distributions; with a new whitespace salt per wave every
    prompt starts from an empty store. Same batch size, same questions."""
    from vllm_plugins.bench.data import load_questions

    qs = load_questions(["math_reasoning", "reasoning", "coding", "qa"], 1)
    totals = {}
    for mode in ("distinct", "shared"):
        t = {"drafted": 0, "accepted": 0, "tokens": 0}
        for wave in range(4):
            salt = "\n" if mode == "shared" else " " * (wave + 1)
            out = _run_sampled(stand, [_render_salted(tokenizer, q, salt) for q in qs],
                               1, 1000 * wave, mode)
            for k in t:
                t[k] += out[k]
        totals[mode] = (t["accepted"] / max(t["drafted"], 1),
                        t["accepted"] / max(t["tokens"], 1))
    (rate_d, tok_d), (rate_s, tok_s) = totals["distinct"], totals["shared"]
    print(f"distinct prompts: accepted/drafted {rate_d:.3f}, accepted/token {tok_d:.3f}; "
          f"shared store: accepted/drafted {rate_s:.3f}, accepted/token {tok_s:.3f}")
    # With draft_length "fixed" a fuller store also makes STAND draft more
    # tokens, so accepted/drafted rises less than accepted drafts per
    # generated token, which is what the shared store buys (MAT - 1).
    assert tok_s > 1.15 * tok_d, totals
    assert rate_s > rate_d - 0.02, totals
