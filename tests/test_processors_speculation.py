"""Logits processors under speculation, without an engine.

vLLM's rejection sampler (patched by vllm_plugins.bridge.v1.verify_processors)
runs on CPU tensors laid out as the runner lays them out, with our grammar
processor, logit_bias and min_p built the way the runner builds them. Each
verified row must carry what plain decoding applies at that position: the
reference is plain decoding walked position by position (a second grammar
processor fed the drafts as committed output, the bias added, min_p's
threshold computed on the row divided by the temperature).
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from tests.processor_fixtures import processor_fixtures, spec_decode_metadata

pytest.importorskip("llguidance")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

import vllm_plugins  # noqa: E402
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402

REGEX = r"(ab|cd)+ [0-9]{2,4}!"


@pytest.fixture(scope="module")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=512)


@pytest.fixture(scope="module")
def spec_config(vllm_config):
    """The model's config as an engine drafting with our proposer sees it."""
    vllm_plugins.register()
    cfg = copy.copy(vllm_config)
    object.__setattr__(cfg, "speculative_config", SimpleNamespace(
        method="custom_class", vllm_plugins_options={"method": "token_recycling"}))
    return cfg


def params(**kw) -> SamplingParams:
    sp = SamplingParams(**kw)
    sp.update_from_generation_config({}, 2)  # what the engine does: EOS = 2
    return sp


def toks(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def grammar_params(**kw):
    return params(extra_args={"grammar": {"regex": REGEX}}, **kw)


def built(spec_config, requests):
    """The runner's processors for a batch of (params, output list)."""
    from vllm.v1.worker import gpu_model_runner

    procs = gpu_model_runner.build_logitsprocs(spec_config, torch.device("cpu"),
                                               False, False, ())
    added = [(i, sp, [1, 2], out) for i, (sp, out) in enumerate(requests)]
    for p in procs.all:
        p.update_state(BatchUpdate(len(requests), [], added, []))
    return procs


def plain_row(tokenizer_config, sp, output, row):
    """What plain decoding applies to ``row`` after ``output``: a fresh
    grammar processor fed the output as committed, then the bias."""
    proc = GrammarLogitsProcessor(tokenizer_config, torch.device("cpu"), False)
    proc.update_state(BatchUpdate(1, [], [(0, sp, [1, 2], list(output))], []))
    out = row.clone().unsqueeze(0)
    for tok, bias in (sp.logit_bias or {}).items():
        out[0, tok] += bias
    if sp.extra_args:
        out = proc.apply(out)
    return out[0]


# ------------------------------------------------------------ start-up
def test_engine_with_our_proposer_builds_the_processors(spec_config, vllm_config):
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor, MinPLogitsProcessor)
    from vllm.v1.worker import gpu_model_runner

    procs = gpu_model_runner.build_logitsprocs(spec_config, torch.device("cpu"),
                                               False, False, ())
    kinds = {type(p) for p in procs.all}
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor,
            GrammarLogitsProcessor} <= kinds
    # vLLM's own drafters keep vLLM's refusal: min_tokens only.
    theirs = copy.copy(vllm_config)
    object.__setattr__(theirs, "speculative_config", SimpleNamespace(method="ngram"))
    assert {type(p).__name__ for p in gpu_model_runner.build_logitsprocs(
        theirs, torch.device("cpu"), False, False, ()).all} == {"MinTokensLogitsProcessor"}


def test_other_explicit_processors_are_refused_by_name(spec_config):
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
    from vllm.v1.worker import gpu_model_runner

    class Other(MinPLogitsProcessor):
        pass

    with pytest.raises(ValueError, match=r"logits_processors \['Other'\]"):
        gpu_model_runner.build_logitsprocs(spec_config, torch.device("cpu"),
                                           False, False, (Other,))


