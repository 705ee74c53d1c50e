"""Malformed drafts from a proposer cost that request's draft, never the engine.

A proposer registered from another package may hand the bridge drafts that
break the layout (``vllm_plugins.tree.checked``): parent lists of the wrong
length, parents after their children, token ids outside the vocabulary (in
trees and in chains). The bridge drops such a request's draft, keeps every
other request's, logs once per proposer and counts each one.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_bridge_step import stand_in_runner
from vllm_plugins.bridge.state import attach
from vllm_plugins.bridge.v1 import step
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.step_context import Drafts
from vllm_plugins.tree.checked import draft_problem, drop_malformed

VOCAB = 50  # tests.test_bridge_step.stand_in_runner's vocabulary
GOOD_TREE = ([5, 6, 7, 8], [-1, 0, 0, 2])

# name -> (tokens, parents) of request 'a'; request 'b' drafts nothing (prefill)
MALFORMED = {
    "parents-shorter": ([5, 6, 7, 8], [-1, -1]),
    "parents-longer": ([5, 6], [-1, 0, 0, 1]),
    "parent-after-child": ([5, 6, 7, 8], [-1, 0, 3, 1]),
    "parent-is-itself": ([5, 6, 7], [-1, 1, 0]),
    "parent-below-root": ([5, 6, 7], [-1, -2, 0]),
    "tree-token-over-vocab": ([5, VOCAB, 7], [-1, 0, 0]),
    "chain-token-over-vocab": ([5, 6, VOCAB + 10], None),
    "chain-token-negative": ([5, -3], None),
    "chain-token-not-int": ([5, 6.5], None),
    "chain-token-huge": ([5, 10**30], None),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_each_malformed_shape_is_named(name):
    tokens, parents = MALFORMED[name]
    assert draft_problem(tokens, parents, VOCAB), name
    out, bad = drop_malformed(Drafts([tokens, [1, 2]], None, None, [parents, None]),
                              ["a", "b"], VOCAB)
    assert out.tokens == [[], [1, 2]] and [r for r, _ in bad] == ["a"]


def test_well_formed_drafts_pass_untouched():
    assert draft_problem(*GOOD_TREE, VOCAB) is None
    assert draft_problem(np.array([0, VOCAB - 1]), None, VOCAB) is None
    assert draft_problem(np.array([1, 2]), np.array([-1, 0]), VOCAB) is None
    assert draft_problem([], [], VOCAB) is None
    drafts = Drafts([GOOD_TREE[0], [1]], None, None, [GOOD_TREE[1], None])
    out, bad = drop_malformed(drafts, ["a", "b"], VOCAB)
    assert out is drafts and bad == []


def test_rows_that_do_not_match_the_batch_draft_nothing():
    out, bad = drop_malformed(Drafts([[1, 2]]), ["a", "b"], VOCAB)
    assert out.tokens == [[], []] and len(bad) == 2
    out, bad = drop_malformed(Drafts([[1], [2]], None, None, [[-1]]), ["a", "b"], VOCAB)
    assert out.tokens == [[], []] and len(bad) == 2


class Malformed(PluginProposer):
    """Another package's proposer that overrides ``step`` itself (so the
    base's error handling never sees its drafts) and returns ``self.next``."""

    def __init__(self):
        super().__init__(options={})
        self.next = None

    def step(self, ctx):
        tokens, parents = self.next
        probs = [np.full((len(tokens), VOCAB), 1.0 / VOCAB, dtype=np.float32), None]
        return Drafts([list(tokens), []], probs, None, [parents, None])


def stand_in(proposer):
    runner = stand_in_runner(proposer)
    runner.get_model = lambda: torch.nn.Identity()
    runner.input_batch.block_table = SimpleNamespace(block_tables=[object()])
    state = attach(runner, proposer)
    return runner, state


def propose(runner, state):
    return step.propose(runner, state, SimpleNamespace(finished_req_ids=set(),
                                                       total_num_scheduled_tokens=4),
                        [[7, 9], []])


def test_the_bridge_drops_each_malformed_draft_logs_once_and_counts(caplog):
    proposer = Malformed()
    runner, state = stand_in(proposer)
    caplog.set_level(logging.ERROR, logger="vllm_plugins")
    for n, name in enumerate(MALFORMED, start=1):
        proposer.next = MALFORMED[name]
        assert propose(runner, state) == [[], []], name
        assert state.counters.malformed_drafts == n
        assert name not in state.trees and "a" not in state.trees
        # vLLM's draft probability rows hold nothing for the dropped draft.
        assert not isinstance(getattr(runner, "_draft_probs", None), step.DraftProbRows) \
            or runner._draft_probs.tokens[0] == []
    logged = [r for r in caplog.records if "malformed draft" in r.getMessage()]
    assert len(logged) == 1 and "Malformed" in logged[0].getMessage()
    assert state.counters.as_dict()["malformed_drafts"] == len(MALFORMED)
    # A well-formed tree after all that is kept for verification.
    proposer.next = GOOD_TREE
    assert propose(runner, state) == [GOOD_TREE[0], []]
    assert state.trees["a"].parents == GOOD_TREE[1]
    assert state.counters.malformed_drafts == len(MALFORMED)


