"""Goodput: the draft lengths that maximise expected tokens per second.

SmartSpec's rule: per step, the k_i (0 included) maximising
(sum_i E[1 + accepted_i(k_i)]) / t(step), the step time learned online from
the engine's own timings (``StepCostModel``). Where drafting does not pay,
a proposer that allows it rests (``Rest``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from vllm_plugins.options import flag, integer, number
from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.draft_length.acceptance import ESTIMATOR_OPTIONS
from vllm_plugins.proposers.draft_length.calibration import CONFIDENCE_OPTIONS
from vllm_plugins.proposers.draft_length.controllers import EstimatingController, Observation
from vllm_plugins.proposers.draft_length.rest import Rest, engine_gap, step_tokens
from vllm_plugins.proposers.draft_length.step_cost import (COST_OPTIONS, RecentSizes,
                                                           StepCostModel)

if TYPE_CHECKING:
    from vllm_plugins.step_context import Drafts, StepContext


def goodput_allocation(q: np.ndarray, valid: np.ndarray, intercept: float,
                       slope: float, verify_step_s: float = 0.0,
                       new_shape_s: float = 0.0,
                       warm_tokens: np.ndarray | None = None,
                       by_count: np.ndarray | None = None
                       ) -> tuple[np.ndarray, float, float]:
    """Per-row k maximising (B + sum_i sum_{j<k_i} q_ij) / t(N), where
    t(N) = intercept + slope * N, plus ``verify_step_s`` when any k_i > 0,
    plus ``new_shape_s`` when N is not in ``warm_tokens`` (None: every N is
    warm), plus ``by_count[N]`` where N is within it (``StepCostModel``'s
    correction at each token count).

    ``q[i, j]``: probability that drafts 1..j+1 of row i are all accepted
    (non-increasing in j); ``valid`` marks offered drafts; N = sum_i (1 + k_i)
    is the step's token count and B the number of rows. Greedy marginal
    allocation, exact here: for a given count M of kept drafts the best are
    the M largest q (ties: earlier position first, so each row keeps a
    prefix), and the best M is chosen with the step's whole time, its terms
    and its count's correction, in every M.
    Returns (k per row, expected goodput, expected generated tokens).
    """
    warm = _NO_SIZES if warm_tokens is None or new_shape_s <= 0 else warm_tokens
    keep, goodput, tokens = _allocation(np.ascontiguousarray(q, np.float64),
                                        np.ascontiguousarray(valid, np.bool_), float(intercept),
                                        float(slope), float(verify_step_s), float(new_shape_s),
                                        np.asarray(warm, np.int64), warm_tokens is not None,
                                        _NO_COUNTS if by_count is None
                                        else np.asarray(by_count, np.float64))
    return keep, goodput, tokens


_NO_SIZES = np.zeros(0, np.int64)
_NO_COUNTS = np.zeros(0)


def uniform_step_k(q: np.ndarray, valid: np.ndarray, intercept: float, slope: float,
                   verify_step_s: float = 0.0, by_count: np.ndarray | None = None
                   ) -> tuple[int, float, float]:
    """The one k for every row maximising (B + sum_i sum_{j<k} q_ij) / t(B (1 + k)),
    t as in ``goodput_allocation`` without the shape term: a runner that
    verifies k drafts of every request (padding a shorter one) pays for
    B (1 + k) tokens whatever each row offered, so the rows' allocation is
    not free, only k. Returns (k, expected goodput, expected tokens)."""
    batch, width = q.shape
    tokens = np.empty(width + 1)
    tokens[0] = batch
    np.cumsum(np.where(valid, q, 0.0).sum(axis=0), out=tokens[1:])
    tokens[1:] += batch
    ks = np.arange(width + 1)
    cost = intercept + slope * batch * (1 + ks) + np.where(ks > 0, verify_step_s, 0.0)
    if by_count is not None and len(by_count):
        counts = batch * (1 + ks)
        within = counts < len(by_count)
        cost[within] += by_count[counts[within]]
    goodput = tokens / np.maximum(cost, 1e-300)
    k = int(np.argmax(goodput))
    return k, float(goodput[k]), float(tokens[k])


@cached_njit
def _allocation(q, valid, intercept, slope, verify_step_s, new_shape_s, warm_tokens,
                shapes_known, by_count):
    """``goodput_allocation``'s greedy order and best count, compiled (it
    runs every step over a few entries, where numpy's sort and cumsum
    dispatch outweighed the work). Entries are listed by position, then
    row, and sorted stably by falling gain: ties go to the earlier position,
    then the earlier row."""
    batch, width = q.shape
    rows = np.empty(batch * width, np.int64)
    gains = np.empty(batch * width)
    count = 0
    for j in range(width):
        for r in range(batch):
            if valid[r, j]:
                rows[count] = r
                gains[count] = q[r, j]
                count += 1
    order = np.argsort(-gains[:count], kind="mergesort")
    best = 0
    best_goodput = -np.inf
    best_tokens = float(batch)
    cum = 0.0
    for m in range(count + 1):
        if m > 0:
            cum += gains[order[m - 1]]
        cost = intercept + slope * (batch + m)
        if m > 0:
            cost += verify_step_s
        if shapes_known and new_shape_s > 0:
            warm = False
            for t in warm_tokens:
                if t == batch + m:
                    warm = True
            if not warm:
                cost += new_shape_s
        if batch + m < len(by_count):
            cost += by_count[batch + m]
        goodput = (batch + cum) / max(cost, 1e-300)
        if goodput > best_goodput:
            best_goodput = goodput
            best = m
            best_tokens = batch + cum
    keep = np.zeros(batch, np.int64)
    for e in range(best):
        keep[rows[order[e]]] += 1
    return keep, best_goodput, best_tokens


class GoodputController(EstimatingController):
    """SmartSpec: maximise (sum_i E[1 + accepted_i(k_i)]) / t(batch, sum_i (1 + k_i)).

    With t linear in tokens plus step-level terms (``StepCostModel``) and
    prefix probabilities non-increasing in j, the allocation is exact: sort
    all candidate tokens by prefix probability q_ij, and take the best count
    M of that order (``goodput_allocation``). Where drafting does not pay,
    a proposer that allows it rests (no top-k, no learning, no drafting),
    decided from measured rates as well as the model (``Rest``).
    """

    # The chain rule alone, not a policy a method can name: the ``goodput``
    # policy is TreeGoodputController, which runs this rule on rows without a
    # tree. Its name is what its stats report ("policy").
    name = "goodput_chain"
    OPTIONS = (
        *ESTIMATOR_OPTIONS,
        *CONFIDENCE_OPTIONS,
        flag("use_confidence", True),
        flag("calibrate_prefix", True),
        *COST_OPTIONS,
        flag("rest", True),
        number("explore", 0.02, 0.0, 1.0),
        number("warmup_explore", 0.5, 0.0, 1.0),
        integer("seed", 0, 0, None),
    )
    # Once the cost model is warm, explore only while the slope's standard
    # error moves tau = b * goodput (the prefix probability a draft must
    # beat) by more than this.
    _TAU_TOLERANCE = 0.02
    _IDLE_PROBE_GAP = 64   # steps: at most 1 in 64 forced to verify nothing
    # Where the runner takes our k: after this many steps choosing k = 0 in
    # a row, one step verifies a draft, so the estimates that chose 0 still
    # learn (with k = 0 nothing is verified).
    _STEP_K_PROBE_GAP = 16

    def __init__(self, max_draft: int, options: dict):
        self.uses_confidence = bool(options["use_confidence"])
        super().__init__(max_draft, options)
        self.cost = StepCostModel(**options)
        self.sizes = RecentSizes(options["shape_cache"])
        self.rng = np.random.default_rng(options["seed"])
        self.rest = Rest()
        self.explore_steps = 0
        self.last_expected_goodput = float("nan")
        self.last_expected_tokens = float("nan")
        self._idle_probe_at = -self._IDLE_PROBE_GAP
        self.idle_probes = 0
        self.gap_s: float | None = None   # mean engine time around the runner
        self.step_k_hist = np.zeros(self.max_draft + 1, dtype=np.int64)
        self.step_k_probes = 0
        self._zero_step_k_run = 0
        # _idle_goodput and _length_threshold per batch size, for the cost
        # model's current line (_line_cached).
        self._idle_cache: dict[int, float] = {}
        self._threshold_cache: dict[int, float] = {}
        self._idle_line: tuple = ()

    @property
    def rests_next_step(self) -> bool:
        return self.rest.pending

    def _may_rest(self) -> bool:
        return self.can_rest and self.options["rest"] and self.cost.warm

    # ------------------------------------------------------------ observe
    def observe(self, ctx: StepContext) -> Observation:
        idle = self._idle_goodput(len(ctx.requests)) if self.cost.warm else float("nan")
        step_k = ctx.max_draft if ctx.steers_step_k else None
        tokens = step_tokens(ctx)   # read by the rest's record and the cost model
        if self.rest.start_step(ctx, self.steps, idle, tokens):
            observation = self._observe_resting(ctx, tokens)
            observation.step_k = step_k
            return observation
        # The step's verified drafts are read first (a tree's read says
        # whether the step verified a tree, which the cost model takes);
        # the estimates learn from them after the cost model's update, in
        # the call that bounds each request's draft by the step's threshold.
        observation, verified = self._read(ctx)
        observation.step_k = step_k
        self._observe_cost(ctx, tokens)
        observation.explore_cap = self._explore_cap(observation.batch)
        if verified is not None:
            self._learn_verified(ctx, verified, observation)
        return observation

    def _observe_resting(self, ctx: StepContext, tokens: tuple[int, int]) -> Observation:
        """A resting step: no draft was verified (the step before kept
        none), but the first draft that decision cut (a tree: the root's
        children) is observed for free (``step_outcomes``). Learning it is
        what lets a request whose acceptance rose wake up to draft: more
        such drafts accepted than the estimate foresaw (beyond two standard
        deviations; at batch 1, one accepted where the estimate gave it
        under 0.2) ends the rest. Then the step's time, and per-request
        state that waits for a verification is dropped."""
        self.free_outcomes[:] = 0.0
        self.counting_free = True
        try:
            rows = self._learn(ctx).rows
        finally:
            self.counting_free = False
        _, hits, foreseen, var = self.free_outcomes
        if hits > foreseen + 2.0 * math.sqrt(var):
            self.rest.wake()
        self._observe_cost(ctx, tokens)
        if rows is not None:
            a = self.slots.arrays
            a["cut_token"][rows] = -1
            a["probing"][rows] = False
            if self.prefix is not None:
                a["q_used"][rows] = np.nan
            if self.calibrator is not None:
                a["conf_kept"][rows] = np.nan
            live = len(ctx.requests)
            self.decisions += live
            self.zero_choices += live
            self.hist[0] += live
        return Observation(batch=max(1, len(ctx.requests)), resting=True)

    def _observe_cost(self, ctx: StepContext, tokens: tuple[int, int]) -> None:
        """The step's time into the cost model; ``tokens``: ``step_tokens``."""
        tokens, decode = tokens
        if ctx.last_gap_seconds is not None:   # reported, not modelled
            gap = engine_gap(ctx)
            self.gap_s = gap if self.gap_s is None else 0.95 * self.gap_s + 0.05 * gap
        new_shape = self.sizes.touch(tokens) if tokens else False
        # Steps that ran prompt tokens are not the kind this rule decides on
        # (and their many tokens would pull the line).
        if ctx.last_step_seconds is not None and ctx.requests and tokens <= decode:
            # The engine waits for the proposer as well as for the forward.
            seconds = ctx.last_step_seconds + (ctx.last_propose_seconds or 0.0)
            verifies = any(r.num_draft > 0 for r in ctx.requests)
            context = sum(len(r.context) - len(r.accepted) for r in ctx.requests) \
                if self.cost.use_context else 0
            self.cost.observe(float(tokens), float(len(ctx.requests)), float(seconds),
                              verifies, new_shape, self._verified_tree(ctx), float(context))
        if self.cost.use_context:
            # The step being decided reads every token its requests hold now.
            self.cost.context_now = float(sum(len(r.context) for r in ctx.requests))

    def _verified_tree(self, ctx: StepContext) -> bool:
        """Whether the step that ran verified a draft tree (not a chain)."""
        return False

    def _explore_cap(self, batch: int) -> int | None:
        """Decided before drafting, so ``max_length`` sees it: while the cost
        model is not warm yet, or its slope too uncertain, some steps keep a random
        number of drafts; where every step verifies, one now and then keeps
        none, so the verify-step cost does not hide in the intercept."""
        if not self.cost.warm:
            rate = self.options["warmup_explore"]
        elif self.cost.slope_se * self._goodput_scale(batch) > self._TAU_TOLERANCE:
            rate = self.options["explore"]
        else:
            rate = 0.0
        if rate > 0 and self.rng.random() < rate:
            return int(self.rng.integers(0, self.max_draft + 1))
        if (self.cost.warm and self.steps - self._idle_probe_at >= self._IDLE_PROBE_GAP
                and self.cost.needs_idle_step()):
            self._idle_probe_at = self.steps
            self.idle_probes += 1
            return 0
        return None

    def _goodput_scale(self, batch: int) -> float:
        """Tokens per second of the last decision (or of no drafting at all)."""
        g = self.last_expected_goodput
        if math.isfinite(g):
            return g
        return self._idle_goodput(batch)

    def _idle_goodput(self, batch: int) -> float:
        """The model's tokens per second of a step of ``batch`` requests
        that keeps no draft: B / t(B). Asked a few times a step, and the
        line changes only with a refit (or, with the context feature, with
        the step's context): kept per batch size until then."""
        self._line_cached()
        rate = self._idle_cache.get(batch)
        if rate is None:
            a, b = self.cost.line(batch)
            rate = self._idle_cache[batch] = batch / max(
                a + b * batch + self.cost.count_cost(batch), 1e-12)
        return rate

    def _line_cached(self) -> None:
        """Empties the values kept per batch size where the cost model's
        line has changed since they were computed."""
        cost = self.cost
        line = (cost, cost.current_fit(), cost.context_now)
        if line != self._idle_line:
            self._idle_line = line
            self._idle_cache.clear()
            self._threshold_cache.clear()

    def _length_threshold(self, observation: Observation) -> float:
        # Token j is only added while q_j > b * G, and G >= G(0) = B / t(B):
        # a bound from history at (half) this step's batch size.
        batch = max(1, observation.batch // 2)
        self._line_cached()
        threshold = self._threshold_cache.get(batch)
        if threshold is None:
            threshold = self._threshold_cache[batch] = \
                self.cost.line(batch)[1] * self._idle_goodput(batch)
        return threshold

    # ---------------------------------------------------- drafting, decide
    def max_length(self, req_id: str, observation: Observation) -> int:
        if observation.explore_cap is not None:
            return self.max_draft
        return super().max_length(req_id, observation)

    def decide(self, ctx: StepContext, drafts: Drafts, observation: Observation) -> list[int]:
        if observation.resting:   # the proposer does not ask; keep nothing if it does
            if observation.step_k is not None:
                self._choose_next_step_k(0)
            return [0] * len(drafts.tokens)
        keep, offered = self._decide_counted(ctx, drafts, observation)
        # Where the runner takes our k, what counts towards a rest is the k
        # chosen, not what this step's (older) k lets through.
        kept = any(keep) if observation.step_k is None else bool(self.next_step_k)
        self.rest.after_decide(ctx, kept, offered, self._may_rest)
        return keep

    def _choose(self, lengths, q, valid, observation) -> np.ndarray:
        batch = len(lengths)
        if observation.explore_cap is not None:
            self.explore_steps += 1
            if observation.step_k is not None:
                self._choose_next_step_k(observation.explore_cap)
                return np.minimum(lengths, observation.step_k)
            return np.minimum(lengths, observation.explore_cap)
        a, b = self.cost.line(batch)
        if observation.step_k is not None:
            return self._choose_step_k(lengths, q, valid, observation, a, b)
        keep, goodput, tokens = self._allocate(q, valid, a, b)
        if self._rests_instead(batch, goodput, tokens):
            return np.zeros_like(keep)
        # A draft is worth its cost when its prefix probability exceeds
        # tau = b * goodput. Probing pays off only if acceptance can beat tau:
        # never when tau >= 1; the closer tau is to 1, the rarer.
        tau = b * goodput
        self._probe_scale = 0 if tau >= 1.0 else int(min(8, max(1, round(1 / (1 - tau)))))
        return keep

    def _choose_step_k(self, lengths, q, valid, observation, a: float, b: float
                       ) -> np.ndarray:
        """Where the runner verifies one k for all: this step's drafts are
        verified at ``observation.step_k`` whatever is kept (the scheduler
        chose it a step ago), so each row keeps all of its up to that; the
        rule chooses the k of the next step (``uniform_step_k``). Resting
        is choosing 0 with the top-k and learning skipped too."""
        batch = len(lengths)
        k, goodput, tokens = uniform_step_k(q, valid, a, b, self.cost.verify_step_s,
                                            self.cost.by_count)
        if self._rests_instead(batch, goodput, tokens):
            self._choose_next_step_k(0)
            return np.zeros_like(lengths)
        self._choose_next_step_k(k)
        return np.minimum(lengths, observation.step_k)

    def _rests_instead(self, batch: int, goodput: float, tokens: float) -> bool:
        """Records the decision's promise; True where resting beats it (the
        rest then begins, promising the idle rate)."""
        self.last_expected_goodput = goodput
        self.last_expected_tokens = tokens
        self.rest.promised = goodput
        idle = self._idle_goodput(batch)
        if self._may_rest() and self.rest.beats_drafting(batch, goodput, idle, self.steps):
            self.rest.decided = True
            self.rest.promised = idle
            return True
        return False

    def _choose_next_step_k(self, k: int) -> None:
        """Records the next step's k; a long run of 0 is broken by one
        step at 1 (``_STEP_K_PROBE_GAP``)."""
        if k == 0 and not self.rest.pending:
            self._zero_step_k_run += 1
            if self._zero_step_k_run >= self._STEP_K_PROBE_GAP:
                self._zero_step_k_run = 0
                self.step_k_probes += 1
                k = 1
        else:
            self._zero_step_k_run = 0
        k = min(int(k), self.max_draft)
        self.next_step_k = k
        self.step_k_hist[k] += 1

    def _allocate(self, q: np.ndarray, valid: np.ndarray, intercept: float, slope: float
                  ) -> tuple[np.ndarray, float, float]:
        """The rule's allocation on the step line (intercept, slope):
        (kept drafts per row, expected goodput, expected tokens)."""
        return goodput_allocation(q, valid, intercept, slope, self.cost.verify_step_s,
                                  self.cost.new_shape_s, self.sizes.array(), self.cost.by_count)

    def counters(self) -> dict[str, dict[str, int]]:
        out = super().counters()
        out["rest_steps"] = {"": self.rest.steps}
        out["rest_probes"] = {"": self.rest.probes}
        return out

    def stats(self) -> dict:
        out = super().stats()
        out["explore_steps"] = self.explore_steps
        out["rest_steps"] = self.rest.steps
        out["rest_probes"] = self.rest.probes
        out["measured_rates"] = self.rest.modes.table()
        out["own_ms_per_step"] = self.rest.modes.own_table()
        out["engine_gap_ms"] = None if self.gap_s is None else round(1e3 * self.gap_s, 3)
        out["idle_probes"] = self.idle_probes
        if self.step_k_hist.any():
            out["step_k_histogram"] = self.step_k_hist.tolist()
            out["step_k_probes"] = self.step_k_probes
        out["cost_model"] = self.cost.coefficients()
        g = self.last_expected_goodput
        out["last_expected_goodput"] = None if math.isnan(g) else g
        return out
