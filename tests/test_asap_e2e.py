"""ASAp through a vLLM engine: ``{"grammar": {..., "aligned": true}}`` in the engine path.

Slow: ``pytest -m slow``. With a tiny random Llama (one engine start), the
processor from the package's entry point only, as in a server: plain
requests are drawn in one batch; aligned ones in rounds, so that later rounds
see the bounds learnt from earlier ones. The target (the model's distribution
conditioned on the grammar) is enumerated with the same weights in
transformers, as in tests/test_asap.py.

Under speculation (SmolLM2, the shared plain engine and one drafting with
token_recycling): aligned requests are drafted and sample as without
speculation (chi-square), and the same test catches a biased control.
"""

from __future__ import annotations

import gc

import pytest
import torch

# One worker runs this module and tests/test_processors_speculation_e2e.py
# (tests/conftest.py, MODULE_GROUPS): they share its Token Recycling engine.
pytestmark = pytest.mark.slow

pytest.importorskip("vllm")

from tests.test_asap import (  # noqa: E402
    LARK,
    PROMPT_TEXT,
    by_text,
    enumerate_language,
    noise_bound,
    tv,
)

ROUNDS, PER_ROUND = 20, 10
N_PLAIN = 100
LATER = 100  # aligned samples of the last rounds, compared with the target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("asap_e2e") / "tiny", num_layers=2)


@pytest.fixture(scope="module")
def llm(tiny):
    with pytest.MonkeyPatch.context() as mp:
        # collective_rpc with a Python callable (to look inside the worker)
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        engine = LLM(model=tiny, enforce_eager=True, dtype="float32", max_model_len=256,
                     max_num_seqs=PER_ROUND, kv_cache_memory_bytes=64 * 2**20, seed=0)
        yield engine
        try:
            engine.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
        del engine
        gc.collect()


def _params(aligned, temperature=1.0, seed=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, max_tokens=12, seed=seed,
                          extra_args={"grammar": {"lark": LARK, "aligned": aligned}})


