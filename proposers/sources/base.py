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

    def conformed(self) -> "SourceTree":
        """This tree as the merge reads it (1-D int64 tokens and parents,
        float64 confidence, one length), else ValueError saying what is
        wrong. The per-node rules (parents, confidence and token ranges)
        are the merge's (``valid_tree``)."""
        tok, par, conf = self.tokens, self.parents, self.confidence
        if (type(tok) is np.ndarray and type(par) is np.ndarray and type(conf) is np.ndarray
                and tok.dtype == np.int64 and par.dtype == np.int64
                and conf.dtype == np.float64 and tok.ndim == par.ndim == conf.ndim == 1
                and len(tok) == len(par) == len(conf)):
            return self  # as built-in sources build it: nothing to convert
        arrays = {}
        for field, kinds, dtype in (("tokens", "iu", np.int64), ("parents", "iu", np.int64),
                                    ("confidence", "iuf", np.float64)):
            a = np.asarray(getattr(self, field))
            if a.ndim != 1:
                raise ValueError(f"{field} of shape {a.shape}, not one value per node")
            if a.dtype.kind not in kinds:
                raise ValueError(f"{field} of dtype {a.dtype}, not "
                                 f"{'integers' if dtype is np.int64 else 'numbers'}")
            if a.dtype.kind == "u" and len(a) and a.max() > np.iinfo(np.int64).max:
                raise ValueError(f"{field} holds {a.max()}, past int64")
            arrays[field] = np.ascontiguousarray(a, dtype)
        tok, par, conf = arrays["tokens"], arrays["parents"], arrays["confidence"]
        n = len(tok)
        if len(par) != n or len(conf) != n:
            raise ValueError(f"tokens, parents and confidence differ in length "
                             f"({n}, {len(par)}, {len(conf)})")
        return SourceTree(tok, par, conf)

    def check(self, budget: int, vocab_size: int | None = None) -> "SourceTree":
        """This tree if it keeps the contract, else ValueError saying which
        rule it breaks (the hybrid then drops this source's candidates for
        the step)."""
        t = self.conformed()
        if len(t.tokens) > budget:
            raise ValueError(f"{len(t.tokens)} nodes for a budget of {budget}")
        bad = valid_tree(t.tokens, t.parents, t.confidence, vocab_size or -1)
        if bad:
            raise ValueError(PROBLEMS[bad])
        return t


# What ``valid_tree`` (and the merge's status) codes mean.
PROBLEMS = {1: "a node's parent is not an earlier node or -1",
            2: "a confidence outside [0, 1]", 3: "more nodes than the budget",
            4: "tokens, parents or confidences that are not numbers",
            5: "a token id outside the vocabulary"}


@cached_njit
def valid_tree(tokens, parents, confidence, vocab):
    """0 when every parent is an earlier node or -1, every confidence is in
    [0, 1] and every token in [0, vocab) (vocab -1: unknown, any id >= 0);
    else the ``PROBLEMS`` code of the first rule broken."""
    for i in range(len(parents)):
        if parents[i] < -1 or parents[i] >= i:
            return 1
        if not (confidence[i] >= 0.0 and confidence[i] <= 1.0):
            return 2
        if tokens[i] < 0 or (vocab >= 0 and tokens[i] >= vocab):
            return 5
    return 0


class DraftSource:
    """Base of every draft source (built in or from another package).

    Subclasses set ``name`` and may declare ``OPTIONS`` (validated like a
    method's, given under ``"source_options": {name: {...}}``; rules between
    options go in ``check_options``) and ``TOPK``
    (how many of the target's top-k per verified row they learn from).
    They override ``propose``, and where they keep state ``learn``,
    ``sent`` and ``free``."""

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[tuple[Option, ...]] = ()
    TOPK: ClassVar[int] = 0

    @classmethod
    def check_options(cls, options: dict[str, Any]) -> None:
        """Rules between resolved options (each option's own bounds are its
        ``Option``'s): ValueError naming the option. Called at start-up,
        in the front end, before any model loads."""

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
