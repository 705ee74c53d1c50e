"""The per-step contract of a draft-length controller, and the estimating
policies ``acceptance`` and ``confidence`` (``goodput`` lives in its own
module).

Each engine step the proposer base calls::

    observation = controller.observe(ctx)        # learn from the step that ran
    # (observation.resting: skip drafting; goodput only)
    drafts = proposer.draft(ctx)                 # asks max_length(req_id, observation)
    keep = controller.decide(ctx, drafts, observation)   # list[int], batch order

What ``observe`` learns that ``max_length`` and ``decide`` need (the step's
slot rows, the estimates after learning, each request's length bound) is
the ``Observation`` it returns: nothing of it is kept on the controller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from vllm_plugins.options import number
from vllm_plugins.proposers.array_table import ArrayTable
from vllm_plugins.proposers.draft_length.acceptance import (ESTIMATOR_OPTIONS, AcceptanceEstimator,
                                                           clip)
from vllm_plugins.proposers.draft_length.calibration import (
    CONFIDENCE_OPTIONS, ConfidenceCalibrator, PrefixCalibrator, prefix_probabilities)
from vllm_plugins.proposers.draft_length.controller_kernels import (
    LEARN_SCALARS, LEARN_TABLE, count_decisions, learn_bound_step_table, learn_step_table,
    settle_step)
from vllm_plugins.proposers.draft_length.slots import RequestSlots

if TYPE_CHECKING:  # duck-typed at run time; no import cost, no cycle
    from vllm_plugins.step_context import Drafts, StepContext


@dataclass
class Observation:
    """What ``observe`` learned of one step, for the same step's
    ``max_length`` and ``decide``."""

    # Requests in the step (at least 1).
    batch: int
    # The step's requests' slot rows, in batch order (None: empty batch, or
    # a policy that keeps no per-request state).
    rows: np.ndarray | None = None
    # Per-position acceptance estimates of those rows after this step's
    # learning ([rows, max_draft]).
    probs: np.ndarray | None = None
    # The most each request will keep this step (None: max_draft for all).
    bounds: dict[str, int] | None = None
    # Requests ``max_length`` answered 0: drafting gave them nothing, and
    # ``decide`` counts that as the controller's own zero choice.
    zero_bound: set[str] = field(default_factory=set)
    # goodput: this step keeps at most this many drafts per request, to
    # explore the cost curve (None: no exploration this step).
    explore_cap: int | None = None
    # goodput: the step rests (no drafting, no learning).
    resting: bool = False
    # goodput, where the runner verifies one k for all and takes the next
    # from us (StepContext.steers_step_k): the k this step's drafts are
    # verified at (None: the runner does not take our k).
    step_k: int | None = None


class DraftLengthController:
    """The contract, and the bookkeeping every policy shares.

    ``decide`` returns per request (batch order) how many drafts to keep,
    0 <= keep[i] <= min(len(drafts.tokens[i]), max_draft).
    """

    name = "base"
    OPTIONS: tuple = ()
    # Set by the proposer: whether it may skip whole steps (PluginProposer.CAN_REST).
    can_rest = False
    # Set by the proposer: whether the policy may choose which nodes of its
    # draft trees to verify (PluginProposer.SHAPES_TREES); otherwise a tree
    # is cut to a prefix like a chain.
    shapes_trees = False

    def __init__(self, max_draft: int, options: dict):
        self.max_draft = int(max_draft)
        self.options = options
        self.slots = RequestSlots(options.get("max_tracked", 65536))
        self.slots.add("zero_streak", (), np.int64, 0)
        self.steps = 0
        self.decisions = 0       # request-steps with at least one draft offered
        self.zero_choices = 0    # ... of which the controller kept none
        self.no_draft = 0        # request-steps where the proposer offered none
        self.probes = 0
        self.hist = np.zeros(self.max_draft + 1, dtype=np.int64)
        # The batch-wide k wanted for the next step, where the runner takes
        # one from us (Observation.step_k); None: no choice made.
        self.next_step_k: int | None = None

    @property
    def rests_next_step(self) -> bool:
        """Already decided: the next step rests (the bridge skips its top-k)."""
        return False

    def observe(self, ctx: StepContext) -> Observation:
        for rid in ctx.finished:
            self.free(rid)
        self.steps += 1
        return Observation(batch=max(1, len(ctx.requests)))

    def max_length(self, req_id: str, observation: Observation) -> int:
        """Upper bound on what ``decide`` will keep for this request this step."""
        bounds = observation.bounds
        if bounds is None or req_id not in bounds:
            return self.max_draft
        bound = bounds[req_id]
        if bound == 0:
            observation.zero_bound.add(req_id)
        return bound

    def decide(self, ctx: StepContext, drafts: Drafts, observation: Observation) -> list[int]:
        return self._decide_counted(ctx, drafts, observation)[0]

    def shape(self, ctx: StepContext, drafts: Drafts, observation: Observation) -> Drafts:
        """The drafts to verify this step (what the proposer base returns):
        the prefixes ``decide`` keeps. A policy that chooses a tree's nodes
        returns them instead; the same once-per-step rule as ``decide``."""
        return trim(drafts, self.decide(ctx, drafts, observation))

    def _decide_counted(self, ctx: StepContext, drafts: Drafts, observation: Observation
                        ) -> tuple[list[int], bool]:
        """(kept lengths, whether any request was offered a draft or bounded
        to none by ``max_length``)."""
        max_draft = self.max_draft
        lengths = np.array([min(len(t), max_draft) for t in drafts.tokens], np.int64)
        if len(lengths) == 0:
            return [], False
        # Requests with no draft because max_length() said 0: the controller's
        # own zero choice, made before drafting (counted as such, and they
        # move towards a probe like any zero choice).
        bound = np.zeros(len(lengths), dtype=bool)
        if observation.zero_bound:
            bound = (lengths == 0) & np.fromiter(
                (r.req_id in observation.zero_bound for r in ctx.requests[:len(lengths)]),
                dtype=bool, count=min(len(lengths), len(ctx.requests)))
        keep = np.asarray(self._keep(ctx, drafts, lengths, observation, bound), np.int64)
        no_draft, decisions, zeros, any_row = count_decisions(lengths, keep, bound, self.hist)
        self.no_draft += no_draft
        self.decisions += decisions
        self.zero_choices += zeros
        return keep.tolist(), any_row

    def _keep(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray,
              observation: Observation, bound: np.ndarray) -> np.ndarray:
        """The policy's kept lengths (``bound``: rows max_length gave 0)."""
        return lengths

    def free(self, req_id: str) -> None:
        self.slots.release(req_id)

    def counters(self) -> dict[str, dict[str, int]]:
        """Totals that only grow (``PluginProposer.counters``)."""
        return {"zero_draft_decisions": {"": self.zero_choices}}

    def stats(self) -> dict:
        total = int(self.hist.sum())
        return {
            "policy": self.name,
            "steps": self.steps,
            "decisions": self.decisions,
            "zero_choices": self.zero_choices,
            "no_draft": self.no_draft,
            "probes": self.probes,
            "k_histogram": [int(v) for v in self.hist],
            "mean_k": float((self.hist * np.arange(len(self.hist))).sum() / total)
            if total else 0.0,
            "tracked_requests": len(self.slots),
            "evicted_requests": self.slots.evicted,
            "state_bytes": self.slots.nbytes(),
        }


