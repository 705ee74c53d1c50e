"""AWRS (``"sampling": "awrs"``) against the mask mode, on a tiny vocabulary.

No engine: a 26-token tokenizer (llguidance's ``TokenizerWrapper`` over a
greedy longest-match splitter) and a stand-in model whose next-token logits
are a seeded function of the prefix. The grammar processor is driven as
vLLM's V1 runner drives it (``update_state`` with a ``BatchUpdate``) and the
rows are sampled by vLLM's own ``Sampler`` (temperature, min-p, top-k/top-p,
per-request generators), once with a mask-mode request and once with an
AWRS request of the same prompt, side by side in one batch.

Checks: greedy output equal token for token; seeded samples equal token for
token (the AWRS generator copy stays in step with vLLM's); unseeded samples
distributed as the exact masked distribution (chi-square, with a biased
control that must fail); verified rows under speculation equal the mask
mode's at each position; fewer grammar checks than masked vocabulary entries.
"""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch

from tests.processor_fixtures import processor_fixtures
from tests.test_stand import chi2_pvalue

pytest.importorskip("vllm")
llguidance = pytest.importorskip("llguidance")

from llguidance._tokenizer import TokenizerWrapper  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessors  # noqa: E402
from vllm.v1.sample.metadata import SamplingMetadata  # noqa: E402
from vllm.v1.sample.sampler import Sampler  # noqa: E402

from vllm_plugins.grammar.runtime import GrammarRuntime  # noqa: E402
from vllm_plugins.grammar.spec import (  # noqa: E402
    GrammarSpecError, compile_grammar_request, validate_grammar_request)
from vllm_plugins.logits_processors import awrs  # noqa: E402
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402


class TinyTokenizer:
    """26 tokens; encodes by greedy longest match (other characters are dropped)."""

    PIECES = ["<eos>", "{", "}", '"', ":", ",", " ", "\n", "a", "b", "c", "x", "ab", "ba",
              "0", "1", "2", "12", "7", "true", "false", "null", "bad", "word", "[", "]"]

    def __init__(self) -> None:
        self.eos_token_id = 0
        self.bos_token_id = None
        self.tokens = [p.encode() for p in self.PIECES]
        self.special_token_ids = [0]

    def __call__(self, s):
        s = s.decode() if isinstance(s, bytes) else s
        out = []
        while s:
            best = max((i for i, p in enumerate(self.PIECES) if i and s.startswith(p)),
                       key=lambda i: len(self.PIECES[i]), default=None)
            if best is None:  # not spelled by this vocabulary: left out
                s = s[1:]
                continue
            out.append(best)
            s = s[len(self.PIECES[best]):]
        return out


V = len(TinyTokenizer.PIECES)
EOS = 0
SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "array", "items": {"enum": ["ab", "ba"]},
                                     "maxItems": 2}},
    "required": ["a", "b"], "additionalProperties": False}
GRAMMARS = [
    {"json_schema": SCHEMA, "whitespace_flexible": False},
    {"regex": "(ab|ba)+7?(0|12)"},
    {"lark": 'start: "true" | "false" | "null" | "[" ("1" | "2")* "]"'},
]


@pytest.fixture(scope="module")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=256)


@pytest.fixture(scope="module")
def rt():
    return GrammarRuntime(llguidance.LLTokenizer(TokenizerWrapper(TinyTokenizer())))


@pytest.fixture()
def proc(vllm_config, rt):
    p = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    p._runtime, p._vocab_size = rt, V  # the tiny vocabulary
    return p


def logits_of(prompt: int, prefix: list[int], refuse_bias: float = 2.0) -> torch.Tensor:
    """The stand-in model: seeded by the prefix; 'x', 'bad' and 'word' (never
    allowed) get a bias so that refusals and the mask fallback happen."""
    g = torch.Generator().manual_seed(hash((prompt, *prefix)) & 0x7FFFFFFF)
    row = torch.randn(V, generator=g) * 2.0
    row[[11, 22, 23]] += refuse_bias
    return row


def params(grammar, temperature=0.0, **kw) -> SamplingParams:
    sp = SamplingParams(temperature=temperature, max_tokens=24,
                        extra_args={"grammar": grammar}, **kw)
    sp.update_from_generation_config({}, EOS)
    return sp


