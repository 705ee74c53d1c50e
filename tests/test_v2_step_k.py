"""The step's k on Model Runner V2, with stand-in tensors (no engine).

V2's scheduler may pick the step's k from the batch size (vLLM's
``num_speculative_tokens_per_batch_size``) and hands it to the drafter's
``propose`` as ``num_speculative_tokens``; next step it verifies only that
many drafts a request. The host route makes it the step's ``max_draft``:
controllers choose within it, the proposer drafts and records no more, and
what it learns next step counts only the drafts V2 verified.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_plugins.bridge.v2.speculator import PluginSpeculator
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.step_context import Drafts

K = 4          # the engine's num_speculative_tokens
SLOT = 3       # request 'a''s row in V2's RequestState
VOCAB = 50


class Counting(PluginProposer):
    """Drafts the next integers after the last token, as many as its budget
    allows (``greedy``: always K, whatever the budget); records every
    step's context, what it was told it sent, and its controller's kept
    lengths so far."""

    DEFAULT_NUM_SPECULATIVE_TOKENS = K

    def __init__(self, draft_length="fixed", greedy=False):
        super().__init__(options={"draft_length": draft_length})
        self.vocab_size = VOCAB
        self.greedy = greedy
        self.contexts, self.sent, self.kept, self.drafted = [], [], [], []

    def draft(self, ctx):
        self.contexts.append(ctx)
        tokens = [[] for _ in ctx.requests]
        for i, r, budget in self.drafting_requests(ctx):
            n = K if self.greedy else budget
            tokens[i] = [int(r.context[-1]) + 1 + j for j in range(n)]
        self.drafted.append([len(t) for t in tokens])
        return Drafts(tokens)

    def proposed(self, ctx, drafts):
        self.sent.append([list(t) for t in drafts.tokens])
        if self.controller is not None:
            self.kept.append(self.controller.stats()["k_histogram"])


class Overlong(Counting):
    """Another package's proposer that overrides ``step`` and drafts K
    tokens whatever the context says."""

    def step(self, ctx):
        self.contexts.append(ctx)
        return Drafts([[int(r.context[-1]) + 1 + j for j in range(K)] for r in ctx.requests])


def speculator(proposer):
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                             scheduler_config=SimpleNamespace(max_num_seqs=8))
    width = 16
    req_states = SimpleNamespace(
        total_len=SimpleNamespace(gpu=torch.zeros(8, dtype=torch.int64)),
        all_token_ids=SimpleNamespace(gpu=torch.zeros(8, width, dtype=torch.int64)),
        prompt_len=SimpleNamespace(np=np.zeros(8, dtype=np.int64)),
        req_id_to_index={"a": SLOT})
    return PluginSpeculator(config, "cpu", req_states, proposer)


def run_step(spec, tokens, prompt_len, verified_inputs, num_sampled, step_k):
    """One V2 step of request 'a': its tokens after the step, the step's
    verified inputs (the token before the drafts, then the drafts), and
    how many tokens it emitted; returns the ``[1, K]`` drafts."""
    rs = spec.req_states
    rs.total_len.gpu[SLOT] = len(tokens)
    rs.all_token_ids.gpu[SLOT, :len(tokens)] = torch.tensor(tokens)
    rs.prompt_len.np[SLOT] = prompt_len
    n = len(verified_inputs)
    batch = SimpleNamespace(
        num_reqs=1, req_ids=["a"], idx_mapping_np=np.array([SLOT]),
        cu_num_logits_np=np.array([0, n]), input_ids=torch.tensor(verified_inputs),
        logits_indices=torch.arange(n), num_tokens=n)
    out = spec.propose(batch, None, None, None, None,
                       torch.tensor([num_sampled], dtype=torch.int32), None, None, None,
                       None, None, num_speculative_tokens=step_k)
    assert out.shape == (1, K) and out.dtype == torch.int64
    return out[0].tolist()


def prefill_then_verify(proposer, step_k):
    """Step 1: the prompt [1, 2, 3]'s prefill emits 4, drafted under
    ``step_k``. Step 2: V2 verified ``step_k`` of those drafts (5, 6, ...),
    all accepted, and sampled the next: drafted at the engine's k."""
    spec = speculator(proposer)
    first = run_step(spec, [1, 2, 3, 4], 3, [3], 1, step_k)
    kept = list(range(5, 5 + step_k))
    tokens = [1, 2, 3, 4, *kept, 5 + step_k]
    second = run_step(spec, tokens, 3, [4, *kept], step_k + 1, None)
    return first, second


