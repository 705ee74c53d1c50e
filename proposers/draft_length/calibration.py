"""Calibration: a proposer's confidences, and the goodput rule's prefix
probabilities, mapped to how often such drafts were really accepted."""

from __future__ import annotations

from typing import Any

import numpy as np

from vllm_plugins.options import integer, number
from vllm_plugins.proposers.draft_length.acceptance import EPS
from vllm_plugins.proposers.draft_length.calibration_kernels import (apply_prefix, calibrated,
                                                                    calibrated_at, learn_buckets,
                                                                    learn_kept, learn_prefix,
                                                                    prefix_probs,
                                                                    remember_kept,
                                                                    remember_prefix)
from vllm_plugins.proposers.draft_length.slots import RequestSlots

# Options of the policies that read a proposer's confidences.
CONFIDENCE_OPTIONS = (
    integer("calib_bins", 10, 2, 100),
    number("calib_half_life", 16.0, 0.0, lo_open=True,
           rule="a positive number of verification steps"),
)

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
    deep draft with a given confidence more likely right than a first one:
    a position-agnostic table under-rates deep drafts and cuts chains that
    pay.

    Outcomes are matched to the confidences of the drafts the controller kept
    last step (stored at ``decide``).
    """

    _STRENGTH = 2.0
    _GLOBAL_HALF_LIFE = 1024.0  # steps
    _NO_EXTRA = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

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

    def remember(self, rows: np.ndarray, conf: np.ndarray | None, keep: np.ndarray,
                 upto: np.ndarray | None = None) -> None:
        """Store the raw confidences of the kept drafts (NaN = none given);
        ``upto`` (default ``keep``) may reach one further, for a cut draft
        whose outcome the next step observes."""
        a = self.slots.arrays
        if conf is None:
            a["conf_kept"][rows] = np.nan
            return
        upto = keep if upto is None else upto
        remember_kept(rows, conf, np.asarray(upto, np.int64), a["conf_kept"],
                      a["conf_seen"])

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray,
                extra: tuple | None = None) -> None:
        """Learn the kept drafts' outcomes (n observed positions, the first
        m accepted) and ``extra``: (row index into ``rows``, position
        0-based, raw confidence, outcome) arrays of outcomes read elsewhere
        (tree nodes, by depth)."""
        a = self.slots.arrays
        er, ej, ec, ex = self._NO_EXTRA if extra is None else extra
        learn_kept(rows, n, m, a["conf_kept"], np.asarray(er, np.int64),
                   np.asarray(ej, np.int64), np.asarray(ec, np.float64),
                   np.asarray(ex, np.float64), self.gs, self.gn, self.gps, self.gpn,
                   a["cal_s"], a["cal_e"], self._STRENGTH, self._gdecay, self.decay)

    def kernel_state(self) -> tuple:
        """Its tables in the order the controller's compiled step takes them
        (``controller_kernels.learn_step``)."""
        a = self.slots.arrays
        return (a["conf_kept"], self.gs, self.gn, self.gps, self.gpn, a["cal_s"], a["cal_e"],
                self._STRENGTH, self._gdecay, self.decay)

    def calibrate_at(self, rows: np.ndarray, j: np.ndarray, conf: np.ndarray) -> np.ndarray:
        """Calibrated probabilities of single drafts: slot row, position
        (0-based; a tree node's depth - 1) and raw confidence per entry."""
        a = self.slots.arrays
        return calibrated_at(np.asarray(rows, np.int64),
                             np.minimum(np.asarray(j, np.int64), self.depth - 1),
                             np.asarray(conf, np.float64), self.gs, self.gn, self.gps,
                             self.gpn, a["cal_s"], a["cal_e"], self._STRENGTH, EPS)

    def calibrate(self, rows: np.ndarray, conf: np.ndarray) -> np.ndarray:
        """Calibrated probabilities, same shape as ``conf`` (column j = draft
        position j+1); NaN stays NaN."""
        a = self.slots.arrays
        width = min(conf.shape[1], self.depth)
        return calibrated(rows, np.asarray(conf[:, :width], np.float64), self.gs, self.gn,
                          self.gps, self.gpn, a["cal_s"], a["cal_e"], self._STRENGTH, EPS)

    def table(self) -> list[float]:
        mid = (np.arange(self.bins) + 0.5) / self.bins
        return [round(float(v), 4) for v in (self.gs + self._STRENGTH * mid)
                / (self.gn + self._STRENGTH)]


class OutcomeCalibrator:
    """Maps a predicted probability to how often such predictions came true:
    per log-spaced bucket of the prediction q, decayed sums of outcomes S_b
    and of predictions E_b give

        q_cal = q * (S_b + k) / (E_b + k)        k = 2 pseudo-outcomes
    """

    EDGES = np.array([0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    _STRENGTH = 2.0
    _HALF_LIFE = 256.0   # steps

    def __init__(self):
        nb = len(self.EDGES) + 1
        self.s = np.zeros(nb)
        self.e = np.zeros(nb)
        self._decay = 0.5 ** (1.0 / self._HALF_LIFE)

    def factor(self, q: np.ndarray) -> np.ndarray:
        b = np.searchsorted(self.EDGES, q)
        k = self._STRENGTH
        return (self.s[b] + k) / (self.e[b] + k)

    def learn(self, q: np.ndarray, x: np.ndarray) -> None:
        """One step's predictions ``q`` and their outcomes ``x`` (0/1)."""
        if len(q) == 0:
            return
        # In place: the prefix calibration's compiled step holds the arrays.
        learn_buckets(np.asarray(q, np.float64), np.asarray(x, np.float64), self.EDGES,
                      self.s, self.e, self._decay)

    def table(self) -> list[float]:
        k = self._STRENGTH
        return [round(float(v), 3) for v in (self.s + k) / (self.e + k)]


class PrefixCalibrator(OutcomeCalibrator):
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
    in ``_observe_cut``) and corrects q per bucket (``OutcomeCalibrator``),
    made non-increasing along the draft again, and clipped to [EPS, 1 - EPS].
    """

    def __init__(self, slots: RequestSlots, max_draft: int):
        super().__init__()
        self.slots = slots
        self.depth = max_draft
        slots.add("q_used", (max_draft,), np.float64, np.nan)

    def kernel_state(self) -> tuple:
        """Its arrays in the order the controller's compiled step takes them
        (``controller_kernels.learn_step``)."""
        return self.slots.arrays["q_used"], self.EDGES, self.s, self.e, self._decay

    def apply(self, q: np.ndarray) -> np.ndarray:
        q = np.ascontiguousarray(q, np.float64)
        out = np.empty_like(q)
        apply_prefix(q, self.EDGES, self.s, self.e, self._STRENGTH, EPS, out)
        return out

    def remember(self, rows: np.ndarray, q: np.ndarray, upto: np.ndarray) -> None:
        """Store the raw q of positions < upto (kept drafts, plus the first
        cut one when its outcome will be observed)."""
        remember_prefix(rows, q, upto, self.slots.arrays["q_used"])

    def observe(self, rows: np.ndarray, n: np.ndarray, m: np.ndarray) -> None:
        """Rows verified this step: n observed positions (the cut one
        included when observed), of which the first m accepted. A prefix
        longer than the accepted run failed, whether or not its own draft
        was verified; the cut draft counts only where observed."""
        learn_prefix(rows, n, m, self.slots.arrays["q_used"], self.EDGES, self.s, self.e,
                     self._decay)


def prefix_probabilities(rows: np.ndarray, probs: np.ndarray, width: int,
                         conf: np.ndarray | None, calibrator: ConfidenceCalibrator | None,
                         prefix: PrefixCalibrator | None) -> tuple[np.ndarray, np.ndarray]:
    """(q as the rule reads it, q before the prefix calibration), each
    [rows, width]: per position the history estimate ``probs``, or the
    calibrated confidence where ``conf`` gives one, multiplied along the
    row, then through ``prefix`` (None: both are the same array). One
    compiled pass instead of a numpy call per stage."""
    q_raw = np.empty((len(rows), width))
    q = np.empty_like(q_raw) if prefix is not None else q_raw
    if conf is None or calibrator is None:
        conf, tables = _NO_CONF, _NO_TABLES
    else:
        a = calibrator.slots.arrays
        tables = (calibrator.gs, calibrator.gn, calibrator.gps, calibrator.gpn, a["cal_s"],
                  a["cal_e"])
    outcomes = (prefix.s, prefix.e) if prefix is not None else _NO_TABLES[:2]
    prefix_probs(rows, probs, width, conf, *tables, ConfidenceCalibrator._STRENGTH, EPS,
                 prefix is not None, OutcomeCalibrator.EDGES, *outcomes,
                 OutcomeCalibrator._STRENGTH, q, q_raw)
    return q, q_raw


_NO_CONF = np.zeros((0, 0))
_NO_TABLES = (np.zeros(0), np.zeros(0), np.zeros((0, 0)), np.zeros((0, 0)), np.zeros(0),
              np.zeros(0))
