"""Per-request acceptance estimates: how likely each draft position is accepted.

Every estimating policy (acceptance, confidence, goodput) reads these; see
``AcceptanceEstimator`` for the model and docs/draft_length_design.md for why it
is shaped so.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_plugins.options import choice, flag, integer, number
from vllm_plugins.proposers.draft_length.estimator_kernels import learn_rows, probs_rows
from vllm_plugins.proposers.draft_length.slots import RequestSlots

EPS = 1e-3  # position probabilities are clipped to [EPS, 1 - EPS]


def clip(x, lo, hi):
    """``np.clip(x, lo, hi)``'s values (NaN stays NaN) at a fraction of its
    cost: the controllers clip arrays of a few entries many times a step,
    where ``np.clip``'s dispatch is most of the work."""
    return np.minimum(np.maximum(x, lo), hi)


def unit_interval(x):
    """``np.clip(np.nan_to_num(x), 0, 1)``'s values for floats (NaN -> 0,
    +inf -> 1, -inf -> 0), without ``nan_to_num``'s cost."""
    return np.fmin(np.fmax(x, 0.0), 1.0)

# Options every estimating policy (acceptance, confidence, goodput) takes.
# ``probe_interval``, ``max_tracked`` and ``observe_cut`` are read by the
# estimating controller around the estimator.
ESTIMATOR_OPTIONS = (
    choice("estimator", "ewma", ("ewma", "window")),
    number("half_life", 3.0, 0.0, lo_open=True,
           rule="a positive number of verification steps"),
    integer("window", 8, 1, 64),
    number("change_threshold", 4.0, 0.0,
           rule="a number >= 0 (nats; 0 disables change detection)"),
    number("prior_acceptance", 0.6, 0.0, 1.0, lo_open=True, hi_open=True),
    number("prior_strength", 2.0, 0.0),
    integer("probe_interval", 4, 0, 1 << 16,
            rule="an integer in [0, 65536] (0 disables probing)"),
    # Rows of per-request state; above max_num_seqs (RequestSlots).
    integer("max_tracked", 65536, 1, 1 << 20),
    flag("observe_cut", True),
)


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
    Conditional acceptance rises with depth: a draft that survived j tokens
    is usually a copy (``test_deep_positions_learn_their_own_higher_rate``
    in tests/test_draft_length_policies.py). A pooled per-request prior
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
        # Global decayed (accepted, observed) counts, pooled over positions.
        self._glob = np.zeros(2)
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
        self._no_counts = np.zeros((1, max_draft))   # the window estimator keeps none

    @property
    def global_rate(self) -> float:
        return (float(self._glob[0]) + self.prior_acceptance) / (float(self._glob[1]) + 1.0)

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

    def kernel_state(self) -> tuple:
        """Its arrays and constants in the order the controller's compiled
        step takes them (``controller_kernels.learn_step``); the slot arrays
        among them are replaced when the slots grow."""
        a = self.slots.arrays
        ewma = self.mode == "ewma"
        return (a["acc_s"] if ewma else self._no_counts, a["acc_n"] if ewma else self._no_counts,
                a["win_n"], a["win_m"], a["win_pos"], self._glob, self._gps, self._gpn,
                self.depth, self._gdecay, float(self.prior_acceptance), self.decay, ewma,
                float(self.change_threshold), float(self.prior_strength), EPS)

    def probs(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows), max_draft] conditional acceptance per position."""
        a = self.slots.arrays
        ewma = self.mode == "ewma"
        return probs_rows(rows, a["acc_s"] if ewma else self._no_counts,
                          a["acc_n"] if ewma else self._no_counts, a["win_n"], a["win_m"],
                          ewma, self.global_rate, self._gps, self._gpn,
                          float(self.prior_strength), EPS)

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray) -> None:
        """Learn from rows whose drafts were verified: m of n accepted (rows
        with n = 0 are skipped); then, with ``ewma``, the change detector:
        the Bayes factor of "a new regime began L steps ago" (L = 2..W, W = 3).

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
        ewma = self.mode == "ewma"
        self.changes += learn_rows(
            rows, n, m, self.depth, a["acc_s"] if ewma else self._no_counts,
            a["acc_n"] if ewma else self._no_counts, a["win_n"], a["win_m"], a["win_pos"],
            self._glob, self._gps, self._gpn, self._gdecay, self.prior_acceptance, self.decay,
            ewma, float(self.change_threshold))