def test_min_p_and_logit_bias_admitted_only_with_our_proposer(spec_config):
    vllm_plugins.register()
    sp = SamplingParams(min_p=0.2, logit_bias={5: 1.0})
    sp._validate_spec_decode(spec_config.speculative_config)  # admitted
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match="min_p and logit_bias"):
        sp._validate_spec_decode(SimpleNamespace(method="ngram"))


def test_grammar_requests_admitted_only_with_our_proposer(spec_config, vllm_config):
    from vllm_plugins.logits_processors.grammar import engine_drops_processors

    assert engine_drops_processors(spec_config) is None
    theirs = copy.copy(vllm_config)
    object.__setattr__(theirs, "speculative_config", SimpleNamespace(method="ngram"))
    assert "no custom logits processors" in engine_drops_processors(theirs)


# ------------------------------------------------------------ each verified row
def spec_step(procs, layout, logits, temperature=None, top_k=None, bonus_rows=None,
              **fields):
    """vLLM's rejection sampler on one step: ``layout`` is each request's
    drafts; ``logits`` has len(drafts) + 1 rows per request (targets, then
    the bonus row); ``fields`` set more of the SamplingMetadata (allowed
    tokens, bad words). Returns the processed target rows and the bonus
    tokens; the processed bonus rows are appended to ``bonus_rows``."""
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    vllm_plugins.register()
    meta = spec_decode_metadata(layout)
    n = len(layout)
    greedy = temperature is None
    sm = SamplingMetadata(
        temperature=None if greedy else torch.full((n,), temperature),
        all_greedy=greedy, all_random=not greedy,
        top_p=None, top_k=None if top_k is None else torch.full((n,), top_k),
        generators={}, max_num_logprobs=None, no_penalties=True,
        prompt_token_ids=None, frequency_penalties=torch.zeros(n),
        presence_penalties=torch.zeros(n), repetition_penalties=torch.ones(n),
        output_token_ids=[[] for _ in layout], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=procs, spec_token_ids=list(layout))
    for name, value in fields.items():
        setattr(sm, name, value)
    # The rejection kernels themselves are vLLM's and need Triton: capture
    # what reaches them, the processed target rows and the bonus tokens.
    from vllm.v1.sample import rejection_sampler as rs

    seen = {}
    constraints, sample = rs.apply_sampling_constraints, rs.rejection_sample

    def capture_rows(target_logits, cu, sm):
        seen["rows"] = target_logits.clone()
        return constraints(target_logits, cu, sm)

    def capture_bonus(*args, **kwargs):
        seen["bonus"] = args[6].flatten().tolist()
        return torch.full((n, meta.max_spec_len + 1), -1, dtype=torch.int32)

    rs.apply_sampling_constraints, rs.rejection_sample = capture_rows, capture_bonus
    try:
        sampler = Sampler()
        if bonus_rows is not None:
            plain_sample = sampler.sample

            def capture_bonus_rows(rows, *args, **kwargs):
                bonus_rows.append(rows.clone())
                return plain_sample(rows, *args, **kwargs)

            sampler.sample = capture_bonus_rows
        RejectionSampler(sampler)(meta, None, logits.clone(), sm)
    finally:
        rs.apply_sampling_constraints, rs.rejection_sample = constraints, sample
    return seen["rows"], seen["bonus"]


def greedy_accept(layout, rows, bonus):
    """vLLM's greedy rule: drafts kept while they are the target's argmax."""
    out, start = [], 0
    for i, d in enumerate(layout):
        emitted = []
        for j, tok in enumerate(d):
            best = int(rows[start + j].argmax())
            emitted.append(best)
            if best != tok:
                break
        else:
            emitted.append(bonus[i])
        out.append(emitted)
        start += len(d)
    return out


