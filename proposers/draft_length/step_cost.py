"""The engine's step time as a function of the step's shape, fitted online."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vllm_plugins.options import choice, flag, integer, number
from vllm_plugins.proposers.jit import cached_njit

# Options of the goodput policy's step-time model.
COST_OPTIONS = (
    choice("cost_features", "tokens+batch", ("tokens", "tokens+batch", "tokens+batch+context")),
    flag("verify_step_cost", True),
    flag("tree_step_cost", True),
    integer("shape_cache", 32, 0, 4096,
            rule="an integer in [0, 4096] (0: no new-shape cost)"),
    integer("cost_window", 256, 8, 65536),
    integer("warmup", 16, 3, 65536),
    number("prior_token_cost", 0.001, 0.0),
)


class StepCostModel:
    """Engine step time as a linear function, fitted online.

        t(step) ~= a + b * tokens (+ c * batch) (+ d * context)
                   (+ verify_step_s * verifies) (+ new_shape_s * new_shape)
                   (+ tree_step_s * tree), all coefficients >= 0

    ``context`` (``cost_features: "tokens+batch+context"``) is the step's
    committed tokens over all its requests: attention reads them all, so a
    step over long prompts costs more at any token count. Without it, the
    steps of long prompts (which copy, and so draft more) and of short ones
    (which rest) differ in the intercept as well as in tokens, and the
    slope takes up the difference.

    Three step-level terms (docs/draft_length_design.md):

    - ``verifies`` is 1 for a step that verified at least one draft: vLLM's
      speculative path costs a fixed extra beyond the line through steps
      with drafts (``stats()["cost_model"]["verify_step_s"]`` reports the
      fit; docs/draft_length_design.md).
    - ``new_shape`` is 1 for a step whose token count was not among the last
      ``shape_cache`` distinct counts. vLLM's CPU linear layers build a
      oneDNN kernel per token count and keep 32 per layer
      (``python -m vllm_plugins.bench.kernel_sizes`` measures a first call
      against a cached one). A rule blind to this spreads the step's token
      count over many values and pays it again and again (a GPU with CUDA
      graphs has the same kind of cost for sizes off its captured set).
    - ``tree`` is 1 for a step that verified at least one draft tree that is
      not a chain: the bridge plans the step's ancestry masks, computes
      those requests' attention rows with them instead of vLLM's op,
      accepts by path and moves the accepted nodes' K/V.

    Fitted by least squares over the last ``window`` (tokens, batch,
    verifies, new_shape, tree, seconds) observations (a ring buffer), with one round of
    outlier rejection (|residual| > 5 robust sigmas) and a non-negativity
    constraint (the best non-negative subset fit). ``batch`` is dropped when
    it does not vary independently of ``tokens`` in the window; ``verifies``,
    ``new_shape`` and ``tree`` while fewer than ``_MIN_MODE_STEPS`` steps of either kind
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
                 verify_step_cost: bool = True, shape_cache: int = 32,
                 tree_step_cost: bool = True, **_: Any):
        self.use_batch = cost_features in ("tokens+batch", "tokens+batch+context")
        self.use_context = cost_features == "tokens+batch+context"
        self.context_now = 0.0      # the step being decided: its committed tokens
        self.use_verify_step = verify_step_cost
        self.use_tree_step = tree_step_cost
        self.use_shape = shape_cache > 0
        self.window = cost_window
        self.warmup = warmup
        self.prior_token_cost = prior_token_cost
        # tokens, batch, verifies, new_shape, tree, context
        self._x = np.zeros((cost_window, 6))
        self._y = np.zeros(cost_window)
        self._len = 0
        self._pos = 0
        self.num_observed = 0
        self._dirty = False
        self._coef = (1.0, prior_token_cost, 0.0, 0.0)
        self.verify_step_s = 0.0       # extra fixed cost of a verifying step
        self.new_shape_s = 0.0         # extra cost of a step with a new token count
        self.tree_step_s = 0.0         # extra cost of a step that verifies a tree
        self._warm = False
        self._rmse = float("nan")
        self._outliers = 0
        self._fitted_at = 0
        self.slope_se = float("inf")   # standard error of b (s/token)

    def observe(self, tokens: float, batch: float, seconds: float,
                verifies: bool = True, new_shape: bool = False, tree: bool = False,
                context: float = 0.0) -> None:
        if not (seconds and seconds > 0 and math.isfinite(seconds) and tokens > 0):
            return
        self._x[self._pos] = (tokens, batch, float(verifies), float(new_shape), float(tree),
                              float(context))
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
        tell the verify-step cost apart from the intercept."""
        if not self.use_verify_step:
            return False
        idle = int(self._len - self._x[:self._len, 2].sum())
        return idle < self._MIN_MODE_STEPS

    def needs_tree_step(self) -> bool:
        """Whether the window holds too few steps that verified a tree to
        fit the tree-step cost (it then keeps its last estimate)."""
        if not self.use_tree_step:
            return False
        return int(self._x[:self._len, 4].sum()) < self._MIN_MODE_STEPS

    def line(self, batch: int) -> tuple[float, float]:
        """(intercept, slope) of t(tokens) for a step of ``batch`` requests
        over ``context_now`` committed tokens that verifies no draft; one
        that does costs ``verify_step_s`` more."""
        self._refit()
        a, b, c, d = self._coef
        return a + c * batch + d * self.context_now, b

    def coefficients(self) -> dict:
        self._refit()
        a, b, c, d = self._coef
        out = {"per_context_token_s": d} if self.use_context else {}
        return {"intercept_s": a, "per_token_s": b, "per_request_s": c, **out,
                "verify_step_s": self.verify_step_s, "new_shape_s": self.new_shape_s,
                "tree_step_s": self.tree_step_s,
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
        if self.use_context and _independent(tok, self._x[:n, 5]) \
                and ("c" not in names or _independent(bat, self._x[:n, 5])):
            cols.append(self._x[:n, 5])
            names.append("d")
        y = y.copy()
        for col, name, used in ((2, "verify_step_s", self.use_verify_step),
                                (3, "new_shape_s", self.use_shape),
                                (4, "tree_step_s", self.use_tree_step)):
            marked = self._x[:n, col]
            ones = int(marked.sum())
            if used and min(ones, n - ones) >= self._MIN_MODE_STEPS and _independent(tok, marked):
                cols.append(marked)
                names.append(name)
            else:
                # Too few steps of one kind to fit it: the last estimate
                # stands, and the few flagged steps are corrected by it
                # rather than pulling the line (a long rest leaves a window
                # of idle steps with a handful of verifying ones).
                y -= marked * getattr(self, name)
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
        self._coef = (got["a"], got["b"], got.get("c", 0.0), got.get("d", 0.0))
        self.verify_step_s = got.get("verify_step_s", self.verify_step_s)
        self.new_shape_s = got.get("new_shape_s", self.new_shape_s)
        self.tree_step_s = got.get("tree_step_s", self.tree_step_s)
        self._warm = True

    @staticmethod
    def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Least squares with all coefficients >= 0, exact: the non-negative
        optimum is the plain fit on its own support, so the best of the
        plain fits on every subset of the <= 7 columns that come out
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


@cached_njit
def _independent(tok: np.ndarray, other: np.ndarray) -> bool:
    """Whether ``other`` varies, and not in lockstep with ``tok`` (|Pearson
    correlation| under 0.98; one compiled pass, the refit asks up to four
    times)."""
    n = len(tok)
    lo = hi = other[0]
    mean_t = mean_o = 0.0
    for i in range(n):
        lo = min(lo, other[i])
        hi = max(hi, other[i])
        mean_t += tok[i]
        mean_o += other[i]
    if not hi - lo > 0:
        return False
    mean_t /= n
    mean_o /= n
    stt = soo = sto = 0.0
    for i in range(n):
        dt = tok[i] - mean_t
        do = other[i] - mean_o
        stt += dt * dt
        soo += do * do
        sto += dt * do
    corr = sto / np.sqrt(stt * soo)
    return bool(np.isfinite(corr) and abs(corr) < 0.98)