@pytest.mark.parametrize("policy", ["fixed", "acceptance"])
def test_the_steps_k_bounds_what_is_drafted_and_recorded(policy):
    proposer = Counting(policy)
    first, second = prefill_then_verify(proposer, step_k=2)
    one, two = proposer.contexts
    assert one.max_draft == 2 and two.max_draft == K
    # V2 verifies the first two; the rest of the row is padding.
    assert first[:2] == [5, 6] and first[2:] == [6, 6]
    # The proposer (and the controller) sent, and remember sending, two.
    assert proposer.sent[0] == [[5, 6]]
    if proposer.controller is not None:
        assert proposer.kept[0] == [0, 0, 1, 0, 0]
    # What it learns next step: the two V2 verified, both accepted.
    a = two.requests[0]
    assert a.num_draft == 2 and list(a.accepted) == [5, 6, 7]
    assert second == [8, 9, 10, 11]


def test_a_proposer_that_ignores_its_budget_is_cut_to_the_steps_k():
    proposer = Counting(greedy=True)
    first, _ = prefill_then_verify(proposer, step_k=1)
    assert proposer.sent[0] == [[5]] and first == [5, 5, 5, 5]


def test_a_proposer_with_its_own_step_sends_no_more_than_the_steps_k():
    proposer = Overlong()
    first, second = prefill_then_verify(proposer, step_k=2)
    assert first == [5, 6, 6, 6]
    assert proposer.contexts[1].requests[0].num_draft == 2
    assert second == [8, 9, 10, 11]


def test_a_step_k_of_zero_drafts_nothing_and_the_request_still_learns():
    proposer = Counting("acceptance")
    first, second = prefill_then_verify(proposer, step_k=0)
    assert proposer.sent[0] == [[]] and first == [4, 4, 4, 4]
    a = proposer.contexts[1].requests[0]
    assert a.num_draft == 0 and list(a.accepted) == [5]
    assert second[0] == 6  # drafting again at the engine's k


def test_without_a_step_k_the_engines_k_holds():
    proposer = Counting()
    first, _ = prefill_then_verify(proposer, step_k=K)
    assert proposer.contexts[0].max_draft == K and first == [5, 6, 7, 8]
    spec = speculator(Counting())
    assert run_step(spec, [1, 2, 3, 4], 3, [3], 1, None) == [5, 6, 7, 8]


def test_goodput_drafts_past_the_steps_k_sends_it_and_chooses_the_next():
    """With ``goodput`` the controller chooses the next step's k: the
    proposer drafts past this step's k (the choice weighs those drafts),
    sends and records this step's k, and the drafter reports a k for V2's
    scheduler (``bridge.v2.step_k``)."""
    proposer = Counting("goodput")
    spec = speculator(proposer)
    assert spec.step_k_report() is None   # nothing chosen yet
    first = run_step(spec, [1, 2, 3, 4], 3, [3], 1, 1)
    ctx = proposer.contexts[0]
    assert ctx.steers_step_k and ctx.max_draft == 1
    assert proposer.drafted[0][0] > 1
    assert proposer.sent[0] == [[5]] and first == [5, 5, 5, 5]
    assert 0 <= spec.step_k_report()["k"] <= K
    spec.steers_step_k = False   # as under data parallelism
    assert spec.step_k_report() is None