def test_greedy_verification_applies_each_position(spec_config, tokenizer):
    """Greedy: the output of one step is plain decoding's, position by
    position, for a grammar request, a logit_bias request and one with
    neither; the drafts follow the grammar for a while, then leave it."""
    good = toks(tokenizer, "abcdab 123!")
    out_g, out_b, out_n = [], [7, 8], [9]
    vocab = spec_config.model_config.get_vocab_size()
    bias_tok = 1234
    g = grammar_params()
    b = params(logit_bias={bias_tok: 30.0, 17: -100.0})
    n = params()
    procs = built(spec_config, [(g, out_g), (b, out_b), (n, out_n)])
    gen = torch.Generator().manual_seed(0)
    layout = [good[:3] + [tokenizer.encode("zz", add_special_tokens=False)[0]],
              [bias_tok] * 3, [11, 12]]
    logits = torch.randn(sum(len(d) + 1 for d in layout), vocab, generator=gen)
    # The target prefers the grammar request's drafts, the last one too,
    # which the grammar forbids there.
    for j, tok in enumerate(layout[0]):
        logits[j, tok] += 50.0
    # Plain greedy decoding: the argmax of each processed row in turn.
    expected, start = [], 0
    for d, (sp, out) in zip(layout, [(g, out_g), (b, out_b), (n, out_n)]):
        emitted = []
        for j in range(len(d) + 1):
            row = plain_row(spec_config, sp, out + d[:j], logits[start + j])
            tok = int(row.argmax())
            emitted.append(tok)
            if j == len(d) or tok != d[j]:
                break
        expected.append(emitted)
        start += len(d) + 1
    assert greedy_accept(layout, *spec_step(procs, layout, logits)) == expected
    # The test can fail: the grammar request keeps three drafts (its later
    # rows needed the drafts consumed) and its mask rejects the fourth; the
    # bias request keeps all of its drafts.
    assert expected[0][:3] == layout[0][:3] and expected[0][3] != layout[0][3]
    assert len(expected[1]) == 4


def test_target_rows_are_masked_after_the_drafts_before_them(spec_config, tokenizer):
    """Every target row and the bonus row carry plain decoding's mask at
    their position; the matcher is back at the committed output afterwards."""
    draft = toks(tokenizer, "abcd 12")
    out = toks(tokenizer, "ab")
    g = grammar_params()
    procs = built(spec_config, [(g, out)])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    vocab = spec_config.model_config.get_vocab_size()
    logits = torch.zeros(len(draft) + 1, vocab)
    proc.begin_verification([draft])
    try:
        target = proc.apply_drafted(logits[:-1].clone(), [len(draft)])
        bonus = proc.apply(logits[-1:].clone())
    finally:
        proc.end_verification()
    rows = list(target) + [bonus[0]]
    masks = [torch.isfinite(r) for r in rows]
    for j, mask in enumerate(masks):
        ref = torch.isfinite(plain_row(spec_config, g, out + draft[:j], logits[j]))
        assert torch.equal(mask, ref), f"position {j}"
    assert len({tuple(m.nonzero().flatten().tolist()) for m in masks}) > 1
    # Rolled back: the next plain row is masked at the committed output.
    again = proc.apply(torch.zeros(1, vocab))
    assert torch.equal(torch.isfinite(again[0]), masks[0])


def test_min_p_and_logit_bias_on_target_rows_match_plain_sampling(spec_config):
    """Sampled: each target row reaches the rejection sampler as the plain
    sampler leaves it before top-k (bias added, then min_p's threshold on the
    row divided by the temperature); the bonus row is the plain sampler's."""
    vocab = spec_config.model_config.get_vocab_size()
    temperature = 0.7
    a = params(temperature=temperature, min_p=0.05, logit_bias={3: 4.0})
    b = params(temperature=temperature)
    procs = built(spec_config, [(a, []), (b, [])])
    layout = [[1, 2, 3], [4]]
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(sum(len(d) + 1 for d in layout), vocab, generator=gen) * 3
    rows, _ = spec_step(procs, layout, logits, temperature=temperature)
    target_idx = [0, 1, 2, 4]
    for k, (r, sp) in enumerate(zip(target_idx, [a, a, a, b])):
        ref = logits[r].clone()
        for tok, bias in (sp.logit_bias or {}).items():
            ref[tok] += bias
        if sp.min_p:
            p = torch.softmax(ref / temperature, -1)
            ref[p < sp.min_p * p.max()] = float("-inf")
        assert torch.equal(torch.isfinite(rows[k]), torch.isfinite(ref)), k
        fin = torch.isfinite(ref)
        assert torch.allclose(rows[k][fin], ref[fin]), k
    # min_p masked something (the check above could fail).
    assert not torch.isfinite(rows[0]).all() and torch.isfinite(rows[3]).all()