def metadata(proc, plist, generators, extra=()) -> SamplingMetadata:
    """What vLLM's input batch hands its sampler for these requests."""
    temps = [0.0 if p.temperature < 1e-5 else p.temperature for p in plist]
    top_k = [p.top_k if 0 < p.top_k < V else V for p in plist]
    n = len(plist)
    return SamplingMetadata(
        temperature=torch.tensor(temps, dtype=torch.float32),
        all_greedy=all(t == 0.0 for t in temps), all_random=all(t > 0 for t in temps),
        top_p=None if all(p.top_p >= 1 for p in plist) else
        torch.tensor([p.top_p for p in plist], dtype=torch.float32),
        top_k=None if all(k == V for k in top_k) else torch.tensor(top_k, dtype=torch.int32),
        generators=generators, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in range(n)], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors([proc, *extra]))


def decode_pair(proc, grammar, prompt, temperature=0.0, seed=None, extra=(), preempt_at=None,
                **kw):
    """Run a mask-mode request (row 0) and an AWRS request (row 1) of one
    prompt side by side through vLLM's Sampler; return both outputs.
    ``preempt_at``: after that many steps both leave the batch and come
    back with their outputs (vLLM keeps a request's generator meanwhile)."""
    plist = [params(dict(grammar, sampling=mode), temperature, seed=seed, **kw)
             for mode in ("mask", "awrs")]
    outs: list[list[int]] = [[], []]
    update = BatchUpdate(batch_size=2, removed=[], moved=[],
                         added=[(i, p, [1], outs[i]) for i, p in enumerate(plist)])
    for p in (proc, *extra):
        p.update_state(update)
    gens = {} if seed is None else {i: torch.Generator().manual_seed(seed) for i in range(2)}
    done = [False, False]
    sampler = Sampler()
    for step in range(24):
        if step == preempt_at:
            for p in (proc, *extra):
                p.update_state(BatchUpdate(batch_size=0, removed=[1, 0], moved=[], added=[]))
                p.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
                    (i, pl, [1], outs[i]) for i, pl in enumerate(plist)]))
        logits = torch.stack([logits_of(prompt, o) for o in outs])
        for p in (proc, *extra):
            p.update_state(None)
        proc.awrs_defer = True  # as the runner's _sample does (bridge.v1.grammar_awrs)
        tok = sampler(logits, metadata(proc, plist, gens, extra)).sampled_token_ids
        proc.awrs_after_sample(tok)
        for i in range(2):
            if not done[i]:
                outs[i].append(int(tok[i, 0]))
                done[i] = outs[i][-1] == EOS
        if all(done):
            break
    return outs


# ---------------------------------------------------------------- the spec
@pytest.mark.parametrize("grammar, needle", [
    ({"regex": "a", "sampling": "fast"}, '["sampling"] must be one of'),
    ({"regex": "a", "sampling": "awrs", "aligned": True}, '"awrs" cannot be combined'),
    ({"regex": "a", "check": "digits_until_newline"}, '["check"] needs "sampling": "awrs"'),
    ({"regex": "a", "sampling": "awrs", "check": "nope"}, "unknown check 'nope'"),
    ({"regex": "a", "sampling": "awrs", "check": 3}, '["check"] must be the name'),
])
def test_bad_options_name_the_option(grammar, needle):
    with pytest.raises(GrammarSpecError) as e:
        validate_grammar_request({"grammar": grammar})
    assert needle in str(e.value)


def test_penalties_are_refused_with_awrs():
    sp = params({"regex": "a", "sampling": "awrs"}, 1.0, repetition_penalty=1.2)
    with pytest.raises(ValueError, match='"awrs" cannot be combined with repetition_penalty'):
        GrammarLogitsProcessor.validate_params(sp)
    GrammarLogitsProcessor.validate_params(params({"regex": "a", "sampling": "awrs"}, 1.0))
    assert compile_grammar_request({"regex": "a", "sampling": "awrs"}).sampling == "awrs"
    assert compile_grammar_request({"regex": "a"}).sampling == "mask"


