"""What a draft source is: one kind of evidence about what comes next.

A source answers, for one request and one step, which continuations it
would draft, as a small tree, and how likely each node is to be accepted.
The hybrid method (``vllm_plugins.proposers.hybrid``) merges the trees of
every source it runs into one trie, calibrates each source's estimates from
what verification showed, and lets the draft-length policy choose the nodes
to verify. A source never sees the other sources nor the policy: it
proposes, it may learn from each step, and it forgets finished requests.

The contract (``SourceTree``): nodes in topological order, ``parents[i] <
i`` (-1: a child of the root, the request's last committed token), and
``confidence[i]`` the source's estimate of P(node i accepted | its parent
accepted), in [0, 1]. A source may return fewer nodes than ``budget``, or
none; it must not return more. Exactness does not depend on any of this:
every drafted token is verified by the target, so a source can only cost
speed, never change output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from vllm_plugins.options import Option
from vllm_plugins.proposers.jit import cached_njit

if TYPE_CHECKING:
    from vllm_plugins.step_context import Drafts, RequestStep, StepContext


@dataclass
class SourceTree:
    """A source's candidates for one request and one step."""

    tokens: np.ndarray      # int64 token ids
    parents: np.ndarray     # int64, parents[i] < i, -1 for the root's children
    confidence: np.ndarray  # float64, conditional acceptance estimate per node

    def __len__(self) -> int:
        return len(self.tokens)

    @staticmethod
    def empty() -> "SourceTree":
        return SourceTree(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0))

    @staticmethod
    def chain(tokens, confidence) -> "SourceTree":
        """A single path: each node the child of the one before."""
        tokens = np.asarray(tokens, np.int64)
        return SourceTree(tokens, np.arange(-1, len(tokens) - 1, dtype=np.int64),
                          np.asarray(confidence, np.float64))

    def check(self, budget: int) -> "SourceTree":
        """This tree if it keeps the contract, else ValueError saying which
        rule it breaks (the hybrid then drops this source's candidates for
        the step)."""
        n = len(self.tokens)
        par = np.ascontiguousarray(self.parents, np.int64)
        conf = np.ascontiguousarray(self.confidence, np.float64)
        if len(par) != n or len(conf) != n:
            raise ValueError(f"tokens, parents and confidence differ in length "
                             f"({n}, {len(par)}, {len(conf)})")
        if n > budget:
            raise ValueError(f"{n} nodes for a budget of {budget}")
        bad = valid_tree(par, conf)
        if bad == 1:
            raise ValueError("a node's parent is not an earlier node or -1")
        if bad == 2:
            raise ValueError("a confidence outside [0, 1]")
        return SourceTree(np.ascontiguousarray(self.tokens, np.int64), par, conf)


@cached_njit
def valid_tree(parents, confidence):
    """0 when every parent is an earlier node or -1 and every confidence is
    in [0, 1]; 1 for a bad parent, 2 for a bad confidence."""
    for i in range(len(parents)):
        if parents[i] < -1 or parents[i] >= i:
            return 1
        if not (confidence[i] >= 0.0 and confidence[i] <= 1.0):
            return 2
    return 0


class DraftSource:
    """Base of every draft source (built in or from another package).

    Subclasses set ``name`` and may declare ``OPTIONS`` (validated like a
    method's, given under ``"source_options": {name: {...}}``) and ``TOPK``
    (how many of the target's top-k per verified row they learn from).
    They override ``propose``, and where they keep state ``learn``,
    ``sent`` and ``free``."""

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    TOPK: ClassVar[int] = 0

    def __init__(self, options: dict[str, Any], vocab_size: int | None, max_draft: int):
        self.options = options
        self.vocab_size = vocab_size
        self.max_draft = max_draft

    def load(self) -> None:
        """Called once at the engine's ``load_model``: compile, warm up."""

    def learn(self, ctx: StepContext) -> None:
        """Called once per step, before any ``propose``, with the step's
        verified rows (and the target's top-k where ``TOPK`` asks)."""

    def propose(self, request: RequestStep, budget: int) -> SourceTree:
        """Up to ``budget`` nodes after ``request.context``."""
        raise NotImplementedError

    def sent(self, ctx: StepContext, drafts: Drafts) -> None:
        """The drafts this step hands vLLM (the merged tree, or the subset
        the policy kept, re-laid; a chain where ``parents`` is None). The
        next step's verified rows are these nodes."""

    def free(self, req_id: str) -> None:
        """Drop the state of a finished or aborted request."""