_NO_FLAGS = np.zeros(0, np.bool_)
_NO_VALUES = np.zeros(0)
_NO_MATRIX = np.zeros((0, 0))
# Outcomes read elsewhere (tree nodes): row, position, confidence, outcome.
_EXTRA_TYPES = (np.int64, np.int64, np.float64, np.float64)
_NO_EXTRA = tuple(np.zeros(0, t) for t in _EXTRA_TYPES)


def _learn_table(slot: tuple, est: tuple, prefix: tuple | None, calibrate: tuple | None,
                 bound: tuple) -> tuple:
    """The learning's state as ``learn_step_table`` takes it: (its arrays'
    ``ArrayTable``, its scalars, prefix calibration on (True) or None,
    confidence calibration on or None). ``slot``, ``est``, ``prefix``,
    ``calibrate``: ``_kernel_state``'s tuples; ``bound``: the bound's slot
    arrays (``zero_streak``, ``conf_seen``)."""
    arrays = (*slot, *est[:8], *(prefix[:4] if prefix else (None,) * 4),
              *(calibrate[:7] if calibrate else (None,) * 7), *bound)
    scalars = (*est[8:], prefix[4] if prefix else 0.0,
               *(calibrate[7:] if calibrate else (0.0,) * 3))
    if len(scalars) != len(LEARN_SCALARS):
        raise ValueError(f"{len(scalars)} scalars for LEARN_SCALARS' {len(LEARN_SCALARS)}")
    return (ArrayTable(arrays, LEARN_TABLE), np.array(scalars, np.float64),
            None if prefix is None else True, None if calibrate is None else True)