# ---------------------------------------------------------------- exactness
@pytest.mark.parametrize("grammar", GRAMMARS, ids=["json", "regex", "lark"])
def test_greedy_equals_mask_mode_and_checks_fewer_tokens(proc, grammar):
    for prompt in range(12):
        mask_out, awrs_out = decode_pair(proc, grammar, prompt)
        assert awrs_out == mask_out, prompt
    s = proc.awrs_stats
    assert s.rows > 0 and s.masks > 0  # the fallback ran too
    assert s.checks + s.mask_tokens < s.rows * V
    # What /metrics shows of it (every name declared there).
    from vllm_plugins.bridge.counters import BY_NAME

    counters = proc.counters()
    assert set(counters) <= set(BY_NAME)
    assert counters["awrs_evaluations"] == {"": s.checks + s.mask_tokens}
    assert counters["awrs_tokens"] == {"": s.rows}


@pytest.mark.parametrize("kw", [{}, {"top_k": 3}, {"top_p": 0.8}, {"min_p": 0.1}],
                         ids=["plain", "top_k", "top_p", "min_p"])
def test_seeded_samples_equal_mask_mode(proc, vllm_config, kw):
    """vLLM's sampler draws a seeded request's noise from its generator; the
    AWRS copy draws the same, so the tokens are the mask mode's."""
    extra = ()
    if "min_p" in kw:
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

        extra = (MinPLogitsProcessor(vllm_config, torch.device("cpu"), False),)
    for prompt in range(8):
        for grammar in GRAMMARS:
            mask_out, awrs_out = decode_pair(proc, grammar, prompt, temperature=1.0,
                                             seed=prompt, extra=extra, **kw)
            assert awrs_out == mask_out, (prompt, grammar)
    assert proc.awrs_stats.rows > 0


def test_seeded_samples_stay_equal_after_a_preemption(proc):
    """A request that comes back with output has drawn once per token: the
    AWRS generator copy skips as many draws and stays in step."""
    for prompt in range(6):
        mask_out, awrs_out = decode_pair(proc, GRAMMARS[0], prompt, temperature=1.0,
                                         seed=100 + prompt, preempt_at=3)
        assert awrs_out == mask_out, prompt


def exact_first_token(rt, grammar, row, temperature):
    m = rt.new_matcher(compile_grammar_request(grammar))
    ok = torch.tensor([m.validate_tokens([t]) == 1 for t in range(V)])
    return torch.softmax((row / temperature).masked_fill(~ok, float("-inf")), 0)


@pytest.mark.parametrize("noise", ["gumbel", "exponential", "cdf"])
def test_unseeded_draws_follow_the_masked_distribution(rt, noise):
    """Chi-square against the mask mode's exact distribution; the control
    (draws without the refusal loop's removal: the unmasked distribution
    cut to the allowed tokens by redrawing fresh noise, i.e. a different
    race each try) is right too, so the biased control samples at the wrong
    temperature and must fail. The noise comes from a seeded generator
    (forked, so the suite's order does not move it): the verdict is the same
    on every run, not a one-in-a-thousand false alarm somewhere in CI."""
    grammar = {"regex": "(ab|ba|x|bad)+7?(0|12)", "sampling": "awrs"}
    row = logits_of(3, [], refuse_bias=1.0)
    target = exact_first_token(rt, grammar, row, 0.7)
    n = 3000

    def draws(temperature):
        counts = Counter()
        sp = params(grammar, temperature)
        for i in range(n):
            from vllm_plugins.logits_processors.grammar_state import GrammarRequest

            req = GrammarRequest(rt.new_matcher(compile_grammar_request(grammar)), [], EOS)
            req.awrs = awrs.new_awrs(sp, compile_grammar_request(grammar), rt, V, [])
            stats = awrs.AwrsStats()
            choice = awrs.RowChoice(rt, req, b"", stats)
            q = (torch.randint(0, 2**31, (1,), dtype=torch.long) if noise == "gumbel" else
                 torch.empty(V).exponential_() if noise == "exponential" else
                 None)  # an unseeded row: the inverse-CDF draw
            counts[choice.choose(row.clone(), q)] += 1
        return [counts[t] for t in range(V)]

    with torch.random.fork_rng():
        torch.manual_seed(0)  # the inverse-CDF draw's uniforms come from here
        assert chi2_pvalue(draws(0.7), target.numpy()) > 1e-3
        assert chi2_pvalue(draws(0.9), target.numpy()) < 1e-6  # biased control