def _target(tiny, prompt):
    """(target, plain-masking) distributions over texts, enumerated exactly."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    from vllm.engine.arg_utils import EngineArgs

    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    model = LlamaForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny)

    def lm(ids):
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, -1].float()

    config = EngineArgs(model=tiny, max_model_len=256, enforce_eager=True,
                        dtype="float32").create_engine_config()
    proc = GrammarLogitsProcessor(config, torch.device("cpu"), False)
    lang = enumerate_language(proc, lm, prompt, tok.eos_token_id, 1.0)
    z = sum(p for p, _ in lang.values())
    return (by_text(tok, {s: p / z for s, (p, _) in lang.items()}),
            by_text(tok, {s: q for s, (_, q) in lang.items()}))


def _texts(outs):
    from collections import Counter

    c = Counter(o.outputs[0].text for o in outs)
    n = sum(c.values())
    return {k: v / n for k, v in c.items()}


def test_aligned_requests_move_toward_the_grammar_conditioned_distribution(llm, tiny):
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    prompt = tuple(tok.encode(PROMPT_TEXT, add_special_tokens=False))
    target, plain_exact = _target(tiny, prompt)
    distortion = tv(plain_exact, target)
    p = TokensPrompt(prompt_token_ids=list(prompt))

    plain_outs = llm.generate([p] * N_PLAIN, _params(False), use_tqdm=False)
    aligned_outs = []
    for r in range(ROUNDS):
        aligned_outs += llm.generate([p] * PER_ROUND, _params(True), use_tqdm=False)
    for o in plain_outs + aligned_outs:
        assert o.outputs[0].text in target, o.outputs[0].text  # grammatical
        assert o.outputs[0].finish_reason == "stop"
    plain, later = _texts(plain_outs), _texts(aligned_outs[-LATER:])
    print(f"\nTV to target: plain {tv(plain, target):.3f} (exact {distortion:.3f}), "
          f"aligned last {LATER} {tv(later, target):.3f}")
    assert tv(plain, target) > distortion - noise_bound(plain_exact, N_PLAIN)
    assert tv(later, target) < noise_bound(target, LATER)
    assert noise_bound(target, LATER) < distortion - noise_bound(plain_exact, N_PLAIN)

    # One trie in the worker, shared by all aligned requests of this prompt.
    (sizes,) = llm.collective_rpc(
        lambda w: [len(lp._asap) if lp._asap is not None else 0
                   for lp in w.model_runner.input_batch.logitsprocs.all
                   if type(lp).__name__ == "GrammarLogitsProcessor" and not lp._idle]
    )
    assert sizes == [1]


@pytest.mark.parametrize("params, needle", [
    ({"aligned": "yes"}, r'\["aligned"\] must be true or false'),
    ({"aligned": True, "temperature": 0.0}, r'\["aligned"\] needs random sampling'),
])
def test_bad_aligned_requests_fail_alone(llm, params, needle):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    params = dict(params)
    temperature = params.pop("temperature", 1.0)
    bad = SamplingParams(temperature=temperature, max_tokens=4,
                         extra_args={"grammar": {"lark": LARK, **params}})
    with pytest.raises(VLLMValidationError, match=needle):
        llm.generate(["x"], bad, use_tqdm=False)
    (ok,) = llm.generate(["x"], _params(True), use_tqdm=False)
    assert ok.outputs[0].text in ("true", "false", "unknown")


# ------------------------------------------------------- under speculation
# After the prompt SmolLM2 prefers " green" (p 0.31) to " red" (0.035), but
# finishes " green fish." far less often than " red blue green.": plain
# masking answers green about 9 times in 10, the grammar-conditioned
# distribution red about 9 times in 10. ASAp gets there by learning: its
# first sample of a prompt is plain masking, the second avoids what the
# first found to be a dead end. After " red" token_recycling drafts the
# prompt's pattern, which the grammar takes: drafts are accepted.
RGB = "red blue green red blue green red blue green red blue green red blue"
FISH = r"( green fish| red blue green)\."
REPLICAS = 96  # independent runs of ASAp's learning, two samples each
#: A zero logit bias on a token of its own gives each replica its own trie
#: (the bias is part of what keys a trie) and changes no distribution.
FIRST_BIAS_TOKEN = 1000


@pytest.fixture(scope="module")
def recycling(model_path, shared_engines):
    from tests.test_processors_speculation_e2e import RECYCLING, engine

    return shared_engines.get(engine, model_path, RECYCLING)


def two_samples(llm, seed0, aligned=True, counts=None):
    """Per replica, its first and second sample of FISH (token ids): the
    first from a fresh trie, the second with what the first taught it.
    ``counts``: a list that gets each round's (drafted, accepted)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tests.test_processors_speculation_e2e import stats

    prompt = TokensPrompt(prompt_token_ids=llm.get_tokenizer()(RGB)["input_ids"])
    rounds = []
    for r in range(2):
        before = stats(llm) if counts is not None else None
        params = [SamplingParams(temperature=1.0, max_tokens=8, seed=seed0 + r * REPLICAS + k,
                                 logit_bias={FIRST_BIAS_TOKEN + k: 0.0},
                                 extra_args={"grammar": {"regex": FISH, "aligned": aligned}})
                  for k in range(REPLICAS)]
        outs = llm.generate([prompt] * REPLICAS, params, use_tqdm=False)
        rounds.append([tuple(o.outputs[0].token_ids) for o in outs])
        if counts is not None:
            after = stats(llm)
            counts.append(tuple(after.get(k, 0) - before.get(k, 0)
                                for k in ("drafted", "accepted")))
    return list(zip(*rounds))


