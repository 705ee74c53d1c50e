"""Resting: whole engine steps in which a proposer does no work at all.

Where drafting cannot pay (low acceptance, a steep step-cost curve), even
keeping no draft costs an awake step its own work: the bridge's top-k
extraction, the proposer's learning and drafting. A proposer that keeps no
per-step state (``PluginProposer.CAN_REST``) can skip all of it for a
stretch of steps; ``Rest`` decides when, from the goodput rule's decisions
and from measured rates of resting and awake steps (``ModeRates``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np

from vllm_plugins.proposers.jit import cached_njit

if TYPE_CHECKING:
    from vllm_plugins.step_context import StepContext


class ModeRates:
    """Realised tokens per second of resting and of awake steps, per batch
    size (exact up to 64, then per power of two).

    The goodput rule predicts from a model of the step; this measures. Costs
    the model does not see (the top-k extraction, the proposer's Python, a
    kernel the runtime rebuilds for a new token count, host effects) all land
    in the awake rate, so "rest is faster here" is read from the engine, not
    derived. A step's seconds are its forward and sampling plus its
    proposer's own time; its tokens are what its requests emitted.

    Each mode is also measured against the step model's promise at the time
    (awake: the rule's prediction; resting: the model's idle rate), so the
    two are compared as of now: rests are rare, and on a host whose load
    moves, a rate measured minutes ago says more about the load then than
    about resting.
    """

    _HALF_LIFE = 64.0     # observations of the same (mode, batch) cell
    _CELLS = 72

    def __init__(self):
        # One array, so a step's update is one compiled call (``_observe``).
        self._tables = np.zeros((7, 2, self._CELLS))
        (self.tokens, self.seconds, self.count, self.promised, self.delivered, self.own,
         self.own_count) = self._tables
        # ``promised``/``delivered``: the tokens the model promised in the
        # same time, per mode (awake: the rule's prediction; resting: the
        # idle rate), and the tokens delivered on those steps. ``own``: our
        # own seconds per step (top-k extraction and proposer), per mode:
        # reported, not decided on (docs/draft_length_design.md says why).
        self._decay = 0.5 ** (1.0 / self._HALF_LIFE)

    @classmethod
    def cell(cls, batch: int) -> int:
        batch = max(int(batch), 1)
        if batch <= 64:
            return batch
        return min(64 + batch.bit_length() - 6, cls._CELLS - 1)

    def observe(self, resting: bool, batch: int, tokens: float, seconds: float,
                predicted_rate: float = float("nan"), own_seconds: float = float("nan")
                ) -> None:
        """One step: its tokens and seconds (ours included), ``own_seconds``
        of them spent on our work, and the rate the model promised for it
        (awake: the rule's prediction; resting: the idle rate)."""
        _observe(self._tables, int(not resting), self.cell(batch), self._decay, float(tokens),
                 float(seconds), float(predicted_rate), float(own_seconds))

    def bias(self, batch: int, resting: bool = False) -> float:
        """Delivered / promised tokens of awake (or resting) steps at this
        batch size; 1 before any was promised."""
        m, c = int(not resting), self.cell(batch)
        p = self.promised.item(m, c)
        return self.delivered.item(m, c) / p if p > 0 else 1.0

    def own_seconds(self, batch: int) -> tuple[float, float] | None:
        """(resting, awake) seconds of our own work per step at this batch
        size; None until an awake step is timed here."""
        c = self.cell(batch)
        if self.own_count[1, c] <= 0:
            return None
        rest = self.own[0, c] / self.own_count[0, c] if self.own_count[0, c] > 0 else 0.0
        return float(rest), float(self.own[1, c] / self.own_count[1, c])

    def rates(self, batch: int) -> tuple[float, float, float, float]:
        """(rest tokens/s, awake tokens/s, rest weight, awake weight)."""
        c = self.cell(batch)
        tokens, seconds = self.tokens, self.seconds
        return (tokens.item(0, c) / max(seconds.item(0, c), 1e-12),
                tokens.item(1, c) / max(seconds.item(1, c), 1e-12),
                self.count.item(0, c), self.count.item(1, c))

    def table(self) -> dict[str, list[float | None]]:
        """Measured cells: {batch cell: [rest tokens/s, awake tokens/s]}."""
        out = {}
        for c in np.nonzero((self.count > 0).any(0))[0]:
            r = self.tokens[:, c] / np.maximum(self.seconds[:, c], 1e-12)
            out[str(int(c))] = [round(float(r[m]), 2) if self.seconds[m, c] > 0 else None
                                for m in (0, 1)]
        return out

    def own_table(self) -> dict[str, list[float | None]]:
        """Timed cells: {batch cell: [resting, awake] ms of our work per step}."""
        out = {}
        for c in np.nonzero((self.own_count > 0).any(0))[0]:
            out[str(int(c))] = [round(1e3 * float(self.own[m, c] / self.own_count[m, c]), 3)
                                if self.own_count[m, c] > 0 else None for m in (0, 1)]
        return out


@cached_njit
def _observe(tables, m, c, d, tokens, seconds, predicted_rate, own_seconds):
    """``ModeRates.observe`` on its tables (tokens, seconds, count,
    promised, delivered, own, own_count) of mode ``m``, cell ``c``."""
    if own_seconds >= 0 and math.isfinite(own_seconds):
        tables[5, m, c] = d * tables[5, m, c] + own_seconds
        tables[6, m, c] = d * tables[6, m, c] + 1.0
    if not (seconds > 0 and math.isfinite(seconds)):
        return
    if math.isfinite(predicted_rate):
        tables[3, m, c] = d * tables[3, m, c] + predicted_rate * seconds
        tables[4, m, c] = d * tables[4, m, c] + tokens
    elif m == 1:
        return   # an awake step without a prediction teaches no bias
    tables[0, m, c] = d * tables[0, m, c] + tokens
    tables[1, m, c] = d * tables[1, m, c] + seconds
    tables[2, m, c] = d * tables[2, m, c] + 1.0


@cached_njit
def _corrected(tables, c, goodput, idle):
    """``Rest.beats_drafting``'s reads of ``ModeRates`` cell ``c``: (resting
    weight, awake weight, awake bias * ``goodput``, resting bias * ``idle``),
    the biases as ``ModeRates.bias`` gives them."""
    promised = tables[3, 1, c]
    awake = tables[4, 1, c] / promised if promised > 0 else 1.0
    promised = tables[3, 0, c]
    resting = tables[4, 0, c] / promised if promised > 0 else 1.0
    return tables[2, 0, c], tables[2, 1, c], awake * goodput, resting * idle


def step_tokens(ctx: StepContext) -> tuple[int, int]:
    """(tokens the step ran, tokens its decoding rows account for: one per
    request plus its verified drafts). More run than accounted for means
    the step ran prompt tokens too."""
    decode = sum((r.num_draft if len(r.accepted) else 0) + 1 for r in ctx.requests)
    return ctx.last_step_tokens or decode, decode


def engine_gap(ctx: StepContext) -> float:
    """The engine's seconds between our previous proposal and the step
    (scheduling, output handling). A gap longer than the step itself is an
    idle engine waiting for requests, not work: counted as none."""
    gap, step = ctx.last_gap_seconds, ctx.last_step_seconds
    if gap is None or step is None or not (0.0 <= gap <= step):
        return 0.0
    return float(gap)



class Rest:
    """When a proposer that may rest (``can_rest``) rests, and for how long.

    After ``_REST_AFTER`` decisions in a row that kept no draft, or one
    where the measured rate of resting beats the rule's corrected
    prediction (``beats_drafting``), the next ``_REST_MIN`` steps skip the
    proposer entirely; each rest that follows straight on the previous one
    doubles, up to ``_REST_MAX`` steps. A rest ends early, and the next
    one starts short, when half the batch it began with is gone, or half
    the batch is new: that changes what a draft is worth. (At batch 1,
    every new request: the last one's worthless drafts say nothing of the
    next one's.) It also ends when the drafts cut just before it, observed
    for free on its first step, were accepted more often than the estimate
    foresaw (``wake``, ``GoodputController._observe_resting``): acceptance
    has risen, and resting cannot see it again.
    """

    _REST_AFTER = 3
    _REST_MIN = 4
    _REST_MAX = 32
    # Decayed steps of each mode before they are compared: step times move a
    # lot between prompts on a shared host, and a short comparison rests
    # through copy stretches (tests/test_draft_length_rest.py).
    _MODE_EVIDENCE = 32.0
    # Rest is probed until this much of it is measured (two short rests),
    # not until the comparison may start: at batch 1, probing on to 32
    # rested through copy stretches again.
    _PROBE_EVIDENCE = 8.0
    _REST_MARGIN = 0.02      # resting must measure this much faster
    _REST_PROBE_GAP = 64     # awake steps before resting once to measure it
    # ... where the rule expects less than this gain from drafting: about
    # what an awake step's own work costs.
    _REST_PROBE_GAIN = 1.02

    def __init__(self):
        self.modes = ModeRates()
        self.resting = False          # the current step rests
        self.left = 0                 # steps still to rest
        self.length = self._REST_MIN  # the next rest's length
        self.zero_run = 0             # decisions in a row that kept no draft
        self.batch_ids: frozenset = frozenset()   # the batch when the rest began
        self.decided = False          # the decision just made rests from the next step
        self.awake_since = 0          # step the current awake stretch began
        self.steps = 0                # steps rested
        self.probes = 0               # rests begun to measure resting
        # The step just observed, for ModeRates once its proposer time is
        # known; and the rate the rule promised for the drafts just decided.
        self._record: tuple | None = None
        self.promised = float("nan")

    @property
    def pending(self) -> bool:
        return self.left > 0

    def wake(self) -> None:
        """End the rest after this step, and start the next one short: what
        it rested on has changed."""
        self.left = 0
        self.length = self._REST_MIN

    def start_step(self, ctx: StepContext, step: int, idle: float = float("nan"),
                   tokens: tuple[int, int] | None = None) -> bool:
        """Whether this step rests; measures the step before it (a resting
        one against ``idle``, the model's idle rate for its batch).
        ``tokens``: the step's ``step_tokens``, where the caller has them."""
        self._close_record(ctx)
        was_resting, self.resting = self.resting, False
        if self.left > 0:
            self.left -= 1
            joined = sum(r.req_id not in self.batch_ids for r in ctx.requests)
            if (2 * len(ctx.requests) > len(self.batch_ids)
                    and 2 * joined < len(ctx.requests)):
                self.resting = True
                self.steps += 1
                self._record = _mode_record(ctx, True, idle, tokens)
                self.promised = float("nan")
                return True
            self.wake()   # the batch it rested on is gone
        if was_resting:
            self.awake_since = step
        # This step verified what the previous decision kept: its prediction.
        self._record = _mode_record(ctx, False, self.promised, tokens)
        self.promised = float("nan")
        return False

    def _close_record(self, ctx: StepContext) -> None:
        """Close the previous step's record: its proposer time arrives now.
        Our own work in it: the top-k extraction of its forward, and the
        proposer call that followed."""
        rec, self._record = self._record, None
        if rec is None or not rec[1]:
            return
        resting, batch, tokens, seconds, promised, topk = rec
        propose = ctx.last_propose_seconds
        own = float("nan") if propose is None else propose + (topk or 0.0)
        if seconds:
            self.modes.observe(resting, batch, tokens, seconds + (propose or 0.0),
                               promised, own_seconds=own)

    def beats_drafting(self, batch: int, goodput: float, idle: float, step: int) -> bool:
        """Whether to rest from this step on. Each mode's rate is the model's
        promise now, corrected by that mode's measured ratio of delivered to
        promised tokens at this batch size: drafting's is the rule's
        prediction for this decision, resting's the model's idle rate
        (``idle``). So costs the model misses count, a change in acceptance
        counts at once, and a change in the host's load moves both alike.
        Unmeasured rest is tried once where the corrected prediction gains
        less than 2% over the model's idle step."""
        # The prediction and the idle rate, corrected (``ModeRates.bias``),
        # and each mode's weight (``ModeRates.rates``), in one compiled read.
        n_rest, n_awake, drafting, rest = _corrected(
            self.modes._tables, self.modes.cell(batch), float(goodput), float(idle))
        if n_rest >= self._MODE_EVIDENCE and n_awake >= self._MODE_EVIDENCE:
            return drafting < (1.0 - self._REST_MARGIN) * rest
        if (n_rest < self._PROBE_EVIDENCE and drafting < self._REST_PROBE_GAIN * idle
                and step - self.awake_since >= self._REST_PROBE_GAP):
            self.probes += 1
            return True
        return False

    def after_decide(self, ctx: StepContext, kept_any: bool, offered: bool,
                     may_rest: Callable[[], bool]) -> None:
        """Count the decision towards a rest, and begin one when due
        (``may_rest`` is asked only for a decision that kept nothing)."""
        decided, self.decided = self.decided, False
        if kept_any:
            self.zero_run = 0
            self.length = self._REST_MIN
            return
        if not (offered and may_rest()):
            return
        self.zero_run += 1
        if decided or self.zero_run >= self._REST_AFTER:
            self.zero_run = 0
            self.left = self.length
            self.length = min(2 * self.length, self._REST_MAX)
            self.batch_ids = frozenset(r.req_id for r in ctx.requests)


def _mode_record(ctx: StepContext, resting: bool, predicted: float,
                 tokens: tuple[int, int] | None = None) -> tuple | None:
    """What ``ModeRates`` learns from this step once its proposer time is
    known; None for a step that ran prompt tokens. A prefill costs what its
    prompt costs, in either mode, and emits next to nothing: in flight,
    where requests join all the time, such steps would make the awake rate
    read as a fraction of the resting one."""
    tokens, decode = step_tokens(ctx) if tokens is None else tokens
    if tokens > decode:
        return None
    emitted = float(sum(len(r.accepted) for r in ctx.requests))
    return (resting, len(ctx.requests), emitted, float(ctx.last_step_seconds or 0.0),
            predicted, ctx.last_topk_seconds)