def trim(drafts: Drafts, keep: list[int]) -> Drafts:
    """The first ``keep[i]`` drafts of each row (tokens, probability rows,
    confidences, parents: a prefix of a tree is a tree)."""
    tokens = [t[:k] for t, k in zip(drafts.tokens, keep)]
    probs = None
    if drafts.probs is not None:
        probs = [None if p is None else p[:k] for p, k in zip(drafts.probs, keep)]
    conf = None
    if drafts.confidence is not None:
        conf = [None if c is None else c[:k] for c, k in zip(drafts.confidence, keep)]
    parents = None
    if drafts.parents is not None:
        parents = [None if p is None else p[:k] for p, k in zip(drafts.parents, keep)]
    return type(drafts)(tokens, probs, conf, parents)


class FixedController(DraftLengthController):
    """Keep every draft."""

    name = "fixed"


class EstimatingController(DraftLengthController):
    """Shared by acceptance / confidence / goodput: per-request acceptance
    estimates, what the cut drafts teach, probing, confidences."""

    uses_confidence = False
    _MAX_BACKOFF = 1  # a failed probe doubles the probe interval (once)

    def __init__(self, max_draft: int, options: dict):
        super().__init__(max_draft, options)
        self.estimator = AcceptanceEstimator(self.slots, max_draft, **options)
        self.calibrator = (ConfidenceCalibrator(self.slots, max_draft, **options)
                           if self.uses_confidence else None)
        self.probe_interval = options["probe_interval"]
        self.slots.add("probe_level", (), np.int64, 0)   # failed probes in a row
        self.slots.add("probing", (), np.bool_, False)
        self.observe_cut = bool(options.get("observe_cut", True))
        # The first draft cut last step (-1: none) and how many were kept.
        self.slots.add("cut_token", (), np.int64, -1)
        self.slots.add("cut_at", (), np.int64, -1)
        self.cut_observed = 0
        # Drafts observed for free (cut, or tree nodes left unverified) while
        # ``counting_free`` (goodput's resting steps): how many, how many
        # were accepted, and the sum of p and of p (1 - p) over them, p
        # their acceptance as the estimate foresaw it.
        self.free_outcomes = np.zeros(4)
        self.counting_free = False
        self.prefix = (PrefixCalibrator(self.slots, max_draft)
                       if options.get("calibrate_prefix") else None)
        self._probe_scale = 1     # goodput stretches probing where drafts are dear
        self._state_capacity = -1   # _kernel_state
        self._info = np.empty((8, 3), np.int64)   # _learn's per-row buffer
        # Row k: the first k of max_draft drafts (``valid`` for a row of k).
        self._prefixes = np.arange(max_draft)[None, :] < np.arange(max_draft + 1)[:, None]

    # ------------------------------------------------------------ observe
    def observe(self, ctx: StepContext) -> Observation:
        return self._learn(ctx, bound=True)

    def _learn(self, ctx: StepContext, bound: bool = False) -> Observation:
        """Bookkeeping, then learn from the drafts this step verified (with
        ``bound``, each request's ``max_length`` too: ``_learn_verified``)."""
        observation, verified = self._read(ctx)
        if verified is not None:
            self._learn_verified(ctx, verified, observation if bound else None)
        return observation

    def _read(self, ctx: StepContext) -> tuple[Observation, tuple | None]:
        """Bookkeeping, and what this step verified as the compiled learning
        takes it (None: no requests)."""
        observation = super().observe(ctx)
        reqs = ctx.requests
        if not reqs:
            return observation, None
        rows = observation.rows = self.slots.slots([r.req_id for r in reqs])
        # Per row: tokens emitted, drafts verified, the last token emitted (into
        # a kept buffer: an array built from tuples costs more than the learning).
        batch = len(reqs)
        if len(self._info) < batch:
            self._info = np.empty((2 * batch, 3), np.int64)
        info = self._info[:batch]
        for i, r in enumerate(reqs):
            n = len(r.accepted)
            info[i] = n, r.num_draft, r.accepted[-1] if n else -1
        # Rows whose drafts were trees teach the per-position estimates
        # nothing; the policy reads them node by node (``extra``: their
        # node outcomes for the confidence calibration, typed as
        # ``_EXTRA_TYPES``).
        trees, extra = self._learn_trees(ctx, rows)
        return observation, (rows, info, trees, extra)

    def _learn_verified(self, ctx: StepContext, verified: tuple,
                        bound: Observation | None = None) -> None:
        """``_read``'s step into the estimates and calibrations. With
        ``bound`` (the step's observation), each request's ``max_length``
        for the step too, from the estimates just learned, in the same
        compiled call (``learn_bound_step``: drafting asks once per request,
        and one pass is cheaper than that many scalar ones)."""
        rows, info, trees, extra = verified
        batch = len(rows)
        self._kernel_state()
        outcomes = np.empty((4, batch), np.int64)
        foreseen = np.empty(batch) if self.counting_free else _NO_VALUES
        table, scalars, prefix_on, calibrate_on = self._learn_table
        args = (rows, info, _NO_FLAGS if trees is None else trees, self.observe_cut,
                self.counting_free, outcomes, foreseen,
                *(_NO_EXTRA if extra is None else extra), table.table, scalars, prefix_on,
                calibrate_on)
        if bound is None:
            peeks, changes = learn_step_table(*args)
        else:
            # Confidences only arrive with the drafts: no bound for rows given
            # them (``conf_seen``).
            peeks, changes, bound.probs, bounds = learn_bound_step_table(
                *args, float(self._length_threshold(bound)), self._probe_gap(),
                self._MAX_BACKOFF, self.max_draft)
            bound.bounds = dict(zip([r.req_id for r in ctx.requests], bounds.tolist()))
        self.estimator.changes += changes
        if peeks:
            self.cut_observed += peeks
            if self.counting_free:
                peek = outcomes[2] >= 0
                self._free_outcome(outcomes[3, peek] > 0, foreseen[peek])

    def _learn_trees(self, ctx: StepContext, rows: np.ndarray):
        """(bool per row: its last drafts were a tree the policy reads node
        by node, or None; those nodes' outcomes for the confidence
        calibration as arrays of ``_EXTRA_TYPES``, or None). Chain policies
        read no trees."""
        return None, None

    def _free_outcome(self, accepted: np.ndarray, foreseen: np.ndarray) -> None:
        p = clip(np.asarray(foreseen, np.float64), 0.0, 1.0)
        self.free_outcomes += (len(p), float(np.sum(accepted)), float(p.sum()),
                               float(np.sum(p * (1.0 - p))))

    # ------------------------------------------------------------- decide
    def _keep(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray,
              observation: Observation, bound: np.ndarray) -> np.ndarray:
        rows = self._rows(ctx, lengths, observation)
        width = max(lengths.tolist())   # a few rows: cheaper than numpy's reduction
        if width == 0:   # nothing offered (e.g. max_length said 0 to all)
            return self._settle(rows, drafts, lengths, np.zeros(len(lengths), np.int64),
                                bound, None, None)
        q, q_raw, conf = self._prefix_probs(rows, drafts, width, observation)
        valid = self._prefixes[lengths, :width]
        keep = self._choose(lengths, q, valid, observation)
        return self._settle(rows, drafts, lengths, keep, bound, q_raw, conf)

    def _rows(self, ctx: StepContext, lengths: np.ndarray, observation: Observation
              ) -> np.ndarray:
        if len(ctx.requests) != len(lengths):
            raise ValueError(f"drafts has {len(lengths)} rows for a batch of "
                             f"{len(ctx.requests)} requests")
        if observation.rows is not None:
            return observation.rows
        return self.slots.slots([r.req_id for r in ctx.requests])

    def _prefix_probs(self, rows: np.ndarray, drafts: Drafts, width: int,
                      observation: Observation):
        """(prefix probabilities P(drafts 1..j accepted) as the rule reads
        them, the same before prefix calibration, the raw confidences or
        None), each [rows, width]."""
        p = observation.probs if observation.probs is not None else self.estimator.probs(rows)
        conf = self._confidence_matrix(drafts, width)
        q, q_raw = prefix_probabilities(rows, p, width, conf, self.calibrator, self.prefix)
        return q, q_raw, conf

    def _settle(self, rows, drafts: Drafts, lengths: np.ndarray, keep: np.ndarray,
                bound: np.ndarray, q_raw: np.ndarray | None, conf: np.ndarray | None
                ) -> np.ndarray:
        """Probes, then what the next step's outcomes are matched with: the
        first cut draft, the kept prefixes' probabilities and confidences.
        Returns the kept lengths (``controller_kernels.settle_step``).

        After ``probe_interval`` consecutive zeros a row keeps one token, to
        re-learn; a failed probe doubles the interval (once: up to 2x), an
        accepted probe, or a non-zero choice, resets it. A row whose first
        cut draft the next step observes (deterministic drafts, with
        ``observe_cut``; ``_stochastic_rows``) learns without verifying it
        and is not probed; nor is one ``max_length`` gave 0 (``bound``),
        which counts as a zero choice.
        """
        self._kernel_state()
        out = np.empty((3, len(lengths)), np.int64)
        remember = self.prefix is not None and q_raw is not None
        probes, cuts = settle_step(
            rows, lengths, np.asarray(keep, np.int64), bound,
            self.observe_cut and q_raw is not None, self._stochastic_rows(drafts, len(lengths)),
            self._probe_gap(), self._MAX_BACKOFF, out,
            self.slots.arrays["q_used"] if remember else None,
            q_raw if remember else _NO_MATRIX, _NO_MATRIX if conf is None else conf,
            *self._settle_args)
        self.probes += probes
        kept = out[0]
        if cuts:
            cut_token = self.slots.arrays["cut_token"]
            for i in out[2, :cuts].tolist():
                cut_token[rows[i]] = int(drafts.tokens[i][kept[i]])
        return kept

    def _kernel_state(self) -> tuple:
        """The slot arrays and the estimator's and calibrations' state as
        the compiled steps take them (``controller_kernels``): for learning
        (cut draft and probe slots, estimator, prefix calibration,
        confidence calibration) and for settling (probe and cut slots, kept
        confidences). Rebuilt when the slots grow, which replaces their
        arrays; with it the same flattened as the compiled steps take them
        (``_learn_table``, ``_settle_args``: None for a calibration that is
        off)."""
        if self._state_capacity != self.slots.capacity:
            a = self.slots.arrays
            cal = self.calibrator
            self._state = state = (
                (a["cut_token"], a["cut_at"], a["probing"], a["probe_level"]),
                self.estimator.kernel_state(),
                None if self.prefix is None else self.prefix.kernel_state(),
                None if cal is None else cal.kernel_state(),
                (a["zero_streak"], a["probe_level"], a["probing"], a["cut_at"]),
                None if cal is None else (a["conf_kept"], a["conf_seen"]))
            slot, est, prefix, learn_cal, settle_slot, settle_cal = state
            self._learn_table = _learn_table(
                slot, est, prefix, learn_cal,
                (a["zero_streak"], _NO_FLAGS if cal is None else a["conf_seen"]))
            self._settle_args = (*settle_slot, *(settle_cal or (None, None)))
            self._state_capacity = self.slots.capacity
        return self._state

    def _choose(self, lengths: np.ndarray, q: np.ndarray, valid: np.ndarray,
                observation: Observation) -> np.ndarray:
        """The policy: drafts to keep per row from prefix probabilities
        ``q`` (``valid`` marks offered drafts)."""
        raise NotImplementedError

    def _length_threshold(self, observation: Observation) -> float:
        """The policy's bound on kept drafts: a row keeps at most the
        leading drafts whose prefix probability by the request's history
        beats this (-inf: no bound)."""
        return -math.inf

    def _confidence_matrix(self, drafts: Drafts, width: int) -> np.ndarray | None:
        if not self.uses_confidence or drafts.confidence is None:
            return None
        confs = drafts.confidence
        if width == 0 or all(c is None for c in confs):
            return None
        try:  # common case: every row has >= width confidences
            out = np.array([c[:width] for c in confs], dtype=np.float64)
            if out.shape == (len(confs), width):
                return out
        except (TypeError, ValueError):
            pass
        out = np.full((len(confs), width), np.nan)
        for i, c in enumerate(confs):
            if c is not None:
                c = np.asarray(c, dtype=np.float64).reshape(-1)[:width]
                out[i, :len(c)] = c
        return out

    def _stochastic_rows(self, drafts: Drafts, size: int) -> np.ndarray:
        """Rows with draft probabilities (stochastic drafts; empty: none),
        whose cut draft the next step cannot observe: their acceptance is
        min(1, p/q), which the sampled token does not show. Every other
        offered row's is observed (with observe_cut on), and an observable
        zero choice still teaches, so it needs no probe."""
        if drafts.probs is None:
            return _NO_FLAGS
        return np.array([i < len(drafts.probs) and drafts.probs[i] is not None
                         for i in range(size)], dtype=bool)

    def _probe_gap(self) -> int:
        """Zero choices in a row before a probe, before backoff (0: none)."""
        if self.probe_interval > 0 and self._probe_scale > 0:
            return self.probe_interval * self._probe_scale
        return 0

    def stats(self) -> dict:
        out = super().stats()
        out["acceptance_global"] = round(self.estimator.global_rate, 4)
        out["cut_drafts_observed"] = self.cut_observed
        if self.prefix is not None:
            out["prefix_calibration"] = self.prefix.table()
        out["changes_detected"] = self.estimator.changes
        if self.calibrator is not None:
            out["calibration_global"] = self.calibrator.table()
        return out