def test_verified_rows_are_the_mask_modes_at_each_position(proc, rt):
    """Under speculation (the bridge's begin_verification / apply_drafted),
    each target row of an AWRS request has as its argmax the greedy token
    the mask mode gives at that position; rows after a draft the grammar
    refuses are EOS."""
    grammar = {"regex": "(ab|ba)+7?(0|12)"}
    enc = TinyTokenizer()
    draft = enc("abba") + [11, 14]  # 'ab','ba', then 'x' (refused), '0'
    plist = [params(dict(grammar, sampling=m)) for m in ("mask", "awrs")]
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(i, p, [1], []) for i, p in enumerate(plist)]))
    rows = torch.stack([logits_of(5, draft[:j]) for j in range(len(draft))])
    logits = torch.cat([rows, rows])  # request 0's rows, then request 1's
    proc.begin_verification([draft, draft])
    try:
        out = proc.apply_drafted(logits.clone(), [len(draft), len(draft)])
    finally:
        proc.end_verification()
    n = len(draft)
    for j in range(n):
        mask_tok = int(out[j].argmax())
        awrs_row = out[n + j]
        # One-hot, or (greedy, argmax allowed) the row as it came.
        assert torch.isfinite(awrs_row).sum() == 1 or torch.equal(awrs_row, logits[n + j])
        if j <= 3:  # at or before the refused draft: the mask mode's token
            assert int(awrs_row.argmax()) == mask_tok, j
        else:
            assert int(awrs_row.argmax()) == EOS


# ---------------------------------------------------------------- checks
CHECKS = textwrap.dedent("""\
    [vllm_plugins.grammar_checks]
    digits_until_newline = tests.grammar_check_examples:digits_until_newline
    banned_words = tests.grammar_check_examples:banned_words
    """)


@pytest.fixture()
def installed_checks(tmp_path, monkeypatch):
    dist = tmp_path / "example_checks-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-checks\n"
                                   "Version: 1.0\n")
    (dist / "entry_points.txt").write_text(CHECKS)
    monkeypatch.syspath_prepend(str(tmp_path))


def run_check(proc, spec, prompts, temperature=1.0):
    outs = []
    for prompt in prompts:
        mask_out, awrs_out = decode_pair(proc, spec, prompt, temperature=temperature)
        outs.append(awrs_out)
    return outs


def test_a_check_constrains_sampled_text(proc, rt, installed_checks):
    from tests.grammar_check_examples import BANNED

    spec = {"regex": "[a-z0-9 \\n]+", "sampling": "awrs", "check": "banned_words"}
    with pytest.raises(GrammarSpecError, match='needs "sampling": "awrs"'):
        validate_grammar_request({"grammar": {"regex": "a", "check": "banned_words"}})
    decode = rt.ll_tokenizer.decode_str
    for out in run_check(proc, {k: v for k, v in spec.items()}, range(10)):
        text = decode([t for t in out if t != EOS])
        assert not any(w in text for w in BANNED), text
    assert proc.awrs_stats.check_calls > 0


def test_digits_until_newline_alone(proc, rt, installed_checks):
    spec = {"check": "digits_until_newline", "sampling": "awrs"}
    decode = rt.ll_tokenizer.decode_str
    for out in run_check(proc, spec, range(10)):
        text = decode([t for t in out if t != EOS])
        head = text.partition("\n")[0]
        assert head.isdigit() or head == "", text
    assert proc.awrs_stats.check_calls < proc.awrs_stats.rows * V


def test_a_check_that_raises_fails_its_request_only(proc, installed_checks, monkeypatch):
    import tests.grammar_check_examples as ex

    monkeypatch.setattr(ex, "BANNED", None)  # banned_words now raises TypeError
    spec = {"regex": "[a-z0-9 \\n]+", "sampling": "awrs", "check": "banned_words"}
    plist = [params({"regex": "[a-z]+"}), params(spec)]
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(i, p, [1], []) for i, p in enumerate(plist)]))
    proc.apply(torch.stack([logits_of(0, []), logits_of(0, [])]))
    assert list(proc.take_failures()) == []  # reported at the next step
    proc.apply(torch.stack([logits_of(0, []), logits_of(0, [])]))
    failures = proc.take_failures()
    assert list(failures) == [1] and "banned_words" in failures[1]