def test_aligned_requests_drafted_sample_as_without_speculation(base, recycling):
    from tests.test_stand_e2e import homogeneity_pvalue

    ref = two_samples(base, 0)
    counts: list[tuple[int, int]] = []
    got = two_samples(recycling, 10_000, counts=counts)
    p = homogeneity_pvalue(ref, got)
    tok = base.get_tokenizer()
    print(f"\n(drafted, accepted) by round {counts}, p = {p:.3g}; reference "
          f"{pair_counts(tok, ref)}; speculating {pair_counts(tok, got)}")
    # Aligned requests were drafted in both rounds (the second one's rows
    # carry the bounds the first taught), and drafts were accepted.
    assert all(d > REPLICAS for d, _ in counts), counts
    assert sum(a for _, a in counts) > REPLICAS // 2, counts
    assert p > 0.01, p
    # The control: the rows without ASAp's weights (plain masking, what the
    # drafted rows got before the processor reweighted them) are told apart.
    control = two_samples(recycling, 20_000, aligned=False)
    pc = homogeneity_pvalue(ref, control)
    print(f"control p = {pc:.3g}: {pair_counts(tok, control)}")
    assert pc < 1e-4, pc


def pair_counts(tok, pairs):
    from collections import Counter

    return dict(Counter(tuple(tok.decode(list(s)) for s in pair) for pair in pairs)
                .most_common(6))


def test_smc_over_awrs_weights_follows_the_grammar_conditioned_distribution(llm, tiny):
    """The SMC loop of docs/grammar.md (tests/smc_example.py) on a model
    whose weights vary wildly between paths (a random Llama). A run's
    particles times its evidence estimate are unbiased for the target at any
    number of particles, so independent runs pooled by evidence estimate the
    target that plain masking's samples miss. The estimate is heavy-tailed
    here (a few runs carry most of the evidence, their particles share
    ancestors), so no binomial bound describes it; the check is the claim
    itself: the pooled particles stand at most half as far from the target
    as plain masking's exact distribution does. Were the weights ignored,
    resampling and pooling would change nothing and the particles would be
    plain masking's samples."""
    import math
    from collections import Counter

    from tests.smc_example import smc

    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    target, plain_exact = _target(tiny, tuple(prompt))
    distortion = tv(plain_exact, target)
    assert distortion > 0.3  # the check can tell the two apart
    runs = [smc(llm, prompt, {"lark": LARK}, n_particles=32, chunk=1, max_tokens=12, seed=r)
            for r in range(80)]
    top = max(ev for _, ev in runs)
    ev = [math.exp(e - top) for _, e in runs]
    estimate: Counter = Counter()
    for (particles, _), e in zip(runs, ev):
        for tokens, w in particles:
            estimate[tok.decode(tokens, skip_special_tokens=True)] += e * w / sum(ev)
    print(f"\nSMC: TV to target {tv(estimate, target):.3f} (plain exact {distortion:.3f})")
    assert set(estimate) <= set(target)
    assert tv(estimate, target) < distortion / 2, (estimate, target)


def test_awrs_left_to_vllms_draw_samples_as_plain_masking(llm, tiny):
    """Unseeded AWRS rows are drawn by vLLM's sampler and checked after it
    (bridge/v1/grammar_awrs.py): the outputs follow plain masking's exact
    distribution, the grammar-conditioned target is far from it."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    tok = llm.get_tokenizer()
    prompt = tok.encode(PROMPT_TEXT, add_special_tokens=False)
    target, plain_exact = _target(tiny, tuple(prompt))
    n = 150
    params = SamplingParams(temperature=1.0, max_tokens=12,
                            extra_args={"grammar": {"lark": LARK, "sampling": "awrs"}})
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt)] * n, params, use_tqdm=False)
    got = _texts(outs)
    assert set(got) <= set(target)
    assert tv(got, plain_exact) < noise_bound(plain_exact, n)
    assert noise_bound(plain_exact, n) < tv(plain_exact, target) - noise_bound(target, n)
    (deferred,) = llm.collective_rpc(lambda w: [
        p.awrs_stats.rows for p in w.model_runner.input_batch.logitsprocs.all
        if type(p).__name__ == "GrammarLogitsProcessor" and not p._idle])
    assert deferred[0] >= n  # a check at each of their rows at least
