"""The target's top-k after our grammar's mask, without an engine.

vLLM's structured output masks logits before the bridge takes the top-k
that Token Recycling learns from; our processor masks inside the sampler.
The processor records each masked row's top-k (``grammar_topk``) and the
grammar proposer hands it to its inner proposer for the processor's
requests. The reference is plain decoding's row at each position (a
second processor fed the drafts as committed output), top-k'd.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_processors_speculation import (  # noqa: F401  (module fixtures)
    built, grammar_params, model_path, params, plain_row, spec_config, spec_step,
    tokenizer, toks, vllm_config)
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor
from vllm_plugins.logits_processors.grammar_topk import MASKED_TOPK
from vllm_plugins.topk import topk_logprobs

K = 8


@pytest.fixture
def recording():
    """The process's recorder on, as a drafter that learns top-k turns it on."""
    before = MASKED_TOPK.k
    MASKED_TOPK.take()
    MASKED_TOPK.want(K)
    yield MASKED_TOPK
    MASKED_TOPK.k = before
    MASKED_TOPK.take()


def reference(spec_config, sp, output, draft, rows):
    """Plain decoding's top-k at each position: row j after draft[:j]."""
    plain = torch.stack([plain_row(spec_config, sp, output + draft[:j], rows[j])
                         for j in range(len(draft) + 1)])
    lps, ids = topk_logprobs(plain, K)
    return ids.numpy(), lps.numpy()


def test_each_verified_row_records_plain_decodings_top_k(spec_config, tokenizer, recording):
    """Target rows and the bonus row, for a grammar request beside one
    without a grammar: the grammar request's recording is the top-k of
    plain decoding's masked row at each position; the other is not recorded."""
    out = toks(tokenizer, "ab")
    draft = toks(tokenizer, "cdab 12")
    g = grammar_params()
    procs = built(spec_config, [(g, list(out)), (params(), [5])])
    layout = [draft, [11, 12]]
    vocab = spec_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(len(d) + 1 for d in layout), vocab, generator=gen)
    spec_step(procs, layout, logits)
    masked = recording.take()
    assert recording.take().rows == {}  # taken once
    verified = np.asarray([out[-1], *draft], np.int64)
    got = masked.for_request(0, verified, K)
    assert got is not None
    ids, lps = reference(spec_config, g, out, draft, logits[:len(draft) + 1])
    np.testing.assert_array_equal(got[0][:, 0], ids[:, 0])
    np.testing.assert_allclose(got[1], lps, rtol=1e-5, atol=1e-5)
    # The test can fail: the raw rows' top-k is another one.
    raw_lps, raw_ids = topk_logprobs(logits[:len(draft) + 1], K)
    assert not np.array_equal(raw_ids.numpy()[:, 0], ids[:, 0])
    # Only the grammar request's rows; only for the drafts they followed.
    assert masked.for_request(1, np.asarray([5, 11, 12]), K) is None
    assert masked.for_request(0, np.asarray([out[-1], *draft[:-1], 7]), K) is None
    assert masked.for_request(0, verified, K + 1) is None


def test_plain_step_records_its_row(spec_config, tokenizer, recording):
    """A step without drafts (the plain sampler): row i is request i's only row."""
    out = toks(tokenizer, "ab")
    g = grammar_params()
    procs = built(spec_config, [(params(), [5]), (g, list(out))])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    vocab = spec_config.model_config.get_vocab_size()
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    proc.apply(logits.clone())
    got = recording.take().for_request(1, np.asarray(out[-1:]), K)
    ids, lps = reference(spec_config, g, out, [], logits[1:])
    np.testing.assert_array_equal(got[0], ids)


def test_off_unless_asked(spec_config, tokenizer):
    """No drafter asked (k = 0): nothing is recorded (other engines pay nothing)."""
    before, MASKED_TOPK.k = MASKED_TOPK.k, 0
    try:
        procs = built(spec_config, [(grammar_params(), [])])
        (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
        proc.apply(torch.zeros(1, spec_config.model_config.get_vocab_size()))
        assert MASKED_TOPK.take().rows == {}
    finally:
        MASKED_TOPK.k = before


def test_grammar_proposer_gives_its_inner_the_masked_top_k(tokenizer, recording):
    """The inner proposer learns the masked top-k for our processor's
    requests and the raw one for others (vLLM's structured outputs are
    masked before the bridge's top-k already)."""
    from tests.test_grammar_proposer import FixedInner
    from vllm_plugins.proposers.grammar import GrammarProposer
    from vllm_plugins.step_context import RequestStep, StepContext

    ours = params(extra_args={"grammar": {"regex": "The answer is [0-9]+"}})
    inner = FixedInner()
    inner.TOPK = K
    seen = {}
    inner.draft = lambda ctx: (seen.update({r.req_id: (r.topk_ids, r.topk_logprobs)
                                            for r in ctx.requests}),
                               FixedInner.draft(inner, ctx))[1]
    p = GrammarProposer(None, options={}, vocab_size=49152, tokenizer=tokenizer)
    p.max_draft, p.inner = 6, inner
    prompt = toks(tokenizer, "JSON:")
    out = toks(tokenizer, "The answer")
    draft = toks(tokenizer, " is")
    raw_ids = np.arange(2 * K, dtype=np.int64).reshape(2, K)
    raw_lps = np.full((2, K), -2.0, np.float32)

    def step(sp, rid):
        ctx = np.asarray(prompt + out + draft, dtype=np.int64)
        return RequestStep(rid, np.asarray(draft, np.int64), ctx, len(prompt), len(draft),
                           np.asarray([out[-1], *draft], np.int64), raw_ids, raw_lps, 0.0, sp)

    # What the processor records for batch index 0 (ours) and 1 (no grammar).
    vocab = 49152
    logits = torch.full((2 * 2, vocab), float("-inf"))
    logits[:, 100] = 0.0
    MASKED_TOPK.bonus_rows([list(draft), list(draft)])
    MASKED_TOPK.target_rows([1, 1], [list(draft), list(draft)])
    MASKED_TOPK.record(logits, [0, 1])  # target rows of requests 0 and 1
    MASKED_TOPK.bonus_rows([list(draft), list(draft)])
    MASKED_TOPK.record(logits, [0, 1])  # bonus rows
    MASKED_TOPK.plain_rows()
    p.step(StepContext([step(ours, "g"), step(params(), "n")], finished=set(), max_draft=6))
    ids, lps = seen["g"]
    assert ids.shape == (2, K) and (ids[:, 0] == 100).all() and (lps[:, 0] == 0).all()
    assert seen["n"][0] is raw_ids
    assert p.metrics()["masked_topk_rows"] == 2
