"""The target's top-k after our grammar's mask, without an engine.

vLLM's structured output masks logits before the bridge takes the top-k
that Token Recycling learns from; our processor masks inside the sampler.
The processor records each masked row's top-k (``grammar_topk``), the
bridge hands the recording over in the step's context and the grammar
proposer gives it to its inner proposer for the processor's requests. The reference is plain decoding's row at each position (a
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
from vllm_plugins.logits_processors.grammar_topk import MaskedTopk
from vllm_plugins.topk import topk_logprobs

K = 8


def recording(procs, k: int = K) -> MaskedTopk:
    """The grammar processor's recorder, asked for ``k`` ids a row as the
    bridge asks it for a drafter that learns them."""
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    proc.masked_topk.want(k)
    return proc.masked_topk


def reference(spec_config, sp, output, draft, rows):
    """Plain decoding's top-k at each position: row j after draft[:j]."""
    plain = torch.stack([plain_row(spec_config, sp, output + draft[:j], rows[j])
                         for j in range(len(draft) + 1)])
    lps, ids = topk_logprobs(plain, K)
    return ids.numpy(), lps.numpy()


def test_each_verified_row_records_plain_decodings_top_k(spec_config, tokenizer):
    """Target rows and the bonus row, for a grammar request beside one
    without a grammar: the grammar request's recording is the top-k of
    plain decoding's masked row at each position; the other is not recorded."""
    out = toks(tokenizer, "ab")
    draft = toks(tokenizer, "cdab 12")
    g = grammar_params()
    procs = built(spec_config, [(g, list(out)), (params(), [5])])
    recorder = recording(procs)
    layout = [draft, [11, 12]]
    vocab = spec_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(sum(len(d) + 1 for d in layout), vocab, generator=gen)
    spec_step(procs, layout, logits)
    masked = recorder.take()
    assert recorder.take().rows == {}  # taken once
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


def test_plain_step_records_its_row(spec_config, tokenizer):
    """A step without drafts (the plain sampler): row i is request i's only row."""
    out = toks(tokenizer, "ab")
    g = grammar_params()
    procs = built(spec_config, [(params(), [5]), (g, list(out))])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    recorder = recording(procs)
    vocab = spec_config.model_config.get_vocab_size()
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(4))
    proc.apply(logits.clone())
    got = recorder.take().for_request(1, np.asarray(out[-1:]), K)
    ids, lps = reference(spec_config, g, out, [], logits[1:])
    np.testing.assert_array_equal(got[0], ids)


def test_off_unless_asked(spec_config, tokenizer):
    """No drafter asked (k = 0): nothing is recorded (other engines pay nothing)."""
    procs = built(spec_config, [(grammar_params(), [])])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    proc.apply(torch.zeros(1, spec_config.model_config.get_vocab_size()))
    assert proc.masked_topk.take().rows == {}


def test_the_bridge_hands_the_recording_to_a_drafter_that_learns_it(spec_config, tokenizer):
    """``take_masked_topk``: the drafter's k asked of the runner's grammar
    processor, its recording taken for the step's context; a drafter that
    learns none gets None and asks nothing."""
    from types import SimpleNamespace

    from vllm_plugins.bridge.v1.step import take_masked_topk

    procs = built(spec_config, [(params(), [5]), (grammar_params(), list(toks(tokenizer, "ab")))])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    runner = SimpleNamespace(input_batch=SimpleNamespace(logitsprocs=procs))
    plain = SimpleNamespace(masked_topk_wanted=lambda: 0)
    learner = SimpleNamespace(masked_topk_wanted=lambda: K)
    assert take_masked_topk(runner, plain) is None and proc.masked_topk.k == 0
    assert take_masked_topk(runner, learner) is None  # asked now: records from here on
    assert proc.masked_topk.k == K
    proc.apply(torch.randn(2, spec_config.model_config.get_vocab_size()))
    taken = take_masked_topk(runner, learner)
    assert set(taken.rows) == {(1, 0)}  # the grammar request's row alone


def test_grammar_proposer_gives_its_inner_the_masked_top_k(tokenizer):
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
    assert p.masked_topk_wanted() == K
    recorder = MaskedTopk()
    recorder.want(K)
    recorder.bonus_rows([list(draft), list(draft)])
    recorder.target_rows([1, 1], [list(draft), list(draft)])
    recorder.record(logits, [0, 1])  # target rows of requests 0 and 1
    recorder.bonus_rows([list(draft), list(draft)])
    recorder.record(logits, [0, 1])  # bonus rows
    recorder.plain_rows()
    p.step(StepContext([step(ours, "g"), step(params(), "n")], finished=set(), max_draft=6,
                       masked_topk=recorder.take()))
    ids, lps = seen["g"]
    assert ids.shape == (2, K) and (ids[:, 0] == 100).all() and (lps[:, 0] == 0).all()
    assert seen["n"][0] is raw_ids
    assert p.metrics()["masked_topk_rows"] == 2