class AcceptanceController(EstimatingController):
    """Smallest k reaching ``target_fraction`` of the achievable expected
    accepted length, never keeping a token whose prefix acceptance probability
    is below ``min_prob``."""

    name = "acceptance"
    OPTIONS = (
        *ESTIMATOR_OPTIONS,
        number("target_fraction", 0.9, 0.0, 1.0, lo_open=True),
        number("min_prob", 0.1, 0.0, 1.0, hi_open=True),
    )

    def _choose(self, lengths, q, valid, observation) -> np.ndarray:
        qv = np.where(valid, q, 0.0)
        expected = np.cumsum(qv, axis=1)                       # E[A(k)], k = 1..K
        total = expected[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
        total = np.where(lengths > 0, total, 0.0)
        goal = self.options["target_fraction"] * total
        reached = valid & (expected >= goal[:, None] - 1e-12)
        k_frac = np.where(reached.any(1), reached.argmax(1) + 1, lengths)
        k_prob = (valid & (q >= self.options["min_prob"])).sum(1)
        return np.minimum(k_frac, k_prob)

    def _length_threshold(self, observation) -> float:
        return self.options["min_prob"] - 1e-12


class ConfidenceController(EstimatingController):
    """Keep drafting while P(all kept drafts accepted) >= ``threshold``."""

    name = "confidence"
    uses_confidence = True
    OPTIONS = (
        *ESTIMATOR_OPTIONS,
        *CONFIDENCE_OPTIONS,
        number("threshold", 0.3, 0.0, 1.0, lo_open=True, hi_open=True),
    )

    def _choose(self, lengths, q, valid, observation) -> np.ndarray:
        return (valid & (q >= self.options["threshold"])).sum(1)

    def _length_threshold(self, observation) -> float:
        return self.options["threshold"] - 1e-12
