"""Grammar-aligned (ASAp) requests that also use vLLM's own options, under
speculation, without an engine.

Plain decoding runs ``allowed_token_ids``, bad words and ``min_tokens``
before our grammar processor, so the row ASAp normalises (the probability
of a sampled token, the grammar's mass at a prefix) has them applied. Each
verified row of a speculative step must reach the processor the same way,
and a step must leave the trie that plain decoding committing the same
tokens leaves. vLLM's rejection sampler runs under the bridge
(tests/test_processors_speculation.py ``spec_step``); the reference is
plain decoding walked position by position, with the same rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.test_processors_speculation import (  # noqa: F401  (module fixtures)
    built, model_path, params, spec_config, spec_step, tokenizer, vllm_config)

pytest.importorskip("llguidance")

from vllm.v1.sample.logits_processor import BatchUpdate  # noqa: E402

from tests.test_asap import trie_state  # noqa: E402
from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402

DIGITS = r"[0-9]{1,3}"
EOS = 2  # params(): the engine's EOS
PROMPT = [1, 2]  # built(): every request's prompt


def aligned_params(tokenizer, **kw):
    return params(temperature=1.0, extra_args={"grammar": {"regex": DIGITS, "aligned": True}},
                  **kw)


def digit_ids(tokenizer):
    return [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]


def only_trie(proc):
    (trie,) = proc._asap._tries.values()
    return trie


def plain_trie(config, sp, rows, committed, vllm_masks):
    """Plain decoding of ``committed``, one position a step: row j gets
    ``vllm_masks(j, row)`` (vLLM's masks before the processors), then the
    grammar processor; the request then leaves the batch."""
    proc = GrammarLogitsProcessor(config, torch.device("cpu"), False)
    out: list[int] = []
    proc.update_state(BatchUpdate(1, [], [(0, sp, list(PROMPT), out)], []))
    for j, tok in enumerate(committed):
        proc.apply(vllm_masks(j, rows[j].clone())[None])
        out.append(tok)
        proc.update_state(None)
    proc.update_state(BatchUpdate(0, [0], [], []))
    return proc


def test_aligned_rows_see_allowed_tokens_bad_words_and_min_tokens_first(
        spec_config, tokenizer):
    """allowed_token_ids (a few digits and EOS), a banned digit and
    min_tokens=2: three drafted digits, all accepted, then EOS. The trie
    holds each digit's probability under the row plain decoding's
    processor sees, and the grammar's mass there."""
    digits = digit_ids(tokenizer)
    allowed = digits[:6] + [EOS]
    sp = aligned_params(tokenizer, min_tokens=2, allowed_token_ids=allowed,
                        bad_words=["0"])
    banned = digits[0]
    drafts = digits[1:4]
    committed = drafts + [EOS]
    vocab = spec_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(len(drafts) + 1, vocab, generator=gen) * 2
    rows[:, digits] += 4.0
    rows[:, EOS] += 3.0

    def vllm_masks(j, row):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[allowed] = True
        row[~keep] = float("-inf")
        row[banned] = float("-inf")
        if j < sp.min_tokens:
            row[EOS] = float("-inf")
        return row

    out: list[int] = []
    procs = built(spec_config, [(sp, out)])
    mask = torch.ones(1, vocab, dtype=torch.bool)  # vLLM's: True = masked
    mask[0, allowed] = False
    spec_step(procs, [drafts], rows.clone(), temperature=1.0,
              allowed_token_ids_mask=mask, bad_words_token_ids={0: [[banned]]},
              output_token_ids=[out])
    out.extend(committed)
    for p in procs.all:
        p.update_state(BatchUpdate(0, [0], [], []))
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    want = plain_trie(spec_config, sp, rows, committed, vllm_masks)
    got_state, want_state = trie_state(only_trie(proc)), trie_state(only_trie(want))
    assert tuple(drafts) in want_state  # the drafts are nodes: the check has teeth
    assert got_state == want_state


def test_a_sample_cut_by_max_model_len_inside_a_step_ends_there(spec_config, tokenizer):
    """max_model_len leaves room for two output tokens: a step that commits
    three drafts and a bonus token ends the sample after two, as plain
    decoding ends it (the runner's output list holds the rest)."""
    digits = digit_ids(tokenizer)
    config = copy.copy(spec_config)
    model_config = copy.copy(spec_config.model_config)
    model_config.max_model_len = len(PROMPT) + 2
    object.__setattr__(config, "model_config", model_config)
    sp = aligned_params(tokenizer, max_tokens=16)
    drafts = digits[1:4]
    committed = drafts + [EOS]
    vocab = spec_config.model_config.get_vocab_size()
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(len(drafts) + 1, vocab, generator=gen) * 2
    rows[:, digits] += 4.0

    out: list[int] = []
    procs = built(config, [(sp, out)])
    spec_step(procs, [drafts], rows.clone(), temperature=1.0)
    out.extend(committed)
    for p in procs.all:
        p.update_state(BatchUpdate(0, [0], [], []))
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    want = plain_trie(config, sp, rows, committed[:2], lambda j, row: row)
    got_state, want_state = trie_state(only_trie(proc)), trie_state(only_trie(want))
    # The sample's last token is not followed: no node for it, nor after it.
    assert tuple(drafts[:1]) in want_state and tuple(drafts[:2]) not in want_state
    assert got_state == want_state


def prefix_row(prefix, vocab, digits):
    """A fixed logits row for each prefix (the target, as a function of it)."""
    gen = torch.Generator().manual_seed(hash(tuple(prefix)) % (2**31))
    row = torch.randn(vocab, generator=gen) * 2
    row[digits] += 4.0
    return row


def trained(config, sp, vocab, digits, samples):
    """A processor whose trie learnt from plain decoding of ``samples``."""
    proc = GrammarLogitsProcessor(config, torch.device("cpu"), False)
    for sample in samples:
        out: list[int] = []
        proc.update_state(BatchUpdate(1, [], [(0, sp, list(PROMPT), out)], []))
        for tok in sample:
            proc.apply(prefix_row(out, vocab, digits)[None])
            out.append(tok)
            proc.update_state(None)
        proc.update_state(BatchUpdate(0, [0], [], []))
    return proc


@pytest.mark.parametrize("n_drafts", [2, 3])
def test_rows_after_a_fully_masked_drafted_row_are_not_reweighted(
        spec_config, tokenizer, n_drafts):
    """Bad words leave nothing after the first draft (the row after it is
    fully masked before the grammar): plain decoding's cursor leaves the
    trie there, so the rows after it get the grammar's mask and no weights,
    although the trie has children there (learnt without those bad words).
    The bonus row is sampled first, before the target rows are processed."""
    import math

    from tests.test_asap import same_rows

    digits = digit_ids(tokenizer)
    vocab = spec_config.model_config.get_vocab_size()
    d1, d2, d3, d4 = digits[1:5]
    allowed = digits[:6] + [EOS]
    sp = aligned_params(tokenizer, allowed_token_ids=allowed)
    base = trained(spec_config, sp, vocab, digits,
                   [[d1, d2, d3, EOS], [d1, d2, d4, EOS], [d1, d2, EOS], [d1, d3, EOS]])
    node = only_trie(base).root.children[d1].children[d2]
    assert node.children and any(c.log_efg < 0 for c in node.children.values())
    banned = [[d1, t] for t in allowed]  # after d1, nothing is left
    drafts = [d1, d2, d3][:n_drafts]
    rows = torch.stack([prefix_row(drafts[:j], vocab, digits)
                        for j in range(n_drafts + 1)])

    def vllm_masks(j, row):
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[allowed] = True
        row[~keep] = float("-inf")
        if j and drafts[j - 1] == d1:
            row[:] = float("-inf")
        return row

    # Plain decoding of the drafts with a copy of the trie, row by row.
    plain = GrammarLogitsProcessor(spec_config, torch.device("cpu"), False)
    plain._asap = copy.deepcopy(base._asap)
    out: list[int] = []
    plain.update_state(BatchUpdate(1, [], [(0, sp, list(PROMPT), out)], []))
    want = []
    for j in range(n_drafts + 1):
        want.append(plain.apply(vllm_masks(j, rows[j].clone())[None])[0])
        if j < n_drafts:
            out.append(drafts[j])
            plain.update_state(None)
    assert plain._reqs[0].asap.done  # the fully masked row ended the walk

    out = []
    procs = built(spec_config, [(sp, out)])
    (proc,) = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
    proc._asap = copy.deepcopy(base._asap)
    proc._reqs.clear()  # rebuilt on the copied tries
    proc.update_state(BatchUpdate(1, [], [(0, sp, list(PROMPT), out)], []))
    mask = torch.ones(1, vocab, dtype=torch.bool)
    mask[0, allowed] = False
    bonus: list[torch.Tensor] = []
    target, _ = spec_step(procs, [drafts], rows.clone(), temperature=1.0, bonus_rows=bonus,
                          allowed_token_ids_mask=mask, bad_words_token_ids={0: banned},
                          output_token_ids=[out])
    got = list(target) + [bonus[0][0]]
    for j in range(n_drafts + 1):
        if j == 1:
            assert not torch.isfinite(got[j]).any()  # the fully masked row
            continue
        assert same_rows(got[j], want[j]), j
    # The check has teeth: with weights, the row after d1, d2 would differ.
    weights = [math.exp(c.log_efg) for c in node.children.values()]
    assert min(weights) < 0.999, weights
