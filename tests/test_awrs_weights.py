"""AWRS weights (``"weights": true``) and ``"continue_tokens"``.

A row's weight estimates the mass its grammar allows; the estimate must be
unbiased (its mean over many draws is the exact mass, computed from the
mask; a control that drops the estimator's second draw must miss). Summed
over an output, the weights turn locally constrained samples into samples
of the model conditioned on the grammar: on a finite language enumerated
exactly (as tests/test_asap.py does), the weighted samples match the
conditional distribution, which plain masking's samples are far from.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from tests.test_asap import (  # noqa: F401 - fixtures, used by name
    LARK, MAX_TOKENS, by_text, enumerate_language, lm, model_dir, noise_bound, one_thread,
    prompt, sample, tokenizer, tv, vllm_config)
from tests.test_awrs import EOS, V, logits_of, params, rt  # noqa: F401 - rt: fixture

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

from vllm_plugins.grammar.spec import (  # noqa: E402
    GrammarSpecError, compile_grammar_request, request_options, validate_grammar_request)
from vllm_plugins.logits_processors import awrs  # noqa: E402
from vllm_plugins.logits_processors.awrs_choice import RowChoice  # noqa: E402
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402
from vllm_plugins.logits_processors.grammar_state import GrammarRequest  # noqa: E402

GRAMMAR = {"regex": "(ab|ba|x|bad)+7?(0|12)", "sampling": "awrs", "weights": True}


def allowed_mass(rt, grammar, row, temperature) -> float:
    m = rt.new_matcher(compile_grammar_request(grammar))
    ok = torch.tensor([m.validate_tokens([t]) == 1 for t in range(V)])
    return float(torch.softmax(row.double() / temperature, 0)[ok].sum())


def row_estimates(rt, row, temperature, noise, n) -> list[float]:
    sp = params(GRAMMAR, temperature)
    compiled = compile_grammar_request(GRAMMAR)
    out = []
    for _ in range(n):
        req = GrammarRequest(rt.new_matcher(compiled), [], EOS)
        req.awrs = awrs.new_awrs(sp, compiled, rt, V, [], request_options(GRAMMAR))
        choice = RowChoice(rt, req, b"", awrs.AwrsStats())
        q = torch.randint(0, 2**31, (1,), dtype=torch.long) if noise == "gumbel" else None
        assert choice.choose(row.clone(), q) is not None
        out.append(math.exp(choice.log_weight))
    return out


@pytest.mark.parametrize("noise", ["cdf", "gumbel"])
def test_a_rows_weight_is_an_unbiased_estimate_of_its_allowed_mass(rt, noise, monkeypatch):
    # The first stand-in row whose refused tokens carry most of the mass.
    row = next(r for r in (logits_of(k, []) for k in range(100))
               if 0.1 < allowed_mass(rt, GRAMMAR, r, 0.7) < 0.4)
    z = allowed_mass(rt, GRAMMAR, row, 0.7)
    n = 4000

    def mean_and_se(values):
        mean = sum(values) / len(values)
        var = sum((v - mean) ** 2 for v in values) / (len(values) - 1)
        return mean, math.sqrt(var / len(values))

    mean, se = mean_and_se(row_estimates(rt, row, 0.7, noise, n))
    assert abs(mean - z) < 4 * se + 1e-9, (mean, z, se)
    # Control: the mass left at acceptance alone (no second draw) overestimates.
    monkeypatch.setattr(RowChoice, "_estimate",
                        lambda self, p_tok, left, second: math.log(left))
    biased, se_b = mean_and_se(row_estimates(rt, row, 0.7, noise, n))
    assert abs(biased - z) > 4 * max(se_b, se), (biased, z, se_b)


def sample_weighted(proc, lm, prompt, sp, n, seed):
    """n outputs, one after another, each with its summed log weight."""
    log_weights: list[float] = []
    outs = sample(proc, lm, prompt, sp, n, seed, log_weights)
    return list(zip(outs, log_weights))


def test_weighted_samples_follow_the_grammar_conditioned_distribution(
        vllm_config, lm, tokenizer, prompt):
    temperature = 1.0
    eos = tokenizer.eos_token_id
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    lang = enumerate_language(proc, lm, prompt, eos, temperature)
    z = sum(p for p, _ in lang.values())
    target = by_text(tokenizer, {s: p / z for s, (p, _) in lang.items()})
    plain_exact = by_text(tokenizer, {s: q for s, (_, q) in lang.items()})
    distortion = tv(plain_exact, target)
    assert distortion > 0.3

    sp = SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, extra_args={
        "grammar": {"lark": LARK, "sampling": "awrs", "weights": True}})
    sp.update_from_generation_config({}, eos)
    n = 400
    torch.manual_seed(3)  # the processor's own draws
    outs = sample_weighted(proc, lm, prompt, sp, n, seed=3)
    top = max(w for _, w in outs)
    weights = [math.exp(w - top) for _, w in outs]
    total = sum(weights)
    weighted: Counter = Counter()
    plain: Counter = Counter()
    for (seq, _), w in zip(outs, weights):
        text = tokenizer.decode(list(seq))
        weighted[text] += w / total
        plain[text] += 1 / n
    ess = total ** 2 / sum(w * w for w in weights)
    # Unweighted, AWRS's samples are plain masking's; weighted, the target's.
    assert tv(plain, plain_exact) < noise_bound(plain_exact, n)
    assert tv(weighted, target) < noise_bound(target, int(ess)), (weighted, target, ess)
    assert tv(weighted, target) < distortion - noise_bound(plain_exact, n)
    # The mean weight estimates P(grammatical) = z, the SMC evidence.
    ws = [math.exp(w) for _, w in outs]
    mean = sum(ws) / n
    se = math.sqrt(sum((w - mean) ** 2 for w in ws) / (n - 1) / n)
    assert abs(mean - z) < 4 * se, (mean, z, se)


def test_continue_tokens_start_the_grammar_after_them(vllm_config, lm, tokenizer, prompt):
    """A request that continues "tr" can only finish "true"; one that
    continues with text the grammar refuses fails with a clear reason."""
    eos = tokenizer.eos_token_id
    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    head = tokenizer.encode("tr", add_special_tokens=False)
    sp = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, extra_args={"grammar": {
        "lark": LARK, "sampling": "awrs", "continue_tokens": head}})
    sp.update_from_generation_config({}, eos)
    texts = {tokenizer.decode(list(seq)) for seq, _ in
             sample_weighted(proc, lm, prompt + tuple(head), sp, 20, seed=4)}
    assert texts == {"ue"}, texts
    bad = tokenizer.encode("no", add_special_tokens=False)
    sp.extra_args["grammar"]["continue_tokens"] = bad
    proc.update_state(BatchUpdate(batch_size=1, removed=[], added=[(0, sp, [], [])], moved=[]))
    assert "continue_tokens" in (proc._reqs[0].failed or "")


@pytest.mark.parametrize("spec, kw, needle", [
    ({"regex": "a", "weights": True}, {}, 'needs "sampling": "awrs"'),
    ({"regex": "a", "sampling": "awrs", "weights": 1}, {}, "must be true or false"),
    ({"regex": "a", "sampling": "awrs", "weights": True}, {"temperature": 0.0},
     "needs random sampling"),
    ({"regex": "a", "sampling": "awrs", "weights": True}, {"top_p": 0.9}, "top_p=0.9"),
    ({"regex": "a", "sampling": "awrs", "weights": True}, {"top_k": 5}, "top_k=5"),
    ({"regex": "a", "sampling": "awrs", "weights": True}, {"n": 2}, "needs n=1"),
    ({"regex": "a", "continue_tokens": [1, -2]}, {}, "must be a list of token ids"),
    ({"regex": "a", "continue_tokens": "12"}, {}, "must be a list of token ids"),
    ({"regex": "a", "aligned": True, "continue_tokens": [3]}, {}, "cannot be combined"),
])
def test_bad_per_request_options_name_the_option(spec, kw, needle):
    sp = SamplingParams(**{"temperature": 1.0, **kw}, extra_args={"grammar": spec})
    with pytest.raises(GrammarSpecError, match=needle):
        GrammarLogitsProcessor.validate_params(sp)


def test_per_request_options_leave_the_compiled_grammar_shared():
    a = validate_grammar_request({"grammar": {"regex": "a+", "sampling": "awrs",
                                              "weights": True, "continue_tokens": [1]}})
    b = validate_grammar_request({"grammar": {"regex": "a+", "sampling": "awrs"}})
    assert a is b


def test_the_scheduler_adds_the_weights_of_committed_rows_only():
    """Under speculation a step weighs every candidate position; the
    request's total takes the first n, n being the tokens it gained, and
    its finished output carries the total beside a connector's own keys."""
    from types import SimpleNamespace

    from vllm_plugins.bridge import grammar_weights as gw

    req = SimpleNamespace(num_output_tokens=5)
    sched = SimpleNamespace(requests={"r": req})
    step = SimpleNamespace(**{gw.WEIGHTS_ATTR: {"r": [-0.5, -0.25, -4.0, -8.0]}})
    seen = gw.before_update(sched, step)
    req.num_output_tokens = 7  # two drafts' rows committed: positions 0 and 1
    out = SimpleNamespace(request_id="r", finish_reason=None, kv_transfer_params=None)
    gw.after_update(sched, step, seen, {0: SimpleNamespace(outputs=[out])})
    assert out.kv_transfer_params is None
    seen = gw.before_update(sched, SimpleNamespace(**{gw.WEIGHTS_ATTR: {"r": [-1.0]}}))
    req.num_output_tokens = 8
    out.finish_reason = "stop"
    out.kv_transfer_params = {"do_remote_decode": False}
    gw.after_update(sched, SimpleNamespace(**{gw.WEIGHTS_ATTR: {"r": [-1.0]}}), seen,
                    {0: SimpleNamespace(outputs=[out])})
    assert out.kv_transfer_params == {
        "do_remote_decode": False,
        gw.OUTPUT_KEY: {"awrs_log_weight": -1.75, "awrs_tokens": 3}}
    assert not getattr(sched, gw.TOTALS_ATTR)  # handed out, forgotten


