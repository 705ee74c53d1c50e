"""Each source's estimates mapped to how often such nodes were accepted.

Sources state their own confidences on their own scales (a table's stored
probability, a share of occurrences, a suffix tree's frequency), and the
hybrid compares them node by node, so each is calibrated first: per
source, depth and confidence bucket, from every observed node (a node
whose parent was on the accepted path, sent or not: the target's own next
token says whether it would have been accepted). Counts decay slowly and
shrink toward coarser levels, as the goodput policy's calibration does:

    g_sb(c)  = (S_sb + k c) / (N_sb + k)               source and bucket; prior = c
    g_sdb(c) = (S_sdb + k g_sb(c)) / (N_sdb + k)       ... and depth
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.draft_length.acceptance import clip, unit_interval
from vllm_plugins.proposers.jit import cached_njit


@cached_njit
def _learn(src, depth, c, outcome, decay, s, n, sd, nd):
    """Decay every count once, then add each entry in order (as
    ``np.add.at`` would): one pass, no temporaries."""
    bins, max_depth = s.shape[1], sd.shape[1]
    s *= decay
    n *= decay
    sd *= decay
    nd *= decay
    for i in range(len(src)):
        x = c[i]
        if not x >= 0.0:       # NaN too (nan_to_num, then the clip)
            x = 0.0
        elif x > 1.0:
            x = 1.0
        b = min(max(int(x * bins), 0), bins - 1)
        d = min(max(depth[i] - 1, 0), max_depth - 1)
        k = src[i]
        s[k, b] += outcome[i]
        n[k, b] += 1.0
        sd[k, d, b] += outcome[i]
        nd[k, d, b] += 1.0


class SourceCalibrator:
    _STRENGTH = 2.0
    _HALF_LIFE = 1024.0   # observed nodes of one source, roughly steps

    def __init__(self, num_sources: int, depth: int = 32, bins: int = 10):
        self.depth, self.bins = depth, bins
        self.strength = self._STRENGTH
        self.decay = 0.5 ** (1.0 / self._HALF_LIFE)
        self.s = np.zeros((num_sources, bins))
        self.n = np.zeros((num_sources, bins))
        self.sd = np.zeros((num_sources, depth, bins))
        self.nd = np.zeros((num_sources, depth, bins))

    def _index(self, depth: np.ndarray, c: np.ndarray):
        d = clip(np.asarray(depth, np.int64) - 1, 0, self.depth - 1)
        c = unit_interval(np.asarray(c, np.float64))
        b = clip((c * self.bins).astype(np.int64), 0, self.bins - 1)
        return d, b, c

    def calibrate(self, source: int, depth: np.ndarray, c: np.ndarray) -> np.ndarray:
        """Calibrated estimates of one source's nodes (depth: root child 1).
        The merge computes the same inside its loop (``trie.calibrated``)."""
        d, b, c = self._index(depth, c)
        k = self._STRENGTH
        g = (self.s[source, b] + k * c) / (self.n[source, b] + k)
        return (self.sd[source, d, b] + k * g) / (self.nd[source, d, b] + k)

    def learn(self, source: np.ndarray, depth: np.ndarray, c: np.ndarray,
              outcome: np.ndarray) -> None:
        """Outcomes (1 accepted, 0 not) of observed nodes, one entry per
        (node, source that proposed it) with that source's raw estimate."""
        if len(source) == 0:
            return
        _learn(np.ascontiguousarray(source, np.int64), np.ascontiguousarray(depth, np.int64),
               np.ascontiguousarray(c, np.float64), np.ascontiguousarray(outcome, np.float64),
               self.decay, self.s, self.n, self.sd, self.nd)

    def table(self, source: int) -> list[float]:
        """Per depth, the acceptance rate seen (NaN where none)."""
        n = self.nd[source].sum(1)
        s = self.sd[source].sum(1)
        return [float(v) for v in np.where(n > 0, s / np.maximum(n, 1e-12), np.nan)]