def uniform_rows(n, vocab=VOCAB):
    return np.full((n, vocab), 1.0 / vocab, dtype=np.float32)


def rows_with(change):
    rows = uniform_rows(3)
    change(rows)
    return rows


TOKENS = [5, 6, 7]
# name -> (tokens, probability rows) of request 'a', a chain
MALFORMED_ROWS = {
    "fewer-rows": (TOKENS, uniform_rows(2)),
    "more-rows": (TOKENS, uniform_rows(4)),
    "narrower-rows": (TOKENS, uniform_rows(3, VOCAB - 1)),
    "one-row": (TOKENS, uniform_rows(1)[0]),
    "not-finite": (TOKENS, rows_with(lambda r: r.__setitem__((1, 0), np.nan))),
    "infinite": (TOKENS, rows_with(lambda r: r.__setitem__((2, 3), np.inf))),
    "sums-to-two": (TOKENS, rows_with(lambda r: r.__imul__(2))),
    "negative-entry": (TOKENS, rows_with(lambda r: (r.__setitem__((0, 0), -0.5),
                                                    r.__setitem__((0, 1), 0.5 + 1 / VOCAB)))),
    "drafted-token-impossible": (TOKENS, rows_with(lambda r: (
        r.__setitem__((1, 6), 0.0), r.__setitem__((1, 0), 2.0 / VOCAB)))),
    "integer-rows": (TOKENS, np.eye(VOCAB, dtype=np.int64)[TOKENS]),
    "longer-than-num_speculative_tokens": (list(range(1, 7)), uniform_rows(6)),
}


class RowsProposer(PluginProposer):
    """Another package's proposer with probability rows of its own making;
    num_speculative_tokens 5."""

    DEFAULT_NUM_SPECULATIVE_TOKENS = 5

    def __init__(self):
        super().__init__(options={})
        self.next = None

    def step(self, ctx):
        tokens, rows = self.next
        return Drafts([list(tokens), [1]], [rows, None])


def test_probability_rows_that_are_not_one_distribution_per_token_drop_that_draft():
    proposer = RowsProposer()
    runner, state = stand_in(proposer)
    for n, name in enumerate(MALFORMED_ROWS, start=1):
        tokens, rows = MALFORMED_ROWS[name]
        assert draft_problem(tokens, None, VOCAB, rows, 5), name
        proposer.next = tokens, rows
        # request b's draft (deterministic) is kept
        assert propose(runner, state) == [[], [1]], name
        assert state.counters.malformed_drafts == n, name
        # nothing of the dropped rows reaches vLLM's rejection sampler
        assert not isinstance(getattr(runner, "_draft_probs", None), step.DraftProbRows), name
    proposer.next = TOKENS, uniform_rows(3)
    assert propose(runner, state) == [TOKENS, [1]]
    assert runner._draft_probs[0, slice(0, 3)].shape == (3, VOCAB)
    # a step whose rows do not give one entry per request drafts nothing
    out, bad = drop_malformed(Drafts([[1], [2]], [None]), ["a", "b"], VOCAB)
    assert out.tokens == [[], []] and len(bad) == 2


def test_lists_and_arrays_are_judged_alike():
    """Lists of plain ints take a shortcut of Python's builtins; arrays take
    the full check. Both agree on every draft, well formed or not."""
    rng = np.random.default_rng(0)
    judged = {True: 0, False: 0}
    for _ in range(2000):
        n = int(rng.integers(0, 8))
        tokens = rng.integers(-2, VOCAB + 2, n).tolist()
        parents = None
        if rng.random() < 0.7:
            # Mostly valid: each node's parent one of the earlier nodes or the root.
            parents = [int(rng.integers(-1, k)) if k else -1 for k in range(n)]
            if n and rng.random() < 0.3:
                parents[int(rng.integers(0, n))] = int(rng.integers(-3, n + 2))
            if rng.random() < 0.05:
                parents = parents[:-1]
        as_arrays = (np.array(tokens, np.int64),
                     None if parents is None else np.array(parents, np.int64))
        got = draft_problem(tokens, parents, VOCAB, max_draft=6)
        want = draft_problem(*as_arrays, VOCAB, max_draft=6)
        assert (got is None) == (want is None), (tokens, parents, got, want)
        judged[got is None] += 1
    assert min(judged.values()) > 200   # both verdicts were tried
