"""Our state on a vLLM model runner: one typed object, one attribute.

A runner carries a ``RunnerState`` only when its drafter is one of our
proposers, or when a benchmark asked it to count steps
(``WorkerBase.vllm_plugins_count_steps``). Every other runner carries
nothing of ours, and our wrappers return to vLLM's code at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# The one attribute we set on a runner.
ATTR = "_vllm_plugins_state"


@dataclass
class TopkStash:
    """The target's top-k at every verified row of one step, taken in
    ``_sample`` and read by the next ``propose_draft_token_ids``."""

    num_draft: list[int]  # per request, in batch order
    draft_ids: np.ndarray | None  # the step's drafts, flat, batch order
    ids: np.ndarray | None  # [rows, k] token ids, None when k == 0
    logprobs: np.ndarray | None  # [rows, k]
    seconds: float  # spent extracting them (0 when k == 0)


@dataclass
class StepCounters:
    """Drafted / accepted totals over the engine's life (for benchmarks)."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    tokens: int = 0
    # Tree verification: steps with a tree request, those of tree requests
    # only (vLLM's sampler skipped), tree requests verified, and accepted
    # nodes whose K/V moved to a chain slot.
    tree_steps: int = 0
    tree_only_steps: int = 0
    tree_requests: int = 0
    kv_moved: int = 0
    # Request drafts dropped because they broke the draft layout
    # (vllm_plugins.tree.checked): a proposer bug, never the engine's end.
    malformed_drafts: int = 0
    # Request drafts dropped because tensor-parallel ranks drafted them
    # differently (bridge/v1/step.py:agree_across_ranks).
    rank_disagreements: int = 0

    def count(self, sampled_token_ids, num_draft: list[int] | None) -> None:
        self.steps += 1
        if not isinstance(sampled_token_ids, list):
            return
        for i, toks in enumerate(sampled_token_ids):
            self.tokens += len(toks)
            if num_draft is not None and i < len(num_draft) and toks:
                self.drafted += num_draft[i]
                self.accepted += len(toks) - 1

    def as_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted,
                "accepted": self.accepted, "tokens": self.tokens,
                "tree_steps": self.tree_steps, "tree_only_steps": self.tree_only_steps,
                "tree_requests": self.tree_requests, "kv_moved": self.kv_moved,
                "malformed_drafts": self.malformed_drafts,
                "rank_disagreements": self.rank_disagreements}


@dataclass
class RunnerState:
    # Our proposer, or None on a runner that only counts steps.
    proposer: object = None
    counters: StepCounters = field(default_factory=StepCounters)
    # perf_counter() at the start of the current execute_model.
    step_start: float | None = None
    # perf_counter() when our last proposal returned, and the engine's time
    # from there to the next execute_model (scheduling, output handling).
    propose_end: float | None = None
    gap_seconds: float | None = None
    # Seconds our proposer's last step took (the next context's
    # last_propose_seconds): the engine waits for it too.
    propose_seconds: float | None = None
    # Finished request ids seen since the last proposal: a step that
    # schedules no tokens returns before drafting.
    finished: set[str] = field(default_factory=set)
    topk: TopkStash | None = None
    # ranks.RankDigest once a test asks for per-step digests (opt-in).
    digest: object = None
    # Tree drafts (bridge/v1/tree_step.py): the trees handed to vLLM by request
    # id, the step verifying some of them (from _prepare_inputs to _sample),
    # and why this runner cannot verify trees (None when it can).
    trees: dict = field(default_factory=dict)
    tree_step: object = None
    tree_refusal: str | None = None
    tree_layout_checked: bool = False
    # Whether this runner carries the tree route (bridge/v1/runner.py:
    # route_trees), put there at its first tree; the attention route held
    # ready for its attention layers (patching.Held, on during a tree step's
    # forward only); and each layer's cache views, by id of its K/V cache
    # (bridge/v1/tree_step.py:cache_views_of: the tensor lives as long as
    # the engine).
    trees_routed: bool = False
    tree_attention: object = None
    cache_views: dict = field(default_factory=dict)
    # Whether a malformed draft of this runner's proposer was logged, and a
    # draft the tensor-parallel ranks disagreed on.
    malformed_logged: bool = False
    rank_disagreement_logged: bool = False
    # Each running request's parsed extra_args["speculation"] (None
    # without one), parsed at its first step, dropped when it finishes.
    speculation: dict = field(default_factory=dict)
    # Our counters' totals at their last report to vLLM's stats
    # (bridge/counters.py: each report carries what grew since).
    counters_reported: dict = field(default_factory=dict)


def state_of(runner) -> RunnerState | None:
    return runner.__dict__.get(ATTR)


def attach(runner, proposer=None) -> RunnerState:
    state = state_of(runner)
    if state is None:
        state = RunnerState(proposer=proposer)
        setattr(runner, ATTR, state)
    elif proposer is not None:
        state.proposer = proposer
    return state
