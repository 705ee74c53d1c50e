"""Adaptive draft-length controllers that work with every proposer.

A proposer drafts up to ``max_draft`` tokens per request; a controller decides
how many of them each request keeps this step. The proposer base calls, each
engine step::

    controller.observe(ctx)            # learn from the step that just ran
    drafts = proposer.draft(ctx)       # may call controller.max_length(req_id)
    keep = controller.decide(ctx, drafts)   # list[int], batch order

Policies (``make_controller(name, options, max_draft)``):

``fixed``       keep every draft.
``acceptance``  per-request acceptance estimates; the smallest k that reaches
                most of the achievable expected accepted length, 0 when
                acceptance is near zero (with periodic 1-token probes).
``confidence``  SpecDec++-style: keep drafting while the calibrated cumulative
                confidence (estimated P(all kept drafts accepted)) stays above
                a threshold; history estimates where no confidence is given.
``goodput``     SmartSpec's rule (default): per step, the k_i (0 included)
                maximising expected generated tokens / predicted step time, the
                step time learned online from the engine's own timings.

Pure Python + numpy; no vLLM import. Per-request state lives in rows of
preallocated numpy arrays (a slot per live request, freed on
``ctx.finished``); global state is fixed size. See docs/draft_length.md.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

if TYPE_CHECKING:  # duck-typed at run time; no import cost, no cycle
    from vllm_plugins.step_context import Drafts, StepContext

DEFAULT_CONTROLLER = "goodput"

_EPS = 1e-3  # position probabilities are clipped to [_EPS, 1 - _EPS]


# --------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------

class _Opt:
    """One controller option: default, validator, and its one-line rule."""

    def __init__(self, default: Any, check: Callable[[Any], Any], rule: str):
        self.default = default
        self.check = check
        self.rule = rule


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num(lo: float | None = None, hi: float | None = None, *, lo_open=False,
         hi_open=False, integer=False) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if integer:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError
        elif not _is_number(v):
            raise TypeError
        if lo is not None and (v < lo or (lo_open and v == lo)):
            raise TypeError
        if hi is not None and (v > hi or (hi_open and v == hi)):
            raise TypeError
        return int(v) if integer else float(v)
    return check


def _choice(*choices: Any) -> Callable[[Any], Any]:
    def check(v: Any) -> Any:
        if v not in choices:
            raise TypeError
        return v
    return check


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise TypeError
    return v


# Options every estimating policy (acceptance, confidence, goodput) takes.
_ESTIMATOR_OPTIONS = {
    "estimator": _Opt("ewma", _choice("ewma", "window"), "'ewma' or 'window'"),
    "half_life": _Opt(3.0, _num(0.0, lo_open=True),
                      "a positive number of verification steps"),
    "window": _Opt(8, _num(1, 64, integer=True), "an integer in [1, 64]"),
    "change_threshold": _Opt(4.0, _num(0.0),
                             "a number >= 0 (nats; 0 disables change detection)"),
    "prior_acceptance": _Opt(0.6, _num(0.0, 1.0, lo_open=True, hi_open=True),
                             "in (0, 1)"),
    "prior_strength": _Opt(2.0, _num(0.0), "a number >= 0"),
    "probe_interval": _Opt(4, _num(0, integer=True),
                           "an integer >= 0 (0 disables probing)"),
    "max_tracked": _Opt(65536, _num(1, integer=True), "a positive integer"),
    "observe_cut": _Opt(True, _bool, "true or false"),
}
_CONFIDENCE_OPTIONS = {
    "calib_bins": _Opt(10, _num(2, 100, integer=True), "an integer in [2, 100]"),
    "calib_half_life": _Opt(16.0, _num(0.0, lo_open=True),
                            "a positive number of verification steps"),
}

POLICY_OPTIONS: dict[str, dict[str, _Opt]] = {
    "fixed": {},
    "acceptance": {
        **_ESTIMATOR_OPTIONS,
        "target_fraction": _Opt(0.9, _num(0.0, 1.0, lo_open=True), "in (0, 1]"),
        "min_prob": _Opt(0.1, _num(0.0, 1.0, hi_open=True), "in [0, 1)"),
    },
    "confidence": {
        **_ESTIMATOR_OPTIONS,
        **_CONFIDENCE_OPTIONS,
        "threshold": _Opt(0.3, _num(0.0, 1.0, lo_open=True, hi_open=True),
                          "in (0, 1)"),
    },
    "goodput": {
        **_ESTIMATOR_OPTIONS,
        **_CONFIDENCE_OPTIONS,
        "use_confidence": _Opt(True, _bool, "true or false"),
        "calibrate_prefix": _Opt(True, _bool, "true or false"),
        "cost_features": _Opt("tokens+batch", _choice("tokens", "tokens+batch"),
                              "'tokens' or 'tokens+batch'"),
        "switch_cost": _Opt(True, _bool, "true or false"),
        "shape_cache": _Opt(32, _num(0, 4096, integer=True),
                            "an integer in [0, 4096] (0: no new-shape cost)"),
        "rest": _Opt(True, _bool, "true or false"),
        "cost_window": _Opt(256, _num(8, 65536, integer=True),
                            "an integer in [8, 65536]"),
        "warmup": _Opt(16, _num(3, integer=True), "an integer >= 3"),
        "explore": _Opt(0.02, _num(0.0, 1.0), "in [0, 1]"),
        "warmup_explore": _Opt(0.5, _num(0.0, 1.0), "in [0, 1]"),
        "prior_token_cost": _Opt(0.001, _num(0.0), "a number >= 0"),
        "seed": _Opt(0, _num(0, integer=True), "an integer >= 0"),
    },
}


def controller_names() -> list[str]:
    return list(POLICY_OPTIONS)


def resolve_options(name: str, options: dict | None) -> dict:
    """Defaults overlaid with validated values; ValueError names the option."""
    if name not in POLICY_OPTIONS:
        raise ValueError(f"unknown draft_length policy {name!r}; "
                         f"choose one of {controller_names()}")
    specs = POLICY_OPTIONS[name]
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"draft_length options must be a dict, got {options!r}")
    options = dict(options or {})
    unknown = sorted(set(options) - set(specs))
    if unknown:
        raise ValueError(
            f"unknown draft_length option(s) {unknown} for policy {name!r}; "
            f"known options: {sorted(specs) or 'none'}")
    out = {k: s.default for k, s in specs.items()}
    for key, value in options.items():
        try:
            out[key] = specs[key].check(value)
        except (TypeError, ValueError):
            raise ValueError(f"draft_length option {key!r} of policy {name!r} must "
                             f"be {specs[key].rule}, got {value!r}") from None
    return out


# --------------------------------------------------------------------------
# per-request slots
# --------------------------------------------------------------------------

class RequestSlots:
    """Maps request ids to rows of per-request numpy arrays.

    Rows are reused: a finished request's row is reset and put on a free list.
    Capacity doubles when full, so memory follows the peak number of live
    requests. ``max_tracked`` bounds it even if finish notices are lost: the
    least recently seen request is evicted (set it above max_num_seqs).
    """

    def __init__(self, max_tracked: int = 65536, initial: int = 32):
        self.max_tracked = max_tracked
        self.capacity = max(1, min(initial, max_tracked))
        self._ids: dict[str, int] = {}
        self._owner: dict[int, str] = {}
        self._free = list(range(self.capacity - 1, -1, -1))
        self._specs: dict[str, tuple[tuple, Any, Any]] = {}
        self.arrays: dict[str, np.ndarray] = {}
        self.evicted = 0
        self._tick = 0
        self.add("_seen", (), np.int64, -1)   # last tick a row was looked up

    def add(self, name: str, tail: tuple, dtype: Any, fill: Any) -> None:
        self._specs[name] = (tail, dtype, fill)
        self.arrays[name] = np.full((self.capacity, *tail), fill, dtype=dtype)

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._ids

    def get(self, req_id: str) -> int | None:
        return self._ids.get(req_id)

    def slots(self, req_ids: list[str]) -> np.ndarray:
        """Rows for these requests (created on first sight), marked as seen."""
        self._tick += 1
        get = self._ids.get
        out = [get(rid) for rid in req_ids]
        if None in out:
            found = [o for o in out if o is not None]
            self.arrays["_seen"][found] = self._tick   # protected from eviction
            for i, rid in enumerate(req_ids):
                if out[i] is None:
                    out[i] = self._allocate(rid)
        rows = np.array(out, dtype=np.int64)
        self.arrays["_seen"][rows] = self._tick
        return rows

    def release(self, req_id: str) -> None:
        slot = self._ids.pop(req_id, None)
        if slot is not None:
            del self._owner[slot]
            self._reset(slot)
            self._free.append(slot)

    def _allocate(self, req_id: str) -> int:
        while len(self._ids) >= self.max_tracked:
            # Lost finish notices: evict the least recently seen request (one
            # of the current lookup only if the batch alone exceeds the cap).
            seen = self.arrays["_seen"]
            live = np.fromiter(self._owner, dtype=np.int64, count=len(self._owner))
            victim = int(live[np.argmin(seen[live])])
            self.release(self._owner[victim])
            self.evicted += 1
        if not self._free:
            self._grow()
        slot = self._free.pop()
        self._reset(slot)
        self._ids[req_id] = slot
        self._owner[slot] = req_id
        self.arrays["_seen"][slot] = self._tick
        return slot

    def _grow(self) -> None:
        old = self.capacity
        new = min(max(2 * old, 1), max(self.max_tracked, old + 1))
        for name, (tail, dtype, fill) in self._specs.items():
            arr = np.full((new, *tail), fill, dtype=dtype)
            arr[:old] = self.arrays[name]
            self.arrays[name] = arr
        self._free.extend(range(new - 1, old - 1, -1))
        self.capacity = new

    def _reset(self, slot: int) -> None:
        for name, (_, _, fill) in self._specs.items():
            self.arrays[name][slot] = fill

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays.values()))


# --------------------------------------------------------------------------
# acceptance estimation
# --------------------------------------------------------------------------

def _outcome_masks(n: np.ndarray, m: np.ndarray, depth: int):
    """Per draft position j (0-based): observed (j < min(m+1, n)), accepted (j < m).

    Position j's outcome is the conditional acceptance of draft j+1 given drafts
    1..j were accepted; positions past the first rejection are unobserved.
    """
    j = np.arange(depth)
    obs = j[None, :] < np.minimum(m + 1, n)[:, None]
    acc = j[None, :] < m[:, None]
    return obs, acc


class AcceptanceEstimator:
    """Per-request conditional acceptance rate of each draft position.

    ``p[r, j]`` estimates P(draft j+1 accepted | drafts 1..j accepted). From
    decayed counts S (accepted), N (observed) per position:

        alpha_r  = (sum_j S_rj + g) / (sum_j N_rj + 1)        pooled rate
        g_j      = (GS_j + 2 g) / (GN_j + 2)                 global, per position
        pi_rj    = alpha_r with its odds times odds(g_j) / odds(g)
        p_rj     = (S_rj + c * pi_rj) / (N_rj + c)            c = prior_strength

    where ``g`` is a slow, global pooled acceptance rate (starts at
    ``prior_acceptance``) and GS_j, GN_j global decayed counts per position.
    Conditional acceptance rises with depth (measured with Token Recycling on
    Spec-Bench: 0.35, 0.52, 0.69, 0.67, 0.75, 0.79 for positions 1..6): a
    draft that survived j tokens is usually a copy. A pooled per-request prior
    would pull deep positions down to position 1's rate and cut drafts that
    pay; here an unexplored position falls back to the request's pooled rate
    moved by the global depth profile (in odds; a flat profile gives the
    pooled rate back).

    ``ewma``: on every verification step of a request, S <- d*S + accepted and
    N <- d*N + observed at all positions, d = 2**(-1/half_life). A change
    detector watches the request's last 3 verification steps: when the
    Bayes factor of "a new acceptance rate began 2 or 3 steps ago" over "same
    rate as before" exceeds e**change_threshold, the old counts are replaced
    by those steps' counts. A request whose acceptance collapses (or jumps) is then re-learned
    in 2-3 steps instead of several half-lives. ``window``: counts over the
    request's last ``window`` verification steps (no detector needed).
    """

    _RECENT = 3                 # verification steps the change detector sees
    _GLOBAL_HALF_LIFE = 64.0    # steps

    def __init__(self, slots: RequestSlots, max_draft: int, *, estimator: str = "ewma",
                 half_life: float = 3.0, window: int = 8, change_threshold: float = 4.0,
                 prior_acceptance: float = 0.6, prior_strength: float = 2.0, **_: Any):
        self.slots = slots
        self.depth = max_draft
        self.mode = estimator
        self.decay = 0.5 ** (1.0 / half_life)
        self.window = window
        self.change_threshold = change_threshold
        self.prior_acceptance = prior_acceptance
        self.prior_strength = prior_strength
        self._gdecay = 0.5 ** (1.0 / self._GLOBAL_HALF_LIFE)
        self._gs = 0.0
        self._gn = 0.0
        # Global decayed counts per position: conditional acceptance rises
        # with depth (a draft that survived j tokens is usually a copy), so a
        # position's prior is its own global rate, not the request's pooled one.
        self._gps = np.zeros(max_draft)
        self._gpn = np.zeros(max_draft)
        self.changes = 0
        if estimator == "ewma":
            slots.add("acc_s", (max_draft,), np.float64, 0.0)
            slots.add("acc_n", (max_draft,), np.float64, 0.0)
        # recent (n, m) outcomes: the window estimator, or the change detector
        self.recent = window if estimator == "window" else self._RECENT
        slots.add("win_n", (self.recent,), np.int16, 0)   # 0 = empty
        slots.add("win_m", (self.recent,), np.int16, 0)
        slots.add("win_pos", (), np.int64, 0)

    @property
    def global_rate(self) -> float:
        return (self._gs + self.prior_acceptance) / (self._gn + 1.0)

    def _window_counts(self, rows: np.ndarray, weights: np.ndarray | None = None
                       ) -> tuple[np.ndarray, np.ndarray]:
        """(accepted, observed) per position over the recent steps, optionally
        weighted per step ([R, W])."""
        a = self.slots.arrays
        n = a["win_n"][rows].astype(np.int64)          # [R, W]
        m = a["win_m"][rows].astype(np.int64)
        j = np.arange(self.depth)
        w = np.ones(n.shape) if weights is None else weights
        acc = (m[:, :, None] > j) & (n[:, :, None] > 0)
        seen = np.minimum(m + 1, n)[:, :, None] > j
        return (acc * w[:, :, None]).sum(1), (seen * w[:, :, None]).sum(1)

    def counts(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Decayed (accepted, observed) counts per position, [R, max_draft] each."""
        if self.mode == "ewma":
            a = self.slots.arrays
            return a["acc_s"][rows], a["acc_n"][rows]
        return self._window_counts(rows)

    def probs(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), max_draft] conditional acceptance per position."""
        return self._probs_from(*self.counts(rows))

    def position_rates(self) -> np.ndarray:
        """Global conditional acceptance per position, shrunk to the pooled rate."""
        g = self.global_rate
        return (self._gps + 2.0 * g) / (self._gpn + 2.0)

    def _probs_from(self, s: np.ndarray, n: np.ndarray) -> np.ndarray:
        g = self.global_rate
        alpha = (s.sum(1) + g) / (n.sum(1) + 1.0)           # the request's pooled rate
        # Each position's global odds relative to the pooled global odds:
        # a profile over depth that moves with the request's own rate.
        profile = self.position_rates() / (1.0 - self.position_rates())
        profile = profile / (g / (1.0 - g))
        prior = odds_scale(alpha[:, None], profile[None, :])
        c = self.prior_strength
        p = (s + c * prior) / np.maximum(n + c, 1e-12)
        return np.clip(p, _EPS, 1.0 - _EPS)

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray) -> None:
        """Learn from rows whose drafts were verified (n > 0): m of n accepted."""
        if len(rows) == 0:
            return
        n = np.minimum(n, self.depth)
        m = np.minimum(m, n)
        obs, acc = _outcome_masks(n, m, self.depth)
        self._gs = self._gdecay * self._gs + float(acc.sum())
        self._gn = self._gdecay * self._gn + float(obs.sum())
        self._gps = self._gdecay * self._gps + acc.sum(0)
        self._gpn = self._gdecay * self._gpn + obs.sum(0)
        a = self.slots.arrays
        pos = a["win_pos"][rows]
        col = pos % self.recent
        a["win_n"][rows, col] = n
        a["win_m"][rows, col] = m
        a["win_pos"][rows] = pos + 1
        if self.mode == "window":
            return
        d = self.decay
        a["acc_s"][rows] = d * a["acc_s"][rows] + acc
        a["acc_n"][rows] = d * a["acc_n"][rows] + obs
        if self.change_threshold > 0:
            self._changed(rows)

    def _changed(self, rows: np.ndarray) -> np.ndarray:
        """Bayes factor of "a new regime began L steps ago" (L = 2..W, W = 3).

        Pooled over positions, the last L steps hold A accepted drafts and F
        rejections. Under "no change" they follow the Beta posterior of the
        steps before them; under "new regime" a fresh uniform Beta(1, 1):

            log BF = log B(1+A, 1+F) - [log B(a0+A, b0+F) - log B(a0, b0)]

        a0, b0 = accepted / rejected counts before the window (plus the
        request prior). Parameter uncertainty is in both, so a short,
        over-confident history does not raise false alarms. Where the best L
        clears ``change_threshold``, the counts are replaced by those L steps'.
        """
        a = self.slots.arrays
        n = a["win_n"][rows].astype(np.int64)          # [R, W]
        m = a["win_m"][rows].astype(np.int64)
        valid = n > 0
        # Age of each column (0 = newest). EWMA is linear: the window's share
        # of S, N is d**age per step, so the reference excludes it exactly.
        newest = (a["win_pos"][rows] - 1) % self.recent
        age = (newest[:, None] - np.arange(self.recent)[None, :]) % self.recent
        rs, rn = self._window_counts(rows, self.decay ** age)
        s_ref = np.maximum(a["acc_s"][rows].sum(1) - rs.sum(1), 0.0)
        n_ref = np.maximum(a["acc_n"][rows].sum(1) - rn.sum(1), s_ref)
        g = self.global_rate
        a0 = (s_ref + g)[:, None]
        b0 = (n_ref - s_ref + 1.0 - g)[:, None]
        acc = np.where(valid, m, 0).astype(np.float64)
        rej = (valid & (m < n)).astype(np.float64)
        order = np.argsort(age, axis=1)                 # newest first
        A = np.cumsum(np.take_along_axis(acc, order, 1), 1)
        F = np.cumsum(np.take_along_axis(rej, order, 1), 1)
        steps = np.cumsum(np.take_along_axis(valid, order, 1), 1)
        # The nine log-Gamma terms of the three log-Betas in one call.
        shape = A.shape
        a0w, b0w = np.broadcast_to(a0, shape), np.broadcast_to(b0, shape)
        lg = _lgamma(np.stack([1.0 + A, 1.0 + F, (1.0 + A) + (1.0 + F),
                               a0w + A, b0w + F, (a0w + A) + (b0w + F),
                               a0w, b0w, a0w + b0w]))
        log_bf = ((lg[0] + lg[1] - lg[2]) - (lg[3] + lg[4] - lg[5]) + (lg[6] + lg[7] - lg[8]))
        log_bf = np.where(steps >= 2, log_bf, -np.inf)
        log_bf[:, 0] = -np.inf                          # one step is a fluke
        best = np.argmax(log_bf, axis=1)
        hit = log_bf[np.arange(len(rows)), best] > self.change_threshold
        if hit.any():
            hr = rows[hit]
            keep = (age[hit] <= best[hit, None]).astype(np.float64)
            a["acc_s"][hr], a["acc_n"][hr] = self._window_counts(hr, keep)
            a["win_n"][hr] = 0                          # a fresh detection window
            self.changes += int(hit.sum())
        return hit


def odds_scale(p: np.ndarray, factor: np.ndarray) -> np.ndarray:
    """p with its odds multiplied by ``factor`` (a request's observed /
    expected ratio moves every position's probability the same way in odds,
    never past 0 or 1)."""
    p = np.clip(p, _EPS, 1.0 - _EPS)
    scaled = p * factor
    return scaled / (1.0 - p + scaled)


def _lgamma(x: np.ndarray) -> np.ndarray:
    """log Gamma(x) for x > 0, vectorised (shift by 6, then Stirling; ~1e-10)."""
    x = np.asarray(x, dtype=np.float64)
    shift = np.log(x * (x + 1) * (x + 2) * (x + 3) * (x + 4) * (x + 5))
    z = x + 6.0
    inv = 1.0 / z
    inv2 = inv * inv
    series = inv * (1 / 12 - inv2 * (1 / 360 - inv2 * (1 / 1260 - inv2 / 1680)))
    return (z - 0.5) * np.log(z) - z + 0.5 * math.log(2 * math.pi) + series - shift


class ConfidenceCalibrator:
    """Maps a proposer's raw per-token confidence to an acceptance probability.

    Confidences are bucketed (``calib_bins`` equal bins on [0, 1]). The
    acceptance of kept drafts is counted globally per bucket b and per
    (draft position j, bucket b), slowly decayed, and shrunk position ->
    bucket -> raw confidence; each request then moves it by its own level:

        g_b(c)    = (GS_b + 2 c) / (GN_b + 2)               bucket; prior = raw c
        g_jb(c)   = (GS_jb + 2 g_b(c)) / (GN_jb + 2)        position and bucket
        L_r       = (S_r + 2) / (E_r + 2)                   request level
        cal_rj(c) = g_jb(c) with its odds times L_r

    S_r, E_r: the request's accepted drafts and the sum of g_jb over the same
    drafts when they were decided (decayed, ``calib_half_life``). Outcomes are
    conditional on the drafts before them being accepted, and that makes a
    deep draft with a given confidence more likely right than a first one
    (measured with Token Recycling on Spec-Bench dev): a position-agnostic
    table under-rates deep drafts and cuts chains that pay.

    Outcomes are matched to the confidences of the drafts the controller kept
    last step (stored at ``decide``).
    """

    _STRENGTH = 2.0
    _GLOBAL_HALF_LIFE = 1024.0  # steps

    def __init__(self, slots: RequestSlots, max_draft: int, *, calib_bins: int = 10,
                 calib_half_life: float = 16.0, **_: Any):
        self.slots = slots
        self.depth = max_draft
        self.bins = calib_bins
        self.decay = 0.5 ** (1.0 / calib_half_life)
        self._gdecay = 0.5 ** (1.0 / self._GLOBAL_HALF_LIFE)
        self.gs = np.zeros(calib_bins)
        self.gn = np.zeros(calib_bins)
        self.gps = np.zeros((max_draft, calib_bins))
        self.gpn = np.zeros((max_draft, calib_bins))
        slots.add("cal_s", (), np.float64, 0.0)
        slots.add("cal_e", (), np.float64, 0.0)
        slots.add("conf_kept", (max_draft,), np.float32, np.nan)
        slots.add("conf_seen", (), np.bool_, False)

    def _bin(self, c: np.ndarray) -> np.ndarray:
        return np.clip((np.nan_to_num(c) * self.bins).astype(np.int64), 0, self.bins - 1)

    def remember(self, rows: np.ndarray, conf: np.ndarray | None, keep: np.ndarray,
                 upto: np.ndarray | None = None) -> None:
        """Store the raw confidences of the kept drafts (NaN = none given);
        ``upto`` (default ``keep``) may reach one further, for a cut draft
        whose outcome the next step observes."""
        a = self.slots.arrays
        a["conf_kept"][rows] = np.nan
        if conf is None:
            return
        k = min(conf.shape[1], self.depth)
        upto = keep if upto is None else upto
        kept = np.where(np.arange(k)[None, :] < upto[:, None], conf[:, :k], np.nan)
        a["conf_kept"][rows, :k] = kept
        a["conf_seen"][rows] |= ~np.isnan(conf).all(1)

    def _global(self, j: np.ndarray, c: np.ndarray) -> np.ndarray:
        """g_jb(c) for positions j and confidences c (same shapes)."""
        b = self._bin(c)
        k = self._STRENGTH
        g = (self.gs[b] + k * c) / (self.gn[b] + k)
        return (self.gps[j, b] + k * g) / (self.gpn[j, b] + k)

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray) -> None:
        a = self.slots.arrays
        conf = a["conf_kept"][rows]
        a["conf_kept"][rows] = np.nan  # consumed (or stale) either way
        if len(rows) == 0:
            return
        n = np.minimum(n, self.depth)
        m = np.minimum(m, n)
        obs, acc = _outcome_masks(n, m, self.depth)
        obs &= ~np.isnan(conf)
        if not obs.any():
            return
        has = obs.any(1)
        r_idx, j_idx = np.nonzero(obs)
        c = np.clip(conf[r_idx, j_idx].astype(np.float64), 0.0, 1.0)
        b = self._bin(c)
        x = acc[r_idx, j_idx].astype(np.float64)
        expected = self._global(j_idx, c)          # before this step's outcomes
        self.gs *= self._gdecay
        self.gn *= self._gdecay
        self.gps *= self._gdecay
        self.gpn *= self._gdecay
        nb = self.bins
        self.gs += np.bincount(b, weights=x, minlength=nb)
        self.gn += np.bincount(b, minlength=nb)
        cell = j_idx * nb + b
        self.gps += np.bincount(cell, weights=x, minlength=self.depth * nb
                                ).reshape(self.depth, nb)
        self.gpn += np.bincount(cell, minlength=self.depth * nb).reshape(self.depth, nb)
        hr = rows[has]          # rows of one step are distinct
        a["cal_s"][hr] *= self.decay
        a["cal_e"][hr] *= self.decay
        a["cal_s"][rows] += np.bincount(r_idx, weights=x, minlength=len(rows))
        a["cal_e"][rows] += np.bincount(r_idx, weights=expected, minlength=len(rows))

    def calibrate(self, rows: np.ndarray, conf: np.ndarray) -> np.ndarray:
        """Calibrated probabilities, same shape as ``conf`` (column j = draft
        position j+1); NaN stays NaN."""
        a = self.slots.arrays
        width = min(conf.shape[1], self.depth)
        conf = conf[:, :width]
        c = np.clip(np.nan_to_num(conf.astype(np.float64)), 0.0, 1.0)
        j = np.broadcast_to(np.arange(width)[None, :], c.shape)
        g = self._global(j, c)
        k = self._STRENGTH
        level = (a["cal_s"][rows] + k) / (a["cal_e"][rows] + k)
        out = odds_scale(g, level[:, None])
        return np.where(np.isnan(conf), np.nan, np.clip(out, _EPS, 1.0 - _EPS))

    def table(self) -> list[float]:
        mid = (np.arange(self.bins) + 0.5) / self.bins
        return [round(float(v), 4) for v in (self.gs + self._STRENGTH * mid)
                / (self.gn + self._STRENGTH)]


class PrefixCalibrator:
    """Maps the prefix probability a decision used to how often such prefixes
    were really accepted.

    The goodput rule compares each draft's prefix probability q (P(drafts
    1..j all accepted)) with the break-even tau = b * goodput. q is a product
    of per-position estimates, and the drafts a decision keeps are those
    whose noisy estimates came out high: their realised acceptance falls
    short of q (winner's curse), so at large batch the rule kept drafts that
    did not pay. Here the q of every kept draft and of the first cut one is
    stored at ``decide``; next step the prefix outcome of each is known (a
    prefix fails at the first rejection; the cut draft's outcome is read as
    in ``_observe_cut``). Per log-spaced bucket of q, decayed sums of
    outcomes S_b and of predictions E_b give the correction

        q_cal = q * (S_b + k) / (E_b + k)        k = 2 pseudo-drafts

    made non-increasing along the draft again, and clipped to [_EPS, 1 - _EPS].
    """

    EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    _STRENGTH = 2.0
    _HALF_LIFE = 256.0   # steps

    def __init__(self, slots: RequestSlots, max_draft: int):
        self.slots = slots
        self.depth = max_draft
        nb = len(self.EDGES) + 1
        self.s = np.zeros(nb)
        self.e = np.zeros(nb)
        self._decay = 0.5 ** (1.0 / self._HALF_LIFE)
        slots.add("q_used", (max_draft,), np.float64, np.nan)

    def factor(self, q: np.ndarray) -> np.ndarray:
        b = np.searchsorted(self.EDGES, q)
        k = self._STRENGTH
        return (self.s[b] + k) / (self.e[b] + k)

    def apply(self, q: np.ndarray) -> np.ndarray:
        out = np.clip(q * self.factor(q), _EPS, 1.0 - _EPS)
        return np.minimum.accumulate(out, axis=1)

    def remember(self, rows: np.ndarray, q: np.ndarray, upto: np.ndarray) -> None:
        """Store the raw q of positions < upto (kept drafts, plus the first
        cut one when its outcome will be observed)."""
        a = self.slots.arrays
        a["q_used"][rows] = np.nan
        w = min(q.shape[1], self.depth)
        a["q_used"][rows, :w] = np.where(np.arange(w)[None, :] < upto[:, None],
                                         q[:, :w], np.nan)

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray) -> None:
        """Rows verified this step: n observed positions (the cut one
        included when observed), of which the first m accepted."""
        a = self.slots.arrays
        q = a["q_used"][rows]
        a["q_used"][rows] = np.nan
        if len(rows) == 0:
            return
        j = np.arange(self.depth)[None, :]
        # A prefix longer than the accepted run failed, whether or not its
        # own draft was verified; the cut draft counts only where observed.
        seen = ~np.isnan(q) & ((j < n[:, None]) | (m[:, None] < n[:, None]))
        if not seen.any():
            return
        x = (j < m[:, None])[seen].astype(np.float64)
        qs = q[seen].astype(np.float64)
        b = np.searchsorted(self.EDGES, qs)
        nb = len(self.s)
        self.s = self._decay * self.s + np.bincount(b, weights=x, minlength=nb)
        self.e = self._decay * self.e + np.bincount(b, weights=qs, minlength=nb)

    def table(self) -> list[float]:
        k = self._STRENGTH
        return [round(float(v), 3) for v in (self.s + k) / (self.e + k)]


# --------------------------------------------------------------------------
# step-time cost model
# --------------------------------------------------------------------------

class StepCostModel:
    """Engine step time as a linear function, fitted online.

        t(step) ~= a + b * tokens (+ c * batch) (+ d * verifies) (+ e * cold),
                   a..e >= 0

    Two step-level terms (docs/draft_length.md):

    - ``verifies`` is 1 for a step that verified at least one draft: vLLM's
      speculative path costs a fixed extra beyond the line through steps
      with drafts (fitted between 0 and 28 ms in the issue-3 benchmark
      runs on the CPU default: the controller tables of docs/benchmarks.md).
    - ``cold`` is 1 for a step whose token count was not among the last
      ``shape_cache`` distinct counts. vLLM's CPU linear layers build a
      oneDNN kernel per token count and keep 32 per layer
      (``python -m vllm_plugins.bench.kernel_sizes`` measures a first call
      against a cached one). A rule blind to this spreads the step's token
      count over many values and pays it again and again (a GPU with CUDA
      graphs has the same kind of cost for sizes off its captured set).

    Fitted by least squares over the last ``window`` (tokens, batch,
    verifies, cold, seconds) observations (a ring buffer), with one round of
    outlier rejection (|residual| > 5 robust sigmas) and a non-negativity
    constraint (the best non-negative subset fit). ``batch`` is dropped when
    it does not vary independently of ``tokens`` in the window; ``verifies``
    and ``cold`` while fewer than ``_MIN_MODE_STEPS`` steps of either kind
    are in it (each then keeps its last estimate: it is a property of the
    runtime, and once the rule avoids such steps they become rare).
    Before ``warmup`` observations with at least two distinct token counts,
    the prior is used:

        t ~= 1 + prior_token_cost * tokens     (unitless; nearly flat)

    Only ratios of times matter to the goodput rule, so the prior has no units.
    Once warm, the fit is refreshed every 4 observations.
    """

    _REFIT_EVERY = 4
    _MIN_MODE_STEPS = 4

    def __init__(self, *, cost_features: str = "tokens+batch", cost_window: int = 256,
                 warmup: int = 16, prior_token_cost: float = 0.001,
                 switch_cost: bool = True, shape_cache: int = 32, **_: Any):
        self.use_batch = cost_features == "tokens+batch"
        self.use_switch = switch_cost
        self.use_shape = shape_cache > 0
        self.window = cost_window
        self.warmup = warmup
        self.prior_token_cost = prior_token_cost
        self._x = np.zeros((cost_window, 4))   # tokens, batch, verifies, cold
        self._y = np.zeros(cost_window)
        self._len = 0
        self._pos = 0
        self.num_observed = 0
        self._dirty = False
        self._coef = (1.0, prior_token_cost, 0.0)
        self.switch_s = 0.0            # d: extra fixed cost of a verifying step
        self.cold_s = 0.0              # e: extra cost of a step with a new token count
        self._warm = False
        self._rmse = float("nan")
        self._outliers = 0
        self._fitted_at = 0
        self.slope_se = float("inf")   # standard error of b (s/token)

    def observe(self, tokens: float, batch: float, seconds: float,
                verifies: bool = True, cold: bool = False) -> None:
        if not (seconds and seconds > 0 and math.isfinite(seconds) and tokens > 0):
            return
        self._x[self._pos] = (tokens, batch, float(verifies), float(cold))
        self._y[self._pos] = seconds
        self._pos = (self._pos + 1) % self.window
        self._len = min(self._len + 1, self.window)
        self.num_observed += 1
        self._dirty = True

    @property
    def warm(self) -> bool:
        self._refit()
        return self._warm

    def needs_idle_step(self) -> bool:
        """Whether the window holds too few steps without a verification to
        tell the verify-step cost ``d`` apart from the intercept."""
        if not self.use_switch:
            return False
        idle = int(self._len - self._x[:self._len, 2].sum())
        return idle < self._MIN_MODE_STEPS

    def line(self, batch: int) -> tuple[float, float]:
        """(intercept, slope) of t(tokens) for a step of ``batch`` requests
        that verifies no draft; one that does costs ``switch_s`` more."""
        self._refit()
        a, b, c = self._coef
        return a + c * batch, b

    def predict(self, tokens: float, batch: float) -> float:
        a, b = self.line(int(batch))
        return a + b * tokens

    def coefficients(self) -> dict:
        self._refit()
        a, b, c = self._coef
        return {"intercept_s": a, "per_token_s": b, "per_request_s": c,
                "verify_step_s": self.switch_s, "new_shape_s": self.cold_s,
                "warm": self._warm, "observations": self.num_observed,
                "window": self._len,
                "rmse_s": None if math.isnan(self._rmse) else self._rmse,
                "outliers_dropped": self._outliers,
                "per_token_se_s": None if not math.isfinite(self.slope_se)
                else self.slope_se,
                "prior": None if self._warm else
                f"t = 1 + {self.prior_token_cost} * tokens (unitless)"}

    def _refit(self) -> None:
        if not self._dirty:
            return
        if self._warm and self.num_observed - self._fitted_at < self._REFIT_EVERY:
            return
        self._dirty = False
        self._fitted_at = self.num_observed
        n = self._len
        if n < self.warmup:
            return
        tok, bat, y = self._x[:n, 0], self._x[:n, 1], self._y[:n]
        if np.ptp(tok) <= 0:
            return  # one token count: the slope is not identifiable yet
        cols = [np.ones(n), tok]
        names = ["a", "b"]
        if self.use_batch and _independent(tok, bat):
            cols.append(bat)
            names.append("c")
        y = y.copy()
        for col, name, used in ((2, "d", self.use_switch), (3, "e", self.use_shape)):
            flag = self._x[:n, col]
            ones = int(flag.sum())
            if used and min(ones, n - ones) >= self._MIN_MODE_STEPS and _independent(tok, flag):
                cols.append(flag)
                names.append(name)
            else:
                # Too few steps of one kind to fit it: the last estimate
                # stands, and the few flagged steps are corrected by it
                # rather than pulling the line (a long rest leaves a window
                # of idle steps with a handful of verifying ones).
                y -= flag * (self.switch_s if name == "d" else self.cold_s)
        x = np.stack(cols, 1)
        coef = self._nnls(x, y)
        resid = y - x @ coef
        mad = np.median(np.abs(resid - np.median(resid)))
        keep = np.abs(resid) <= 5.0 * 1.4826 * mad + 1e-12 * max(float(y.mean()), 1e-12)
        self._outliers = int(n - keep.sum())
        if 0 < self._outliers and keep.sum() >= max(3, x.shape[1] + 1):
            coef = self._nnls(x[keep], y[keep])
            resid = y[keep] - x[keep] @ coef
        self._rmse = float(np.sqrt(np.mean(resid ** 2)))
        xk = x[keep] if 0 < self._outliers and keep.sum() >= x.shape[1] + 1 else x
        dof = max(len(xk) - xk.shape[1], 1)
        try:
            cov = np.linalg.inv(xk.T @ xk) * float(np.sum(resid ** 2)) / dof
            self.slope_se = float(np.sqrt(max(cov[1, 1], 0.0)))
        except np.linalg.LinAlgError:
            self.slope_se = float("inf")
        got = dict(zip(names, (float(v) for v in coef)))
        self._coef = (got["a"], got["b"], got.get("c", 0.0))
        self.switch_s = got.get("d", self.switch_s)
        self.cold_s = got.get("e", self.cold_s)
        self._warm = True

    @staticmethod
    def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Least squares with all coefficients >= 0, exact: the non-negative
        optimum is the plain fit on its own support, so the best of the
        plain fits on every subset of the <= 5 columns that come out
        non-negative is it. All subsets are solved at once on the p x p
        normal equations of max-scaled columns (SSE = y.y - c.h): one pass
        over the window, then one batched p x p solve (one ``lstsq`` per
        subset was a third of the controller's time)."""
        scale = np.maximum(np.abs(x).max(0), 1e-12)
        xs = x / scale
        g, h = xs.T @ xs, xs.T @ y
        masks = _subset_masks(x.shape[1])                 # [S, p]
        pair = masks[:, :, None] & masks[:, None, :]
        eye = np.eye(len(h), dtype=bool)[None] & ~masks[:, None, :]
        try:
            c = np.linalg.solve(np.where(pair, g, 0.0) + eye,
                                np.where(masks, h, 0.0)[..., None])[..., 0]
        except np.linalg.LinAlgError:   # a rank-deficient subset
            c = np.stack([_subset_lstsq(xs, y, m) for m in masks])
        gain = np.where((c >= 0).all(1), c @ h, -np.inf)
        best = int(np.argmax(gain))
        if not gain[best] > 0:          # no column helps: all zero
            return np.zeros(len(h))
        return c[best] / scale


def _subset_masks(p: int) -> np.ndarray:
    """Every non-empty subset of p columns, as rows of a bool mask, in
    binary order (the larger subsets of a tie come later)."""
    masks = _SUBSET_MASKS.get(p)
    if masks is None:
        bits = np.arange(1, 2 ** p)[:, None] >> np.arange(p)[None, :]
        masks = _SUBSET_MASKS[p] = (bits & 1).astype(bool)
    return masks


_SUBSET_MASKS: dict[int, np.ndarray] = {}


def _subset_lstsq(xs: np.ndarray, y: np.ndarray, mask: np.ndarray) -> np.ndarray:
    c = np.zeros(len(mask))
    c[mask] = np.linalg.lstsq(xs[:, mask], y, rcond=None)[0]
    return c


class RecentSizes:
    """The last ``capacity`` distinct token counts of engine steps, least
    recently used first: the counts whose kernels the runtime still holds
    (vLLM's CPU linear layers keep 32 per layer)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._recent: dict[int, None] = {}   # insertion order = recency

    def touch(self, tokens: int) -> bool:
        """Record a step of ``tokens`` tokens; True if the count was new."""
        if self.capacity <= 0:
            return False
        tokens = int(tokens)
        new = self._recent.pop(tokens, True) is True
        self._recent[tokens] = None
        if len(self._recent) > self.capacity:
            del self._recent[next(iter(self._recent))]
        return new

    def array(self) -> np.ndarray | None:
        if self.capacity <= 0:
            return None
        return np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))


def _independent(tok: np.ndarray, other: np.ndarray) -> bool:
    """Whether ``other`` varies, and not in lockstep with ``tok``."""
    if np.ptp(other) <= 0:
        return False
    corr = np.corrcoef(tok, other)[0, 1]
    return bool(np.isfinite(corr) and abs(corr) < 0.98)


# --------------------------------------------------------------------------
# controllers
# --------------------------------------------------------------------------

class DraftLengthController:
    """Base: bookkeeping shared by every policy.

    ``observe(ctx)`` once per step before ``decide(ctx, drafts)``; ``decide``
    returns per request (batch order) how many drafts to keep,
    0 <= keep[i] <= min(len(drafts.tokens[i]), max_draft).
    """

    name = "base"
    # Set by the proposer: whether it may skip whole steps (PluginProposer.CAN_REST).
    can_rest = False
    # This step rests: the proposer skips drafting and learning.
    resting = False

    @property
    def rests_next_step(self) -> bool:
        """Already decided: the next step rests (the bridge skips its top-k)."""
        return False

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
        self._zero_bound: set[str] = set()   # max_length() returned 0 this step
        self._bound_mask = np.zeros(0, dtype=bool)
        self._bounds: dict[str, int] | None = None   # this step's max_length per request

    # -------------------------------------------------------------- public
    def observe(self, ctx: StepContext) -> None:
        for rid in ctx.finished:
            self.free(rid)
        self.steps += 1
        self._observe(ctx)
        self._bounds = self._step_bounds(ctx)

    def decide(self, ctx: StepContext, drafts: Drafts) -> list[int]:
        lengths = np.fromiter((min(len(t), self.max_draft) for t in drafts.tokens),
                              dtype=np.int64, count=len(drafts.tokens))
        self.last_offered = False
        if len(lengths) == 0:
            return []
        # Requests with no draft because max_length() said 0: the controller's
        # own zero choice, made before drafting (counted as such, and they
        # move towards a probe like any zero choice).
        self._bound_mask = np.zeros(len(lengths), dtype=bool)
        if self._zero_bound:
            self._bound_mask = (lengths == 0) & np.fromiter(
                (r.req_id in self._zero_bound for r in ctx.requests[:len(lengths)]),
                dtype=bool, count=min(len(lengths), len(ctx.requests)))
            self._zero_bound = set()
        keep = self._decide(ctx, drafts, lengths)
        keep = np.clip(keep, 0, lengths)
        offered = lengths > 0
        self.last_offered = bool(offered.any())
        bound = self._bound_mask
        self.no_draft += int((~offered & ~bound).sum())
        self.decisions += int((offered | bound).sum())
        self.zero_choices += int(((offered & (keep == 0)) | bound).sum())
        self.hist += np.bincount(keep[offered | bound], minlength=self.max_draft + 1)
        return [int(k) for k in keep]

    def max_length(self, req_id: str) -> int:
        """Upper bound on what ``decide`` will keep for this request this step."""
        return self.max_draft

    def _step_bounds(self, ctx: StepContext) -> dict[str, int] | None:
        """``max_length`` of every request of the step, all at once (None:
        ask per request). Drafting asks once per request; at batch 16 the
        scalar path was a quarter of the controller's time."""
        return None

    def free(self, req_id: str) -> None:
        self.slots.release(req_id)

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

    # ----------------------------------------------------------- for policies
    def _observe(self, ctx: StepContext) -> None:
        pass

    def _decide(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray) -> np.ndarray:
        return lengths


class FixedController(DraftLengthController):
    """Keep every draft."""

    name = "fixed"


class _EstimatingController(DraftLengthController):
    """Shared by acceptance / confidence / goodput: estimates, probing, confidence."""

    uses_confidence = False

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
        self.prefix = (PrefixCalibrator(self.slots, max_draft)
                       if options.get("calibrate_prefix") else None)
        self._probe_scale = 1     # goodput stretches probing where drafts are dear
        self._batch_hint = 1

    def _observe(self, ctx: StepContext) -> None:
        reqs = ctx.requests
        self._batch_hint = max(1, len(reqs))
        if not reqs:
            return
        rows = self.slots.slots([r.req_id for r in reqs])
        self._rows_for = (ctx, rows)   # decide() on the same ctx reuses them
        emitted = np.array([len(r.accepted) for r in reqs], dtype=np.int64)
        n = np.array([r.num_draft for r in reqs], dtype=np.int64)
        n = np.where(emitted > 0, n, 0)
        m = np.minimum(np.maximum(emitted - 1, 0), n)
        n, m = self._observe_cut(reqs, rows, emitted, n, m)
        if self.prefix is not None:
            self.prefix.observe(rows, n, m)
        verified = n > 0
        self.estimator.observe(rows[verified], n[verified], m[verified])
        a = self.slots.arrays
        probed = a["probing"][rows] & verified
        if probed.any():
            pr = rows[probed]
            a["probe_level"][pr] = np.where(m[probed] > 0, 0, a["probe_level"][pr] + 1)
        a["probing"][rows] = False
        if self.calibrator is not None:
            self.calibrator.observe(rows, n, m)

    def _observe_cut(self, reqs, rows, emitted, n, m):
        """Learn the outcome of the first draft cut last step, for free.

        When every kept draft was accepted, the target sampled its own token
        at the cut draft's position. For a deterministic draft token x,
        vLLM's rejection sampler accepts with probability p_target(x), and
        the sampled token equals x with the same probability, so
        [sampled == x] is an exact draw of "the cut draft would have been
        accepted" (greedy: exactly its outcome). Without it, a position the
        controller cuts is never observed again and an under-estimate there
        cannot correct itself; with it, even a request kept at k = 0 learns
        its first-draft acceptance every step. Returns (n, m) with the
        observed cut position added.
        """
        a = self.slots.arrays
        cut_token = a["cut_token"][rows].copy()
        cut_at = a["cut_at"][rows].copy()
        a["cut_token"][rows] = -1
        if not self.observe_cut:
            return n, m
        peek = (cut_token >= 0) & (emitted > 0) & (m == n) & (cut_at == n)
        if not peek.any():
            return n, m
        last = np.array([int(r.accepted[-1]) if len(r.accepted) else -1 for r in reqs],
                        dtype=np.int64)
        hit = peek & (last == cut_token)
        self.cut_observed += int(peek.sum())
        return n + peek, m + hit

    def _remember_cut(self, rows, drafts: Drafts, lengths: np.ndarray,
                      keep: np.ndarray, observable: np.ndarray) -> np.ndarray:
        """Store the first cut draft of each ``observable`` row (see
        ``_cut_observable``); returns the rows that have one."""
        cut = (keep < lengths) & observable
        a = self.slots.arrays
        idx = np.nonzero(cut)[0]
        if len(idx):
            a["cut_token"][rows[idx]] = [int(drafts.tokens[i][keep[i]]) for i in idx]
            a["cut_at"][rows[idx]] = keep[idx]
        return cut

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

    def _position_probs(self, rows: np.ndarray, drafts: Drafts,
                        width: int) -> tuple[np.ndarray, np.ndarray | None]:
        cached, self._probs_for = getattr(self, "_probs_for", None), None
        if cached is not None and cached[0] is rows:
            p = cached[1][:, :width]   # the estimate has not moved since observe
        else:
            p = self.estimator.probs(rows)[:, :width]
        conf = self._confidence_matrix(drafts, width)
        if conf is not None:
            cal = self.calibrator.calibrate(rows, conf)
            p = np.where(np.isnan(cal), p, cal)
        return p, conf

    def _decide(self, ctx: StepContext, drafts: Drafts, lengths: np.ndarray) -> np.ndarray:
        if len(ctx.requests) != len(lengths):
            raise ValueError(f"drafts has {len(lengths)} rows for a batch of "
                             f"{len(ctx.requests)} requests")
        cached = getattr(self, "_rows_for", None)
        if cached is not None and cached[0] is ctx:
            rows = cached[1]
        else:
            rows = self.slots.slots([r.req_id for r in ctx.requests])
        self._rows_for = None
        width = int(lengths.max())
        if width == 0:   # nothing offered (e.g. max_length said 0 to all)
            keep = self._probe(rows, lengths, np.zeros(len(lengths), np.int64))
            if self.calibrator is not None:
                self.calibrator.remember(rows, None, keep)
            return np.minimum(keep, lengths)
        p, conf = self._position_probs(rows, drafts, width)
        q = np.cumprod(p, axis=1)   # prefix probabilities: P(drafts 1..j accepted)
        valid = np.arange(width)[None, :] < lengths[:, None]
        q_raw = q
        if self.prefix is not None:
            q = self.prefix.apply(q)
        keep = self._choose(rows, lengths, q, valid, ctx)
        observable = self._cut_observable(drafts, lengths)
        keep = self._probe(rows, lengths, keep, observable)
        keep = np.minimum(keep, lengths)
        cut = self._remember_cut(rows, drafts, lengths, keep, observable)
        if self.prefix is not None:
            self.prefix.remember(rows, q_raw, keep + cut)
        if self.calibrator is not None:
            self.calibrator.remember(rows, conf, keep, keep + cut)
        return keep

    def _cut_observable(self, drafts: Drafts, lengths: np.ndarray) -> np.ndarray:
        """Rows whose cut draft the next step observes: deterministic drafts
        with observe_cut on. Rows with draft probabilities (stochastic
        drafts) are left out: their acceptance is min(1, p/q), which the
        sampled token does not show. An observable zero choice still
        teaches, so it needs no probe."""
        ok = (lengths > 0) & self.observe_cut
        if drafts.probs is not None:
            ok &= np.array([drafts.probs[i] is None if i < len(drafts.probs) else True
                            for i in range(len(lengths))], dtype=bool)
        return ok

    _MAX_BACKOFF = 1  # a failed probe doubles the probe interval (once)

    def _probe_gap(self, rows: np.ndarray) -> np.ndarray:
        level = np.minimum(self.slots.arrays["probe_level"][rows], self._MAX_BACKOFF)
        return (self.probe_interval * self._probe_scale) << level

    def _probe(self, rows: np.ndarray, lengths: np.ndarray, keep: np.ndarray,
               observed: np.ndarray | bool = False) -> np.ndarray:
        """After probe_interval consecutive zeros keep one token, to re-learn.

        A failed probe doubles the interval (once: up to 2x); an accepted probe,
        or a non-zero choice, resets it. Rows in ``observed`` learn their
        first draft's outcome without verifying it (``_observe_cut``) and
        are not probed.
        """
        a = self.slots.arrays
        zs = a["zero_streak"]
        offered = lengths > 0
        bound = self._bound_mask if len(self._bound_mask) == len(rows) else False
        zero = (offered & (keep == 0)) | bound
        a["probe_level"][rows[offered & (keep > 0)]] = 0
        if self.probe_interval > 0 and self._probe_scale > 0:
            due = zero & offered & ~observed & (zs[rows] >= self._probe_gap(rows))
            if due.any():
                keep = keep.copy()
                keep[due] = 1
                a["probing"][rows[due]] = True
                self.probes += int(due.sum())
                zero = zero & ~due
        zs[rows] = np.where(zero, zs[rows] + 1, np.where(offered, 0, zs[rows]))
        return keep

    def _probe_due(self, slot: int) -> bool:
        if self.probe_interval <= 0 or self._probe_scale <= 0:
            return False
        gap = int(self._probe_gap(np.array([slot]))[0])
        return bool(self.slots.arrays["zero_streak"][slot] >= gap)

    def _choose(self, rows, lengths, q, valid, ctx) -> np.ndarray:
        raise NotImplementedError

    @staticmethod
    def _history_bounds(probs: np.ndarray, threshold: float) -> np.ndarray:
        """Per row, how many leading drafts have a prefix probability above
        ``threshold`` by the request's history."""
        return (np.cumprod(probs, axis=1) > threshold).sum(1)

    def _length_bounds(self, probs: np.ndarray) -> np.ndarray:
        """The policy's bound on kept drafts, per row of probabilities."""
        return np.full(len(probs), self.max_draft, dtype=np.int64)

    def _length_bound(self, slot: int) -> int:
        return int(self._length_bounds(self.estimator.probs(np.array([slot])))[0])

    def _step_bounds(self, ctx: StepContext) -> dict[str, int] | None:
        cached = getattr(self, "_rows_for", None)
        if not ctx.requests or cached is None or cached[0] is not ctx:
            return None
        rows = cached[1]
        probs = self.estimator.probs(rows)
        self._probs_for = (rows, probs)   # decide() on this step reuses them
        bound = self._length_bounds(probs)
        if self.probe_interval > 0 and self._probe_scale > 0:
            due = self.slots.arrays["zero_streak"][rows] >= self._probe_gap(rows)
            bound = np.where(due, np.maximum(bound, 1), bound)
        bound = np.clip(bound, 0, self.max_draft)
        if self.calibrator is not None:
            bound = np.where(self.slots.arrays["conf_seen"][rows], self.max_draft, bound)
        return dict(zip((r.req_id for r in ctx.requests), bound.tolist()))

    def max_length(self, req_id: str) -> int:
        bounds = self._bounds
        if bounds is not None and req_id in bounds:
            bound = bounds[req_id]
            if bound == 0:
                self._zero_bound.add(req_id)
            return bound
        slot = self.slots.get(req_id)
        if slot is None:
            return self.max_draft
        if self.calibrator is not None and self.slots.arrays["conf_seen"][slot]:
            return self.max_draft  # confidences only arrive with the drafts
        bound = self._length_bound(slot)
        if self._probe_due(slot):
            bound = max(bound, 1)
        bound = int(min(max(bound, 0), self.max_draft))
        if bound == 0:
            self._zero_bound.add(req_id)
        return bound

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


class AcceptanceController(_EstimatingController):
    """Smallest k reaching ``target_fraction`` of the achievable expected
    accepted length, never keeping a token whose prefix acceptance probability
    is below ``min_prob``."""

    name = "acceptance"

    def _choose(self, rows, lengths, q, valid, ctx) -> np.ndarray:
        qv = np.where(valid, q, 0.0)
        expected = np.cumsum(qv, axis=1)                       # E[A(k)], k = 1..K
        total = expected[np.arange(len(lengths)), np.maximum(lengths - 1, 0)]
        total = np.where(lengths > 0, total, 0.0)
        goal = self.options["target_fraction"] * total
        reached = valid & (expected >= goal[:, None] - 1e-12)
        k_frac = np.where(reached.any(1), reached.argmax(1) + 1, lengths)
        k_prob = (valid & (q >= self.options["min_prob"])).sum(1)
        return np.minimum(k_frac, k_prob)

    def _length_bounds(self, probs: np.ndarray) -> np.ndarray:
        return self._history_bounds(probs, self.options["min_prob"] - 1e-12)


class ConfidenceController(_EstimatingController):
    """Keep drafting while P(all kept drafts accepted) >= ``threshold``."""

    name = "confidence"
    uses_confidence = True

    def _choose(self, rows, lengths, q, valid, ctx) -> np.ndarray:
        return (valid & (q >= self.options["threshold"])).sum(1)

    def _length_bounds(self, probs: np.ndarray) -> np.ndarray:
        return self._history_bounds(probs, self.options["threshold"] - 1e-12)


def goodput_allocation(q: np.ndarray, valid: np.ndarray, intercept: float,
                       slope: float, switch: float = 0.0, cold: float = 0.0,
                       warm_tokens: np.ndarray | None = None
                       ) -> tuple[np.ndarray, float, float]:
    """Per-row k maximising (B + sum_i sum_{j<k_i} q_ij) / t(N), where
    t(N) = intercept + slope * N, plus ``switch`` when any k_i > 0, plus
    ``cold`` when N is not in ``warm_tokens`` (None: every N is warm).

    ``q[i, j]``: probability that drafts 1..j+1 of row i are all accepted
    (non-increasing in j); ``valid`` marks offered drafts; N = sum_i (1 + k_i)
    is the step's token count and B the number of rows. Greedy marginal
    allocation, exact here: for a given count M of kept drafts the best are
    the M largest q (ties: earlier position first, so each row keeps a
    prefix), and the best M is chosen with the switch cost in every M > 0.
    Returns (k per row, expected goodput, expected generated tokens).
    """
    batch = q.shape[0]
    r_idx, j_idx = np.nonzero(valid)
    gain = q[r_idx, j_idx]
    order = np.lexsort((j_idx, -gain))   # by gain desc, then position asc
    cum = np.concatenate([[0.0], np.cumsum(gain[order])])
    m = np.arange(len(cum))
    cost = intercept + slope * (batch + m) + np.where(m > 0, switch, 0.0)
    if warm_tokens is not None and cold > 0:
        cost = cost + np.where(np.isin(batch + m, warm_tokens), 0.0, cold)
    goodput = (batch + cum) / np.maximum(cost, 1e-300)
    best = int(np.argmax(goodput))
    keep = np.bincount(r_idx[order[:best]], minlength=batch).astype(np.int64)
    return keep, float(goodput[best]), float(batch + cum[best])


class ModeRates:
    """Realised tokens per second of resting and of awake steps, per batch
    size (exact up to 64, then per power of two).

    The goodput rule predicts from a model of the step; this measures. Costs
    the model does not see (the top-k extraction, the proposer's Python, a
    kernel the runtime rebuilds for a new token count, host effects) all land
    in the awake rate, so "rest is faster here" is read from the engine, not
    derived. A step's seconds are its forward and sampling plus its
    proposer's own time; its tokens are what its requests emitted.
    """

    _HALF_LIFE = 64.0     # observations of the same (mode, batch) cell
    _CELLS = 72

    def __init__(self):
        self.tokens = np.zeros((2, self._CELLS))
        self.seconds = np.zeros((2, self._CELLS))
        self.count = np.zeros((2, self._CELLS))
        # Awake steps: the tokens the rule's prediction promised in the same time.
        self.promised = np.zeros(self._CELLS)
        # Our own seconds per step (top-k extraction and proposer), per mode:
        # reported, not decided on (docs/draft_length.md says why).
        self.own = np.zeros((2, self._CELLS))
        self.own_count = np.zeros((2, self._CELLS))
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
        of them spent on our work, and on an awake step the rule's
        predicted rate."""
        m, c = int(not resting), self.cell(batch)
        d = self._decay
        if own_seconds >= 0 and math.isfinite(own_seconds):
            self.own[m, c] = d * self.own[m, c] + own_seconds
            self.own_count[m, c] = d * self.own_count[m, c] + 1.0
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        if m == 1:
            if not math.isfinite(predicted_rate):
                return   # an awake step without a prediction teaches no bias
            self.promised[c] = d * self.promised[c] + predicted_rate * seconds
        self.tokens[m, c] = d * self.tokens[m, c] + tokens
        self.seconds[m, c] = d * self.seconds[m, c] + seconds
        self.count[m, c] = d * self.count[m, c] + 1.0

    def bias(self, batch: int) -> float:
        """Delivered / promised tokens of awake steps at this batch size."""
        c = self.cell(batch)
        return float(self.tokens[1, c] / self.promised[c]) if self.promised[c] > 0 else 1.0

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
        r = self.tokens[:, c] / np.maximum(self.seconds[:, c], 1e-12)
        return float(r[0]), float(r[1]), float(self.count[0, c]), float(self.count[1, c])

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


def _step_tokens(ctx: StepContext) -> tuple[int, int]:
    """(tokens the step ran, tokens its decoding rows account for: one per
    request plus its verified drafts). More run than accounted for means
    the step ran prompt tokens too."""
    decode = sum((r.num_draft if len(r.accepted) else 0) + 1 for r in ctx.requests)
    return ctx.last_step_tokens or decode, decode


def _engine_gap(ctx: StepContext) -> float:
    """The engine's seconds between our previous proposal and the step
    (scheduling, output handling). A gap longer than the step itself is an
    idle engine waiting for requests, not work: counted as none."""
    gap, step = ctx.last_gap_seconds, ctx.last_step_seconds
    if gap is None or step is None or not (0.0 <= gap <= step):
        return 0.0
    return float(gap)


class GoodputController(_EstimatingController):
    """SmartSpec: maximise (sum_i E[1 + accepted_i(k_i)]) / t(batch, sum_i (1 + k_i)).

    With t linear in tokens plus step-level terms (``StepCostModel``) and
    prefix probabilities non-increasing in j, the allocation is exact: sort
    all candidate tokens by prefix probability q_ij, and take the best count
    M of that order (``goodput_allocation``). Where drafting does not pay,
    a proposer that allows it rests (no top-k, no learning, no drafting),
    decided from measured rates (``ModeRates``) as well as the model.
    """

    name = "goodput"

    # Resting: after _REST_AFTER steps in a row that kept no draft, the next
    # _REST_MIN steps skip the proposer entirely; each rest that follows
    # straight on the previous one doubles, up to _REST_MAX steps.
    _REST_AFTER = 3
    _REST_MIN = 4
    _REST_MAX = 32

    def __init__(self, max_draft: int, options: dict):
        self.uses_confidence = bool(options["use_confidence"])
        super().__init__(max_draft, options)
        self.cost = StepCostModel(**options)
        self.sizes = RecentSizes(options["shape_cache"])
        self.rng = np.random.default_rng(options["seed"])
        self._explore_cap: int | None = None
        self.explore_steps = 0
        self.last_expected_goodput = float("nan")
        self.last_expected_tokens = float("nan")
        self._zero_run = 0            # steps in a row that kept no draft
        self._rest_left = 0           # steps still to rest
        self._rest_len = self._REST_MIN
        self._rest_ids: frozenset = frozenset()   # the batch when the rest began
        self.rest_steps = 0
        self._idle_probe_at = -self._IDLE_PROBE_GAP
        self.idle_probes = 0
        self.modes = ModeRates()
        self._step_record: tuple | None = None
        self._promised = float("nan")  # predicted rate of the drafts just decided
        self._rest_now = False        # the mode comparison says: rest from here
        self._awake_since = 0         # step the current awake stretch began
        self.rest_probes = 0
        self.gap_s: float | None = None   # mean engine time around the runner

    # ----------------------------------------------------------------- rest
    @property
    def rests_next_step(self) -> bool:
        return self._rest_left > 0

    def observe(self, ctx: StepContext) -> None:
        self._record_mode(ctx)
        was_resting = self.resting
        self.resting = False
        if self._rest_left > 0:
            self._rest_left -= 1
            # Half the batch gone, or half of it new, changes what a draft
            # is worth: decide again. (At batch 1, every new request: the
            # last one's worthless drafts say nothing of the next one's.)
            joined = sum(r.req_id not in self._rest_ids for r in ctx.requests)
            if 2 * len(ctx.requests) > len(self._rest_ids) and 2 * joined < len(ctx.requests):
                self.resting = True
                self._bounds = None
                self._observe_resting(ctx)
                self._step_record = self._mode_record(ctx, True, float("nan"))
                self._promised = float("nan")
                return
            self._rest_left = 0
        if was_resting:
            self._awake_since = self.steps
        # This step verified what the previous decision kept: its prediction.
        self._step_record = self._mode_record(ctx, False, self._promised)
        self._promised = float("nan")
        super().observe(ctx)

    @staticmethod
    def _mode_record(ctx: StepContext, resting: bool, predicted: float) -> tuple | None:
        """What ``ModeRates`` learns from this step once its proposer time
        is known; None for a step that ran prompt tokens. A prefill costs
        what its prompt costs, in either mode, and emits next to nothing:
        in flight, where requests join all the time, such steps put a
        measured "awake" rate of 11 tok/s against 112 resting at batch 6
        (docs/benchmarks.md, issue 3, run v16)."""
        tokens, decode = _step_tokens(ctx)
        if tokens > decode:
            return None
        emitted = float(sum(len(r.accepted) for r in ctx.requests))
        return (resting, len(ctx.requests), emitted, float(ctx.last_step_seconds or 0.0),
                predicted, ctx.last_topk_seconds)

    def _record_mode(self, ctx: StepContext) -> None:
        """Close the previous step's record: its proposer time arrives now.
        Our own work in it: the top-k extraction of its forward, and the
        proposer call that followed."""
        rec, self._step_record = self._step_record, None
        if rec is None or not rec[1]:
            return
        resting, batch, tokens, seconds, promised, topk = rec
        propose = ctx.last_propose_seconds
        own = float("nan") if propose is None else propose + (topk or 0.0)
        if seconds:
            self.modes.observe(resting, batch, tokens, seconds + (propose or 0.0),
                               promised, own_seconds=own)

    def _observe_resting(self, ctx: StepContext) -> None:
        """A resting step: bookkeeping only. No draft was verified (the step
        before kept none), so there is nothing to learn but the step's time;
        per-request state that waits for a verification is dropped."""
        for rid in ctx.finished:
            self.free(rid)
        self.steps += 1
        self.rest_steps += 1
        self._observe_cost(ctx)
        if ctx.requests:
            rows = self.slots.slots([r.req_id for r in ctx.requests])
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

    def decide(self, ctx: StepContext, drafts: Drafts) -> list[int]:
        if self.resting:   # the proposer does not ask; keep nothing if it does
            return [0] * len(drafts.tokens)
        keep = super().decide(ctx, drafts)
        self._after_decide(ctx, keep)
        return keep

    @property
    def _may_rest(self) -> bool:
        return self.can_rest and self.options["rest"] and self.cost.warm

    def _after_decide(self, ctx: StepContext, keep: list[int]) -> None:
        rest_now, self._rest_now = self._rest_now, False
        if any(keep):
            self._zero_run = 0
            self._rest_len = self._REST_MIN
            return
        offered = self._bound_mask.any() or self.last_offered
        if not (offered and self._may_rest):
            return
        self._zero_run += 1
        if rest_now or self._zero_run >= self._REST_AFTER:
            self._zero_run = 0
            self._rest_left = self._rest_len
            self._rest_len = min(2 * self._rest_len, self._REST_MAX)
            self._rest_ids = frozenset(r.req_id for r in ctx.requests)

    # Decayed steps of each mode before they are compared: at batch 1 the
    # host moves a step by +-25% between prompts, and with 8 the comparison
    # rested through copy stretches (MAT 2.59 against 3.20 on rag).
    _MODE_EVIDENCE = 32.0
    # Rest is probed until this much of it is measured (two short rests),
    # not until the comparison may start: at batch 1, probing on to 32
    # rested through copy stretches again (9 probes; MAT 1.96 against 2.40
    # on math_reasoning).
    _PROBE_EVIDENCE = 8.0
    _REST_MARGIN = 0.02      # resting must measure this much faster
    _REST_PROBE_GAP = 64     # awake steps before resting once to measure it
    # ... where the rule expects less than this gain from drafting: about
    # what an awake step's own work costs (2% of the step at batch 1 with
    # Token Recycling on the CPU default; a probe where drafts gain 5-10%
    # rested through copy stretches at batch 1 and cost MAT).
    _REST_PROBE_GAIN = 1.02

    def _rest_beats_drafting(self, batch: int, goodput: float, idle: float) -> bool:
        """Whether to rest from this step on. Resting's rate at this batch
        size is measured; drafting's is the rule's prediction for this
        decision times the measured ratio of delivered to promised tokens of
        awake steps (so costs the model misses count, and a change in
        acceptance counts at once). Unmeasured rest is tried once where the
        corrected prediction gains less than 2% over the model's idle step."""
        if not self._may_rest:
            return False
        rest, _, n_rest, n_awake = self.modes.rates(batch)
        drafting = self.modes.bias(batch) * goodput    # the prediction, corrected
        if n_rest >= self._MODE_EVIDENCE and n_awake >= self._MODE_EVIDENCE:
            return drafting < (1.0 - self._REST_MARGIN) * rest
        if (n_rest < self._PROBE_EVIDENCE and drafting < self._REST_PROBE_GAIN * idle
                and self.steps - self._awake_since >= self._REST_PROBE_GAP):
            self.rest_probes += 1
            return True
        return False

    def _observe_cost(self, ctx: StepContext) -> None:
        tokens, decode = _step_tokens(ctx)
        if ctx.last_gap_seconds is not None:   # reported, not modelled
            gap = _engine_gap(ctx)
            self.gap_s = gap if self.gap_s is None else 0.95 * self.gap_s + 0.05 * gap
        cold = self.sizes.touch(tokens) if tokens else False
        # Steps that ran prompt tokens are not the kind this rule decides on
        # (and their many tokens would pull the line).
        if ctx.last_step_seconds is not None and ctx.requests and tokens <= decode:
            batch = getattr(ctx, "last_step_batch_size", None) or len(ctx.requests)
            # The engine waits for the proposer as well as for the forward.
            seconds = ctx.last_step_seconds + (ctx.last_propose_seconds or 0.0)
            verifies = any(r.num_draft > 0 for r in ctx.requests)
            self.cost.observe(float(tokens), float(batch), float(seconds), verifies, cold)

    def _observe(self, ctx: StepContext) -> None:
        super()._observe(ctx)
        self._observe_cost(ctx)
        # Decide exploration now, so max_length() can see it during drafting.
        # Once warm, explore only while the slope's standard error moves
        # tau = b * goodput (the prefix probability a draft must beat) by more
        # than _TAU_TOLERANCE.
        if not self.cost.warm:
            rate = self.options["warmup_explore"]
        elif self.cost.slope_se * self._goodput_scale() > self._TAU_TOLERANCE:
            rate = self.options["explore"]
        else:
            rate = 0.0
        self._explore_cap = None
        if rate > 0 and self.rng.random() < rate:
            self._explore_cap = int(self.rng.integers(0, self.max_draft + 1))
        elif (self.cost.warm and self.steps - self._idle_probe_at >= self._IDLE_PROBE_GAP
              and self.cost.needs_idle_step()):
            # Where every step verifies, the verify-step cost hides in the
            # intercept; one step with no draft now and then keeps it apart.
            self._explore_cap = 0
            self._idle_probe_at = self.steps
            self.idle_probes += 1

    _TAU_TOLERANCE = 0.02
    _IDLE_PROBE_GAP = 64   # steps: at most 1 in 64 forced to verify nothing

    def _goodput_scale(self) -> float:
        """Tokens per second of the last decision (or of no drafting at all)."""
        g = self.last_expected_goodput
        if math.isfinite(g):
            return g
        return self._idle_goodput(self._batch_hint)

    def _idle_goodput(self, batch: int) -> float:
        """The model's tokens per second of a step of ``batch`` requests
        that keeps no draft: B / t(B)."""
        a, b = self.cost.line(batch)
        return batch / max(a + b * batch, 1e-12)

    def _choose(self, rows, lengths, q, valid, ctx) -> np.ndarray:
        batch = len(lengths)
        if self._explore_cap is not None:
            self.explore_steps += 1
            cap, self._explore_cap = self._explore_cap, None
            return np.minimum(lengths, cap)
        a, b = self.cost.line(batch)
        keep, goodput, tokens = goodput_allocation(
            q, valid, a, b, self.cost.switch_s, self.cost.cold_s, self.sizes.array())
        self.last_expected_goodput = goodput
        self.last_expected_tokens = tokens
        self._promised = goodput
        idle = self._idle_goodput(batch)
        if self._rest_beats_drafting(batch, goodput, idle):
            self._rest_now = True
            self._promised = idle
            return np.zeros_like(keep)
        # A draft is worth its cost when its prefix probability exceeds
        # tau = b * goodput. Probing pays off only if acceptance can beat tau:
        # never when tau >= 1; the closer tau is to 1, the rarer.
        tau = b * goodput
        self._probe_scale = 0 if tau >= 1.0 else int(min(8, max(1, round(1 / (1 - tau)))))
        return keep

    def max_length(self, req_id: str) -> int:
        if self._explore_cap is not None:
            return self.max_draft
        return super().max_length(req_id)

    def _length_bounds(self, probs: np.ndarray) -> np.ndarray:
        return self._history_bounds(probs, self._bound_threshold())

    def _bound_threshold(self) -> float:
        # Token j is only added while q_j > b * G, and G >= G(0) = B / t(B):
        # a bound from history at (half) the last batch size.
        batch = max(1, self._batch_hint // 2)
        return self.cost.line(batch)[1] * self._idle_goodput(batch)

    def stats(self) -> dict:
        out = super().stats()
        out["explore_steps"] = self.explore_steps
        out["rest_steps"] = self.rest_steps
        out["rest_probes"] = self.rest_probes
        out["measured_rates"] = self.modes.table()
        out["own_ms_per_step"] = self.modes.own_table()
        out["engine_gap_ms"] = None if self.gap_s is None else round(1e3 * self.gap_s, 3)
        out["idle_probes"] = self.idle_probes
        out["cost_model"] = self.cost.coefficients()
        g = self.last_expected_goodput
        out["last_expected_goodput"] = None if math.isnan(g) else g
        return out


CONTROLLERS: dict[str, type[DraftLengthController]] = {
    "fixed": FixedController,
    "acceptance": AcceptanceController,
    "confidence": ConfidenceController,
    "goodput": GoodputController,
}


def make_controller(name: str | None, options: dict | None, max_draft: int
                    ) -> DraftLengthController:
    """Build a controller; a bad name, option or value raises ValueError naming it."""
    name = DEFAULT_CONTROLLER if name is None else name
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
        raise ValueError(f"max_draft must be a positive integer, got {max_draft!r}")
    resolved = resolve_options(name, options)
    return CONTROLLERS[name](max_draft, resolved)


def controller_from_config(value: str | dict | None, max_draft: int) -> DraftLengthController:
    """``"goodput"`` or ``{"policy": "goodput", "half_life": 2}`` or None (default)."""
    if value is None or isinstance(value, str):
        return make_controller(value, {}, max_draft)
    if isinstance(value, dict):
        opts = dict(value)
        name = opts.pop("policy", None)
        return make_controller(name, opts, max_draft)
    raise ValueError(f"draft_length must be a policy name or a dict, got {value!r}")
