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

import random
from typing import Sequence

import numpy as np

from vllm_plugins.proposers.draft_length.step_cost import StepCostModel
from vllm_plugins.proposers.jit import cached_njit


class BatchStepK:
    """Chooses the next step's k from the step's verified and accepted
    counts and its time.

    Acceptance at position j is (accepted at j) / (reached j), counts
    decayed by ``decay`` a step so the estimate follows the traffic, with a
    prior of ``prior_accept`` over ``prior_steps`` reaches. While the cost
    model is not warm, and at ``explore`` of steps after, a random k is
    tried, so the model sees steps of many sizes; after
    ``_ZERO_PROBE_GAP`` choices of 0 in a row, one step verifies a draft,
    so the estimate that chose 0 can move. A choice holds for
    ``choose_every`` steps of the same batch size: every step observes,
    every other one chooses, which halves what the engine core spends on
    it once a forward has left its code cold.
    """

    _ZERO_PROBE_GAP = 16

    def __init__(self, max_k: int, decay: float = 0.98, prior_accept: float = 0.5,
                 prior_steps: float = 2.0, warmup_explore: float = 0.5,
                 explore: float = 0.02, seed: int = 0, choose_every: int = 2):
        self.max_k = int(max_k)
        self.choose_every = max(1, int(choose_every))
        self._held = self.choose_every   # the first call chooses
        self._batch = 0
        self.decay = decay
        # A sixteenth of the window moves the fit little; a refit, cold
        # after the forward, costs the engine core more than the rest of
        # its step.
        self.cost = StepCostModel(refit_every=16)
        self.reached = np.full(self.max_k, prior_steps)
        self.accepted = np.full(self.max_k, prior_steps * prior_accept)
        self.warmup_explore = warmup_explore
        self.explore = explore
        # Python's generator: a draw costs the engine core less than numpy's.
        self.rng = random.Random(seed)
        self.k = self.max_k
        # Choices of each k (a list: one ``+= 1`` a choice, no numpy call).
        self.hist = [0] * (self.max_k + 1)
        self.probes = 0
        self._zero_run = 0
        # Each step's verified and accepted counts, [2, room for requests].
        self._counts = np.zeros((2, 64), np.int64)
        self._counts_flat = memoryview(self._counts).cast("B").cast("q")

    def observe(self, verified: Sequence[int], accepted: Sequence[int],
                step_seconds: float | None, tokens: int) -> None:
        """One step: per request, drafts verified and accepted; the step's
        seconds (None: not a step to time) and scheduled tokens."""
        n = len(verified)
        if n > self._counts.shape[1]:
            self._counts = np.zeros((2, 2 * n), np.int64)
            self._counts_flat = memoryview(self._counts).cast("B").cast("q")
        # Written through a flat memoryview: no numpy call, which the
        # forward left cold, for a few ints.
        flat, width = self._counts_flat, self._counts.shape[1]
        for i in range(n):
            flat[i] = verified[i]
            flat[width + i] = accepted[i]
        verifies = _count(self._counts, n, self.decay, self.reached, self.accepted)
        if step_seconds is not None:
            self.cost.observe(float(tokens), float(len(verified)), float(step_seconds),
                              verifies=verifies)

    def acceptance(self) -> np.ndarray:
        """P(draft j accepted | drafts before it accepted), per position."""
        return self.accepted / np.maximum(self.reached, 1e-12)

    def choose(self, batch: int) -> int:
        """The k for the next step of about ``batch`` requests: chosen anew
        every ``choose_every`` steps, or where the batch changed; else the
        last choice (what it weighs moves by a few percent a step)."""
        batch = max(1, int(batch))
        self._held += 1
        if self._held < self.choose_every and batch == self._batch:
            return self.k
        self._held = 0
        self._batch = batch
        rate = self.explore if self.cost.warm else self.warmup_explore
        if rate > 0 and self.rng.random() < rate:
            k = self.rng.randrange(self.max_k + 1)
        else:
            a, b = self.cost.line(batch)
            k = _uniform_k(self.accepted, self.reached, batch, a, b, self.cost.verify_step_s,
                           self.cost.by_count)
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


# The engine core runs these every step, between its other work: as numpy
# they are a dozen small array calls (and a [batch, k] broadcast) whose
# dispatch outweighs the arithmetic.

@cached_njit
def _count(counts, n, decay, reached, hits):
    """The step's per-position reaches and acceptances (counts [2, >= n]:
    the first n requests' verified and accepted drafts) into the decayed
    counts (in place; unchanged where no request verified a draft).
    Returns whether any request verified a draft."""
    verified, accepted = counts[0], counts[1]
    width = reached.shape[0]
    new_reached = np.zeros(width)
    new_hits = np.zeros(width)
    verifies = False
    for i in range(n):
        v = min(verified[i], width)
        if v <= 0:
            continue
        verifies = True
        a = max(0, min(accepted[i], v))
        for j in range(min(a + 1, v)):
            new_reached[j] += 1.0
        for j in range(a):
            new_hits[j] += 1.0
    if verifies:
        for j in range(width):
            reached[j] = decay * reached[j] + new_reached[j]
            hits[j] = decay * hits[j] + new_hits[j]
    return verifies


@cached_njit
def _uniform_k(hits, reached, batch, intercept, slope, verify_step_s, by_count):
    """``goodput.uniform_step_k`` for ``batch`` rows that share one
    acceptance curve (cumulative products of hits / reached), with the
    same sums in the same order, so the same k."""
    width = hits.shape[0]
    reach = 1.0
    total = 0.0
    best_k = 0
    idle = intercept + slope * batch
    if batch < len(by_count):
        idle += by_count[batch]
    best = batch / max(idle, 1e-300)
    for k in range(1, width + 1):
        reach *= hits[k - 1] / max(reached[k - 1], 1e-12)
        row_sum = 0.0
        for _ in range(batch):
            row_sum += reach
        total += row_sum
        cost = intercept + slope * batch * (1 + k) + verify_step_s
        if batch * (1 + k) < len(by_count):
            cost += by_count[batch * (1 + k)]
        goodput = (total + batch) / max(cost, 1e-300)
        if goodput > best:
            best, best_k = goodput, k
    return best_k