def test_min_tokens_counts_the_drafts_on_every_row_the_bonus_row_too(spec_config):
    """min_tokens=4 after 2 committed tokens: the row after drafts[:j] has
    2 + j tokens before it, so plain decoding masks EOS there only while
    2 + j < 4. Request 0 (3 drafts): its bonus row follows 5 tokens and may
    stop; request 1 (1 draft): its bonus row follows 3 and may not."""
    vocab = spec_config.model_config.get_vocab_size()
    eos = 2
    reqs = [(params(min_tokens=4), [5, 6]), (params(min_tokens=4), [5, 6])]
    procs = built(spec_config, reqs)
    layout = [[11, 12, 13], [11]]
    logits = torch.zeros(sum(len(d) + 1 for d in layout), vocab)
    logits[:, eos] = 10.0  # EOS is every row's argmax, where allowed
    for j, tok in enumerate(layout[0]):
        logits[j, tok] = 5.0
    logits[4:6, 11] = 5.0  # request 1: its draft, then its bonus row
    rows, bonus = spec_step(procs, layout, logits)
    out = [len(o) for _, o in reqs]
    target = [(0, 0), (0, 1), (0, 2), (1, 0)]  # (request, j) of each target row
    for k, (i, j) in enumerate(target):
        assert torch.isfinite(rows[k][eos]) == (out[i] + j >= 4), (i, j)
    # Plain decoding's bonus tokens: EOS after 5 tokens, not after 3.
    assert bonus == [eos, 11], bonus


# ------------------------------------------------------------ grammar drafts
def test_grammar_forced_drafts_for_our_processor_requests(tokenizer):
    """A request with our processor's grammar is drafted from it: the forced
    text first, then the inner proposer's tokens, whose probability rows go
    (the draft was rewritten); a request without a grammar keeps the
    inner's draft and rows."""
    import numpy as np

    from tests.test_grammar_proposer import FixedInner
    from vllm_plugins.proposers.grammar import GrammarProposer
    from vllm_plugins.step_context import Drafts, RequestStep, StepContext

    ours = params(extra_args={"grammar": {"regex": "The answer is [0-9]+"}})
    inner = FixedInner()
    p = GrammarProposer(None, options={}, vocab_size=49152, tokenizer=tokenizer)
    p.max_draft, p.inner = 6, inner
    prompt = toks(tokenizer, "JSON:")
    out = toks(tokenizer, "The")
    rows = np.full((3, 8), 1.0 / 8, dtype=np.float32)

    def step(sp, rid):
        ctx = np.asarray(prompt + out, dtype=np.int64)
        return RequestStep(rid, np.asarray(out[-1:], np.int64), ctx, len(prompt), 0,
                           np.zeros(0, np.int64), None, None, 1.0, sp)

    inner.next = [[9, 9, 9], [9, 9, 9]]
    inner.draft = lambda ctx: Drafts([[9, 9, 9], [9, 9, 9]], [rows, rows])
    d = p.step(StepContext([step(ours, "g"), step(params(), "n")], finished=set(),
                           max_draft=6))
    assert tokenizer.decode(d.tokens[0]).startswith(" answer")
    assert p.metrics()["forced_tokens"] > 0 and p.metrics()["grammar_requests"] == 1
    assert d.probs[0] is None and d.probs[1] is rows
    assert d.tokens[1] == [9, 9, 9]
