"""Logits processors under speculation, end to end (SmolLM2, three engines).

The reference is vLLM without speculation running the same processors (our
grammar processor given explicitly, vLLM's own min_p and logit_bias); the
speculating engines draft with token_recycling, and with grammar_forced
around it, which drafts the grammar's forced text for grammar requests and
token_recycling's tokens for the others. Greedy output must be identical per processor;
sampled, the first tokens' distribution must be the reference's (chi-square),
and the same test must catch a biased control (the processors left out).
"""

from __future__ import annotations

import pytest

from tests.conftest import shutdown

# One worker runs this module and tests/test_asap_e2e.py (tests/conftest.py,
# MODULE_GROUPS), which drafts with the same engine(model_path, RECYCLING).
pytestmark = pytest.mark.slow

FQCN = "vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor"
# Fixed draft length: the goodput controller's rests depend on step times,
# which other processes on the machine change; the checks count drafts.
SPEC = {"method": "grammar_forced", "num_speculative_tokens": 4,
        "inner": {"method": "token_recycling", "draft_length": "fixed"}}
# token_recycling alone: the processors' requests get its drafts.
RECYCLING = {"method": "token_recycling", "num_speculative_tokens": 4,
             "draft_length": "fixed"}
RGB = "red blue green red blue green red blue green red blue green red blue"
COUNT = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"
# Literal text between the free parts: the grammar forces it, and drafts it.
RECORD = r'\{"colour": "(red|blue|green)", "count": [0-9]{1,3}, "next": "[a-z ]{1,12}"\}'
GREEDY_TOKENS = 48
SAMPLES = 256
TOKENS = 3
COLOURS = r"( red| blue| green| yellow){4}"


def engine(model_path, spec):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    return LLM(model=model_path, dtype="float32", max_model_len=512, max_num_seqs=64,
               enforce_eager=True, seed=0, logits_processors=[FQCN],
               speculative_config=dict(spec) if spec else None,
               kv_cache_memory_bytes=256 * 2**20, disable_log_stats=False,
               use_tqdm_on_load=False)


@pytest.fixture(scope="module")
def plain(model_path):
    llm = engine(model_path, None)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def spec(model_path, plain):
    llm = engine(model_path, SPEC)
    yield llm
    shutdown(llm)


@pytest.fixture(scope="module")
def recycling(model_path, spec, shared_engines):
    return shared_engines.get(engine, model_path, RECYCLING)


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def greedy_cases(tok):
    """(name, prompt, SamplingParams kwargs) with temperature 0."""
    yellow = tok.encode(" yellow", add_special_tokens=False)[0]
    comma = tok.encode(",", add_special_tokens=False)[0]
    return [
        ("grammar", "Write one record as JSON:",
         {"extra_args": {"grammar": {"regex": RECORD}}}),
        ("grammar_rgb", RGB, {"extra_args": {"grammar": {"regex": COLOURS + "\\."}}}),
        ("logit_bias", RGB, {"logit_bias": {yellow: 9.0}}),
        ("logit_bias_count", COUNT, {"logit_bias": {comma: -4.0}}),
        ("min_p", COUNT, {"min_p": 0.3}),
        ("none", RGB, {}),
    ]


def generate(llm, cases, **common):
    from vllm import SamplingParams

    prompts = [p for _, p, _ in cases]
    params = [SamplingParams(**{**common, **kw}) for _, _, kw in cases]
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(prompts, params, use_tqdm=False)]


def stats(llm):
    from vllm_plugins.bench.engines import engine_stats

    return engine_stats(llm)


