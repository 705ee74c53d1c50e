"""The batch-wide k from what the engine core already knows.

A drafter whose step never waits for the host (Token Recycling's device
tables) has no per-request figures on the host to run a controller on. The
engine core has some, one step late, whatever runs the step: for each
request, how many drafts the step verified (the scheduler scheduled them)
and how many were accepted (the tokens it emitted), and how long the step
took. On a runner that verifies one k for every request (Model Runner V2),
that is enough for the goodput rule over the batch: per-position acceptance
from the counts, the step time from ``StepCostModel``, and the k maximising
(B + B sum_{j<k} P(first j+1 accepted)) / t(B (1 + k)) (``uniform_step_k``).
No draft confidences and no per-request rows: the k is the batch's.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from vllm_plugins.proposers.draft_length.goodput import uniform_step_k
from vllm_plugins.proposers.draft_length.step_cost import StepCostModel


class BatchStepK:
    """Chooses the next step's k from the step's verified and accepted
    counts and its time.

    Acceptance at position j is (accepted at j) / (reached j), counts
    decayed by ``decay`` a step so the estimate follows the traffic, with a
    prior of ``prior_accept`` over ``prior_steps`` reaches. While the cost
    model is not warm, and at ``explore`` of steps after, a random k is
    tried, so the model sees steps of many sizes; after
    ``_ZERO_PROBE_GAP`` choices of 0 in a row, one step verifies a draft,
    so the estimate that chose 0 can move.
    """

    _ZERO_PROBE_GAP = 16

    def __init__(self, max_k: int, decay: float = 0.98, prior_accept: float = 0.5,
                 prior_steps: float = 2.0, warmup_explore: float = 0.5,
                 explore: float = 0.02, seed: int = 0):
        self.max_k = int(max_k)
        self.decay = decay
        self.cost = StepCostModel()
        self.reached = np.full(self.max_k, prior_steps)
        self.accepted = np.full(self.max_k, prior_steps * prior_accept)
        self.warmup_explore = warmup_explore
        self.explore = explore
        self.rng = np.random.default_rng(seed)
        self.k = self.max_k
        self.hist = np.zeros(self.max_k + 1, dtype=np.int64)
        self.probes = 0
        self._zero_run = 0

    def observe(self, verified: Sequence[int], accepted: Sequence[int],
                step_seconds: float | None, tokens: int) -> None:
        """One step: per request, drafts verified and accepted; the step's
        seconds (None: not a step to time) and scheduled tokens."""
        reached = np.zeros(self.max_k)
        hits = np.zeros(self.max_k)
        for v, a in zip(verified, accepted):
            v = min(int(v), self.max_k)
            if v <= 0:
                continue
            a = max(0, min(int(a), v))
            reached[:min(a + 1, v)] += 1.0
            hits[:a] += 1.0
        if reached.any():
            self.reached = self.decay * self.reached + reached
            self.accepted = self.decay * self.accepted + hits
        if step_seconds is not None:
            batch = len(verified)
            self.cost.observe(float(tokens), float(batch), float(step_seconds),
                              verifies=any(v > 0 for v in verified))

    def acceptance(self) -> np.ndarray:
        """P(draft j accepted | drafts before it accepted), per position."""
        return self.accepted / np.maximum(self.reached, 1e-12)

    def choose(self, batch: int) -> int:
        """The k for the next step of about ``batch`` requests."""
        batch = max(1, int(batch))
        rate = self.explore if self.cost.warm else self.warmup_explore
        if rate > 0 and self.rng.random() < rate:
            k = int(self.rng.integers(0, self.max_k + 1))
        else:
            a, b = self.cost.line(batch)
            q = np.cumprod(self.acceptance())[None, :]
            k = uniform_step_k(np.broadcast_to(q, (batch, self.max_k)),
                               np.ones((batch, self.max_k), dtype=bool), a, b,
                               self.cost.verify_step_s)[0]
        if k == 0:
            self._zero_run += 1
            if self._zero_run >= self._ZERO_PROBE_GAP:
                self._zero_run = 0
                self.probes += 1
                k = 1
        else:
            self._zero_run = 0
        self.k = k
        self.hist[k] += 1
        return k
