"""SWIFT's optimization phase: which sublayers to skip, found on the fly.

A candidate is a boolean mask over the target's 2L sublayers (entry 2i: the
attention of layer i, 2i+1: its MLP; True = skipped) with a fixed number of
skips. Its score is its agreement with the target on recent output (measured
by the caller). The search first samples at random, then proposes by Bayesian
optimization: a Gaussian process over masks (kernel exp(-Hamming / length))
fitted to the scores so far, maximizing an upper confidence bound over a pool
of random masks and one-swap neighbours of the best ones. Pure numpy: the
number of evaluations is tens, so the GP is a few small solves.
"""

from __future__ import annotations

import numpy as np


class SkipSetSearch:
    def __init__(self, num_layers: int, skip_ratio: float, seed: int = 0,
                 random_rounds: int = 8, protect: tuple[int, ...] = ()):
        self.num_layers = num_layers
        self.dim = 2 * num_layers
        self.allowed = np.ones(self.dim, dtype=bool)
        for layer in protect:  # layers never skipped (e.g. the first and last)
            self.allowed[2 * layer: 2 * layer + 2] = False
        self.num_skip = int(round(skip_ratio * self.dim))
        if self.num_skip > int(self.allowed.sum()):
            raise ValueError(
                f"skip_ratio {skip_ratio} asks to skip {self.num_skip} of "
                f"{self.dim} sublayers, but only {int(self.allowed.sum())} may be "
                "skipped")
        self.rng = np.random.default_rng(seed)
        self.random_rounds = random_rounds
        self.masks: list[np.ndarray] = []
        self.sums: list[float] = []
        self.counts: list[int] = []

    # ----------------------------------------------------------- bookkeeping
    def record(self, mask: np.ndarray, score: float) -> None:
        key = np.asarray(mask, dtype=bool)
        for j, m in enumerate(self.masks):
            if np.array_equal(m, key):
                self.sums[j] += score
                self.counts[j] += 1
                return
        self.masks.append(key.copy())
        self.sums.append(float(score))
        self.counts.append(1)

    @property
    def num_evaluated(self) -> int:
        return len(self.masks)

    def means(self) -> np.ndarray:
        return np.asarray(self.sums) / np.maximum(np.asarray(self.counts), 1)

    def best(self) -> tuple[np.ndarray | None, float]:
        if not self.masks:
            return None, float("-inf")
        j = int(np.argmax(self.means()))
        return self.masks[j], float(self.means()[j])

    # -------------------------------------------------------------- proposing
    def random_mask(self) -> np.ndarray:
        mask = np.zeros(self.dim, dtype=bool)
        choice = self.rng.choice(np.flatnonzero(self.allowed), self.num_skip,
                                 replace=False)
        mask[choice] = True
        return mask

    def neighbour(self, mask: np.ndarray) -> np.ndarray:
        """Swap one skipped sublayer for one that runs."""
        out = mask.copy()
        on = np.flatnonzero(out)
        off = np.flatnonzero(~out & self.allowed)
        if len(on) and len(off):
            out[self.rng.choice(on)] = False
            out[self.rng.choice(off)] = True
        return out

    def propose(self, n: int) -> list[np.ndarray]:
        if self.num_evaluated < self.random_rounds or self.num_skip == 0:
            return [self.random_mask() for _ in range(n)]
        pool = self._pool()
        mean, std = self._posterior(pool)
        ucb = mean + 1.0 * std
        picked = []
        for j in np.argsort(-ucb):
            if not any(np.array_equal(pool[j], p) for p in picked):
                picked.append(pool[j])
            if len(picked) == n:
                break
        return picked

    def _pool(self, size: int = 256) -> np.ndarray:
        order = np.argsort(-self.means())[:4]
        cands = [self.random_mask() for _ in range(size // 2)]
        for j in order:
            cands += [self.neighbour(self.masks[j]) for _ in range(size // 8)]
        seen = {m.tobytes() for m in self.masks}
        fresh = [c for c in cands if c.tobytes() not in seen]
        return np.asarray(fresh or cands)

    def _kernel(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        ham = (a[:, None, :] != b[None, :, :]).sum(-1) / max(self.num_skip, 1)
        return np.exp(-ham / 0.5)

    def _posterior(self, pool: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = np.asarray(self.masks)
        y = self.means()
        mu, sd = y.mean(), y.std() + 1e-6
        yn = (y - mu) / sd
        noise = 0.05 / np.sqrt(np.asarray(self.counts))
        k = self._kernel(x, x) + np.diag(noise)
        ks = self._kernel(pool, x)
        sol = np.linalg.solve(k, yn)
        mean = ks @ sol
        var = 1.0 - np.einsum("ij,ji->i", ks, np.linalg.solve(k, ks.T))
        return mu + sd * mean, sd * np.sqrt(np.clip(var, 1e-9, None))


def mask_to_skips(mask: np.ndarray) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(layers whose attention is skipped, layers whose MLP is skipped)."""
    idx = np.flatnonzero(mask)
    return (tuple(int(i // 2) for i in idx if i % 2 == 0),
            tuple(int(i // 2) for i in idx if i % 2 == 1))
