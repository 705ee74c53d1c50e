"""What a STAND draft is drawn from, and how confident it is.

A sampled draft's token is drawn from its store entry's probabilities
tempered by the request's sampling parameters, and that distribution is the
draft's probability row (proposers/stand.py, rule 1). How likely a drafted
token is to be accepted is learned per kind of source entry, so the
draft-length controller can cut where drafts stop paying.
"""

from __future__ import annotations

import numpy as np


def draft_distribution(probs: np.ndarray, temperature: float, top_k: int = 0,
                       top_p: float = 1.0) -> tuple[np.ndarray, float]:
    """The distribution a sampled draft is drawn from, and its confidence.

    ``probs``: an entry's stored probabilities (temperature 1, descending).
    Returns q (float32, over the same support, sums to 1 after the caller's
    float64 normalisation of the float32 values; entries that round to 0 are
    0) and the estimated acceptance of a draft drawn from q: the tempered mass
    the support covers (if q equals the target restricted to the support, the
    expected acceptance is exactly that mass).
    """
    p = probs.astype(np.float64)
    n = len(p)
    if top_k and top_k > 0:
        n = min(n, top_k)
    inv_t = 1.0 / temperature
    # Work in log space so a low temperature does not underflow the top token.
    logp = np.log(np.maximum(p[:n], 1e-30)) * inv_t
    logp -= logp.max()
    w = np.exp(logp)
    q = w / w.sum()
    if top_p < 1.0 and n > 1:
        keep = int(np.searchsorted(np.cumsum(q), top_p) + 1)
        keep = max(1, min(keep, n))
        q = q[:keep] / q[:keep].sum()
        n = keep
    q32 = q.astype(np.float32)
    # Coverage at temperature T: the unknown rest (1 - sum p) is made of tokens
    # no likelier than the least likely stored one.
    covered = float(p.sum())
    rest = max(1.0 - covered, 0.0)
    pmin = float(max(p[len(p) - 1], 1e-30))
    s_t = float(np.exp(np.log(np.maximum(p[:len(p)], 1e-30)) * inv_t).sum())
    rest_t = rest * pmin ** (inv_t - 1.0)
    conf = s_t / (s_t + rest_t) if s_t + rest_t > 0 else 0.0
    return q32, conf


class KindCalibration:
    """Observed acceptance of drafted tokens, per kind of source entry.

    A kind is (sampled or greedy request, order of the matched context,
    prompt seed or target-learned entry): 2 * max_order * 2 counters. The
    confidence of a drafted token is the kind's acceptance estimate scaled by
    how its entry's own score (stored top-1 probability at temperature 0,
    tempered coverage otherwise) compares with the kind's average score.
    Estimates are exponentially discounted (``decay`` per observation) with a
    Beta prior of mean ``prior`` and weight 2.
    """

    def __init__(self, max_order: int, prior: float = 0.5, decay: float = 0.995):
        self.max_order = max_order
        self.prior = prior
        self.decay = decay
        n = 2 * max_order * 2
        self.accepted = np.zeros(n)
        self.trials = np.zeros(n)
        self.score_sum = np.zeros(n)

    def kind(self, sampled: bool, order: int, seed: bool) -> int:
        return (int(sampled) * self.max_order + (order - 1)) * 2 + int(seed)

    def estimate(self, kind: int) -> float:
        return float((self.accepted[kind] + 2.0 * self.prior) / (self.trials[kind] + 2.0))

    def confidence(self, kind: int, score: float) -> float:
        est = self.estimate(kind)
        if self.trials[kind] >= 1.0 and self.score_sum[kind] > 0:
            mean_score = self.score_sum[kind] / self.trials[kind]
            est *= score / mean_score
        return float(min(max(est, 0.01), 0.99))

    def observe(self, kind: int, score: float, accepted: bool) -> None:
        d = self.decay
        self.accepted[kind] = d * self.accepted[kind] + float(accepted)
        self.trials[kind] = d * self.trials[kind] + 1.0
        self.score_sum[kind] = d * self.score_sum[kind] + score

    def table(self) -> dict:
        out = {}
        for sampled in (False, True):
            for order in range(1, self.max_order + 1):
                for seed in (False, True):
                    k = self.kind(sampled, order, seed)
                    if self.trials[k] >= 1.0:
                        name = (f"{'sampled' if sampled else 'greedy'}/order{order}"
                                f"{'/seed' if seed else ''}")
                        out[name] = [round(self.estimate(k), 3), round(float(self.trials[k]), 1)]
        return out