def test_the_documented_smc_loop_is_the_tested_one():
    """docs/grammar.md shows tests/smc_example.py whole: the loop a reader
    copies is the one tests/test_asap_e2e.py runs through an engine."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "grammar.md").read_text()
    block = doc.split("(`tests/smc_example.py`):\n\n```python\n", 1)[1].split("```", 1)[0]
    assert block == (root / "tests" / "smc_example.py").read_text()


def test_verified_rows_are_weighed_at_each_position(vllm_config, rt):
    """Under speculation the target rows (after draft[:j]) and the bonus row
    each get a weight, by position, up to the first draft the grammar
    refuses (rows after it are never committed)."""
    from tests.test_awrs import TinyTokenizer

    proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
    proc._runtime, proc._vocab_size = rt, V
    grammar = {"regex": "(ab|ba)+7?(0|12)", "sampling": "awrs", "weights": True}
    enc = TinyTokenizer()
    for draft, weighed in ((enc("abba"), 3), (enc("abba") + [11, 14], 3)):
        sp = params(grammar, 1.0)
        proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[],
                                      added=[(0, sp, [1], [])]))
        rows = torch.stack([logits_of(5, draft[:j]) for j in range(len(draft) + 1)])
        proc.begin_verification([draft])
        try:
            proc.apply_drafted(rows[:-1].clone(), [len(draft)])
            proc.apply(rows[-1:].clone())  # the bonus row, after all drafts
        finally:
            proc.end_verification()
        ws = proc.take_awrs_weights()[0]
        # "ab","ba" accepted by the grammar: rows 0..2; "x" refused: nothing after.
        assert len(ws) == weighed, ws
        assert all(w <= 1e-6 and math.isfinite(w) for w in ws)
        proc.update_state(BatchUpdate(batch_size=0, removed=[0], added=[], moved=[]))