@pytest.mark.parametrize("method", ["grammar_forced", "token_recycling"])
def test_greedy_identical_per_processor(method, plain, request, tok):
    spec = request.getfixturevalue("spec" if method == "grammar_forced" else "recycling")
    cases = greedy_cases(tok)
    kw = dict(temperature=0.0, max_tokens=GREEDY_TOKENS)
    ref = generate(plain, cases, **kw)
    # Each processor changes plain decoding's output: the comparison has teeth.
    names = [n for n, _, _ in cases]
    bare = generate(plain, [(n, p, {}) for n, p, _ in cases], **kw)
    for name in ("grammar", "grammar_rgb", "logit_bias", "logit_bias_count"):
        i = names.index(name)
        assert ref[i] != bare[i], name
    accepted = {}
    got = []
    for case in cases:  # one at a time: the acceptance is the case's own
        before = stats(spec)
        got += generate(spec, [case], **kw)
        after = stats(spec)
        accepted[case[0]] = after.get("accepted", 0) - before.get("accepted", 0)
    for name, r, g in zip(names, ref, got):
        assert g == r, (name, tok.decode(r), tok.decode(g))
    print("accepted drafts per case:", accepted)
    assert accepted["grammar"] > 0 and accepted["logit_bias"] > 0, accepted
    assert sum(accepted.values()) > GREEDY_TOKENS, accepted
    p = stats(spec)["proposer"]
    assert p["num_errors"] == 0, p
    if method == "grammar_forced":
        assert p["forced_tokens"] > 0 and p["grammar_requests"] >= 2, p
        # The inner learned the processor's masked top-k (the bridge's handover).
        assert p["masked_topk_rows"] > 0, p


# A new user's first try of min_tokens: short answers, which the model ends
# sooner than min_tokens allows, with one fixed draft per step.
SHORT_ANSWERS = [
    "What is 2+2? Answer with a number only.", "Is the sky blue? Answer yes or no.",
    "What colour is grass? One word.", "Capital of France? One word.",
    "How many legs does a cat have? Number only.", "Say hi.",
    "What is the opposite of hot? One word.", "Name a fruit. One word.",
    "Is water wet? Yes or no.", "What is 10 minus 3? Number only.",
    "Spell the word cat.", "What animal says moo? One word.",
    "Reply with OK.", "What day comes after Monday? One word.",
    "Is fire cold? Answer yes or no.", "What is 5 times 5? Number only.",
    "Name a colour.", "What is the first letter of the alphabet?"]
ONE_DRAFT = {"method": "token_recycling", "num_speculative_tokens": 1,
             "draft_length": "fixed"}