def test_single_token_checks_agree_with_llguidance_masks(tokenizer):
    """The pin of ``RowChoice.allowed``'s rule on the default model's
    tokenizer: a token is in llguidance's mask exactly when
    ``validate_tokens`` accepts it and, if it spells a proper prefix of the
    bytes the grammar forces, it is the first forced token. Random walks
    through dev schemas; every token at forced states, a sample elsewhere."""
    import random

    from vllm_plugins.bench.grammar_bench import load_schemas
    from vllm_plugins.grammar.runtime import build_ll_tokenizer

    rt = GrammarRuntime(build_ll_tokenizer(tokenizer))
    width = rt.vocab_size
    rng = random.Random(0)
    forced = checked = prefix_refused = 0
    for row in load_schemas(8):
        grammar = {"json_schema": row["schema"], "sampling": "awrs"}
        try:
            compiled = compile_grammar_request(grammar)
        except GrammarSpecError:
            continue
        from vllm_plugins.logits_processors.grammar_state import GrammarRequest

        req = GrammarRequest(rt.new_matcher(compiled), [], rt.eos_token)
        req.awrs = awrs.new_awrs(params(grammar), compiled, rt, width, [])
        for _ in range(40):
            m = req.matcher
            if m.is_stopped():
                break
            words = rt.fill([(m, 0)], 1)[:1]
            mask = ~rt.banned_tokens(words, width, torch.device("cpu"))[0]
            choice = awrs.RowChoice(rt, req, b"", awrs.AwrsStats())
            ff = m.compute_ff_bytes()
            forced += bool(ff)
            cand = range(width) if ff else rng.sample(range(width), 400)
            for t in cand:
                checked += 1
                assert choice.allowed(t) == bool(mask[t]), (ff, t)
                prefix_refused += bool(ff) and not mask[t] and m.validate_tokens([t]) == 1
            allowed = mask.nonzero().flatten().tolist()
            t = rng.choice(allowed)
            if t == rt.eos_token:
                break
            m.consume_token(t)
    assert forced and prefix_refused  # the rule was needed, and held


def test_v2_runner_masks_awrs_requests_and_fails_checks(vllm_config, installed_checks):
    """vLLM's V2 model runner: an AWRS request is masked plainly (its row
    keeps every allowed token), and one with a check, which no mask
    applies, fails."""
    from tests.test_grammar_processor import _ctx, _v2

    proc, rs = _v2(vllm_config)
    width = vllm_config.model_config.get_vocab_size()
    assert proc.add_request(0, params({"regex": "[a-z]+", "sampling": "awrs"}))
    assert proc.add_request(1, params({"regex": "[a-z]+", "sampling": "awrs",
                                       "check": "banned_words"}))
    assert proc._reqs[0].awrs is None and not proc._reqs[0].failed
    assert "check needs vLLM's V1 model runner" in proc._reqs[1].failed
    rs.prompt_len.np[:2] = 1
    logits = torch.zeros(2, width)
    proc.apply(logits, _ctx([0, 1], [1, 1], [0, 0], [5, 5]))
    assert torch.isfinite(logits[0]).sum() > 1000  # the mask: every lowercase spelling
    assert torch.isfinite(logits[1]).sum() == 1    # the failure text, forced


def test_a_check_sees_the_drafts_before_a_verified_row(proc, rt, installed_checks):
    """Under speculation row j is checked against the output plus
    ``draft[:j]``: after a drafted "1", "digits until a newline" allows a
    newline, which it refuses at the start."""
    spec = {"check": "digits_until_newline", "sampling": "awrs"}
    enc = TinyTokenizer()
    draft = enc("1") + enc("2")
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                  added=[(0, params(spec), [1], [])]))
    rows = torch.full((len(draft), V), -5.0)
    rows[:, 7] = 5.0                 # "\n" first,
    rows[:, [8, 9, 10]] = 4.0        # then letters,
    rows[:, 18] = 3.0                # then "7"
    proc.begin_verification([draft])
    try:
        out = proc.apply_drafted(rows.clone(), [len(draft)])
    finally:
        proc.end_verification()
    picked = [TinyTokenizer.PIECES[int(r.argmax())] for r in out]
    assert picked == ["7", "\n"]
    assert proc.awrs_stats.check_calls >= 4  # "\n" and three letters refused at row 0