def test_min_tokens_on_short_answers_greedy_identical(plain, model_path, tok):
    """min_tokens from 2 to 8 on each short answer: plain decoding stops at
    the first position min_tokens allows. Under speculation that position
    is often a bonus row after an accepted draft, which must count the draft
    as the target rows do."""
    from vllm import SamplingParams

    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                       add_generation_prompt=True) for q in SHORT_ANSWERS]
    cases = [(p, m) for p in prompts for m in range(2, 9)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, min_tokens=m) for _, m in cases]

    def run(llm):
        outs = llm.generate([p for p, _ in cases], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ref = run(plain)
    # The check has teeth: some answers end exactly where min_tokens lets them.
    eos = tok.eos_token_id
    assert sum(len(r) == m + 1 and r[-1] == eos for (_, m), r in zip(cases, ref)) >= 3
    llm = engine(model_path, ONE_DRAFT)
    try:
        # Twice: the second time token_recycling drafts from the tables
        # the first taught it, and more drafts are accepted.
        got = [run(llm), run(llm)]
        accepted = stats(llm).get("accepted", 0)
    finally:
        shutdown(llm)
    assert accepted > len(cases), accepted
    differ = [(k, SHORT_ANSWERS[prompts.index(p)], m, tok.decode(r), tok.decode(g))
              for k in range(2) for (p, m), r, g in zip(cases, ref, got[k]) if r != g]
    assert not differ, differ


def aligned_tries(llm):
    """Every ASAp trie of the engine's grammar processor, node by node."""
    from tests.test_asap import trie_state

    def read(worker):
        out = {}
        for lp in worker.model_runner.input_batch.logitsprocs.all:
            if type(lp).__name__ == "GrammarLogitsProcessor" and lp._asap is not None:
                out.update({k.hex(): trie_state(t) for k, t in lp._asap._tries.items()})
        return out

    (tries,) = llm.collective_rpc(read)
    return tries


def test_aligned_request_with_vllm_masks_learns_as_without_speculation(plain, spec, tok):
    """An aligned request whose grammar forces its text (so its tokens are
    the same under any sampling), with allowed_token_ids, a bad word and
    min_tokens: grammar_forced drafts the text, and the trie it leaves (each
    token's probability under the row the processor saw, the grammar's mass
    there) is the trie plain decoding leaves."""
    from vllm import SamplingParams

    digits = [tok.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    params = SamplingParams(
        temperature=1.0, max_tokens=12, min_tokens=3, bad_words=["7"],
        allowed_token_ids=digits + [tok.eos_token_id],
        extra_args={"grammar": {"regex": "1234568", "aligned": True}})
    flush = SamplingParams(temperature=0.0, max_tokens=1)
    got = {}
    for name, llm in (("plain", plain), ("spec", spec)):
        before = set(aligned_tries(llm))
        before_stats = stats(llm)
        (out,) = llm.generate(["Digits:"], params, use_tqdm=False)
        assert out.outputs[0].text == "1234568", out.outputs[0].text
        llm.generate(["x"], flush, use_tqdm=False)  # a step ends the sample in the trie
        accepted = stats(llm).get("accepted", 0) - before_stats.get("accepted", 0)
        (key,) = set(aligned_tries(llm)) - before
        got[name] = (aligned_tries(llm)[key], accepted)
    assert got["spec"][1] >= 4, got  # the forced text was drafted and accepted
    want, have = got["plain"][0], got["spec"][0]
    assert set(have) == set(want) and len(want) >= 7, (have, want)
    for prefix, values in want.items():  # logits differ by batch shape: 1e-4
        for a, b in zip(have[prefix], values):
            assert (a is None) == (b is None), (prefix, have[prefix], values)
            assert a is None or abs(a - b) < 1e-4, (prefix, have[prefix], values)


def first_tokens(llm, prompt_ids, seed0, **kw):
    """First TOKENS tokens of SAMPLES seeded temperature-1 answers."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    eng = llm.llm_engine
    ids = [f"chi{seed0}-{i}" for i in range(SAMPLES)]
    toks = {r: [] for r in ids}
    for k, r in enumerate(ids):
        sp = SamplingParams(temperature=1.0, max_tokens=TOKENS + 1, seed=seed0 + k,
                            output_kind=RequestOutputKind.DELTA, **kw)
        eng.add_request(r, {"prompt_token_ids": prompt_ids}, sp)
    while eng.has_unfinished_requests():
        for o in eng.step():
            toks[o.request_id].extend(o.outputs[0].token_ids)
    return [tuple(toks[r][:TOKENS]) for r in ids]


def test_sampled_distribution_unchanged_with_a_biased_control(plain, spec, tok):
    from tests.test_stand_e2e import homogeneity_pvalue

    prompt = tok(RGB)["input_ids"]
    yellow = tok.encode(" yellow", add_special_tokens=False)[0]
    kw = dict(min_p=0.1, logit_bias={yellow: 3.0},
              extra_args={"grammar": {"regex": COLOURS}})
    ref = first_tokens(plain, prompt, 0, **kw)
    before = stats(spec)
    got = first_tokens(spec, prompt, 10_000, **kw)
    after = stats(spec)
    drafted = after.get("drafted", 0) - before.get("drafted", 0)
    accepted = after.get("accepted", 0) - before.get("accepted", 0)
    p = homogeneity_pvalue(ref, got)
    print(f"drafted {drafted}, accepted {accepted}, p = {p:.3g}")
    assert drafted > SAMPLES and accepted > SAMPLES // 4, (drafted, accepted)
    assert p > 0.01, p
    # The control: the same engine without the processors' effect on the
    # rows (no min_p, no bias: what drafted rows would get if the bridge
    # left them out) must be told apart from the reference.
    control = first_tokens(spec, prompt, 20_000,
                           extra_args={"grammar": {"regex": COLOURS}})
    pc = homogeneity_pvalue(ref, control)
    print(f"control p = {pc:.3g}")
    assert pc < 1e-4, pc
