"""The engine's step time as a function of the step's shape, fitted online."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from vllm_plugins.options import choice, flag, integer, number
from vllm_plugins.proposers.draft_length.step_cost_kernels import (NEW_SHAPE, TREE, VERIFY,
                                                                   count_costs, refit)

# Options of the goodput policy's step-time model.
COST_OPTIONS = (
    choice("cost_features", "tokens+batch", ("tokens", "tokens+batch", "tokens+batch+context")),
    flag("verify_step_cost", True),
    flag("tree_step_cost", True),
    choice("tree_cost", "token", ("token", "step")),
    integer("shape_cache", 32, 0, 4096,
            rule="an integer in [0, 4096] (0: no new-shape cost)"),
    integer("cost_window", 256, 8, 65536),
    integer("warmup", 16, 3, 65536),
    number("prior_token_cost", 0.001, 0.0),
    integer("count_prior", 4, 0, 65536,
            rule="an integer in [0, 65536] (0: the fitted line alone at every token count)"),
)


class StepCostModel:
    """Engine step time as a linear function, fitted online.

        t(step) ~= a + b * tokens (+ c * batch) (+ d * context)
                   (+ verify_step_s * verifies) (+ new_shape_s * new_shape)
                   (+ tree_token_s * tree_tokens  or  + tree_step_s * tree),
                   all coefficients >= 0

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
    - A step that verified at least one draft tree that is not a chain: the
      bridge plans the step's ancestry masks, computes those requests'
      attention rows with them instead of vLLM's op, accepts by path and
      moves the accepted nodes' K/V. With ``tree_cost: "token"`` (the
      default) ``tree_tokens`` is that step's token count and
      ``tree_token_s`` what each costs beyond a chain's token: a tree row's
      attention and its share of the gathers grow with the rows, and a
      step term alone leaves that extra in the one slope chains and trees
      share, which then prices a chain token as dear as a tree node and a
      big tree as cheap as a small one. With ``"step"``, ``tree`` is 1 and
      ``tree_step_s`` a fixed extra per tree step.

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

    Once warm, the fit is refreshed every ``refit_every`` observations (4;
    the engine core's ``BatchStepK`` takes 16: there a refit, cold after
    the forward, costs more than the rest of its step).

    A line and step terms cannot follow a step time that moves in steps of
    its own with the token count: the linear layers' kernels differ by row
    count (docs/benchmarks.md's step-cost table), and a GPU's captured
    graphs come in sizes. So each refit also keeps, per token count in the
    window, the mean residual of its steps from the fitted model, shrunk
    toward 0 by ``count_prior`` rows of prior weight (``by_count``,
    ``count_costs``); the goodput rule adds it to the time of a step of
    that many tokens. A count the window does not hold costs what the model
    says.
    """

    _MIN_MODE_STEPS = 4

    def __init__(self, *, cost_features: str = "tokens+batch", cost_window: int = 256,
                 warmup: int = 16, prior_token_cost: float = 0.001,
                 verify_step_cost: bool = True, shape_cache: int = 32,
                 tree_step_cost: bool = True, refit_every: int = 4, tree_cost: str = "step",
                 count_prior: int = 4, **_: Any):
        self.refit_every = int(refit_every)
        self.count_prior = float(count_prior)
        # Seconds added to the model's time of a step of N tokens, per N
        # (``count_costs``); empty: none.
        self.by_count = _NO_COUNTS
        self.use_batch = cost_features in ("tokens+batch", "tokens+batch+context")
        self.use_context = cost_features == "tokens+batch+context"
        self.context_now = 0.0      # the step being decided: its committed tokens
        self.use_verify_step = verify_step_cost
        self.use_tree_step = tree_step_cost
        # "token": the tree column holds a tree step's tokens, and its
        # coefficient is tree_token_s; "step": it holds 1, and tree_step_s.
        self.tree_per_token = tree_cost == "token"
        self.use_shape = shape_cache > 0
        self.window = cost_window
        self.warmup = warmup
        self.prior_token_cost = prior_token_cost
        # tokens, batch, verifies, new_shape, tree, context
        self._x = np.zeros((cost_window, 6))
        self._y = np.zeros(cost_window)
        # ``observe`` runs every step after a forward has evicted numpy's
        # code: it writes through flat memoryviews of the window, and keeps
        # the rows' verify and tree flags in bytes of its own, so that it
        # makes no numpy call.
        self._x_flat = memoryview(self._x).cast("B").cast("d")
        self._y_flat = memoryview(self._y).cast("B").cast("d")
        self._verify_flags = bytearray(cost_window)
        self._tree_flags = bytearray(cost_window)
        self._len = 0
        self._pos = 0
        # Window rows that verified drafts, and that verified a tree.
        self._verifying = 0
        self._trees = 0
        self.num_observed = 0
        self._dirty = False
        self._coef = (1.0, prior_token_cost, 0.0, 0.0)
        # Counts the refits that set the line: what ``line`` answers changes
        # only with it (and with ``context_now``), so callers may cache on it.
        self.fit_id = 0
        self.verify_step_s = 0.0       # extra fixed cost of a verifying step
        self.new_shape_s = 0.0         # extra cost of a step with a new token count
        self.tree_step_s = 0.0         # extra cost of a step that verifies a tree
        self.tree_token_s = 0.0        # extra cost of each token of such a step
        self._warm = False
        self._rmse = float("nan")
        self._outliers = 0
        self._fitted_at = 0
        self.slope_se = float("inf")   # standard error of b (s/token)
        # The refit's arguments and result, by column code (step_cost_kernels).
        self._used = np.zeros(3, np.bool_)
        self._last = np.zeros(3)
        self._got = np.zeros(7)

    def observe(self, tokens: float, batch: float, seconds: float,
                verifies: bool = True, new_shape: bool = False, tree: bool = False,
                context: float = 0.0) -> None:
        if not (seconds and seconds > 0 and math.isfinite(seconds) and tokens > 0):
            return
        pos = self._pos
        verifies, tree = int(bool(verifies)), int(bool(tree))
        if self._len == self.window:   # the oldest row goes
            self._verifying -= self._verify_flags[pos]
            self._trees -= self._tree_flags[pos]
        self._verifying += verifies
        self._trees += tree
        self._verify_flags[pos] = verifies
        self._tree_flags[pos] = tree
        x, row = self._x_flat, 6 * pos
        x[row] = tokens
        x[row + 1] = batch
        x[row + 2] = verifies
        x[row + 3] = float(new_shape)
        x[row + 4] = tree * tokens if self.tree_per_token else tree
        x[row + 5] = context
        self._y_flat[pos] = seconds
        self._pos = (pos + 1) % self.window
        self._len = min(self._len + 1, self.window)
        self.num_observed += 1
        # A refit is due: every observation until warm, then every few.
        self._dirty = (not self._warm
                       or self.num_observed - self._fitted_at >= self.refit_every)

    @property
    def warm(self) -> bool:
        if self._dirty:
            self._refit()
        return self._warm

    def needs_idle_step(self) -> bool:
        """Whether the window holds too few steps without a verification to
        tell the verify-step cost apart from the intercept."""
        if not self.use_verify_step:
            return False
        return self._len - self._verifying < self._MIN_MODE_STEPS

    def needs_tree_step(self) -> bool:
        """Whether the window holds too few steps that verified a tree to
        fit the tree-step cost (it then keeps its last estimate)."""
        if not self.use_tree_step:
            return False
        return self._trees < self._MIN_MODE_STEPS

    def current_fit(self) -> int:
        """``fit_id`` after any refit that is due (``line`` would run it)."""
        if self._dirty:
            self._refit()
        return self.fit_id

    def line(self, batch: int) -> tuple[float, float]:
        """(intercept, slope) of t(tokens) for a step of ``batch`` requests
        over ``context_now`` committed tokens that verifies no draft; one
        that does costs ``verify_step_s`` more."""
        if self._dirty:
            self._refit()
        a, b, c, d = self._coef
        return a + c * batch + d * self.context_now, b

    def count_cost(self, tokens: int) -> float:
        """The correction at ``tokens`` (``by_count``; 0 where there is none)."""
        by_count = self.by_count
        return float(by_count[tokens]) if tokens < len(by_count) else 0.0

    def coefficients(self) -> dict:
        self._refit()
        a, b, c, d = self._coef
        out = {"per_context_token_s": d} if self.use_context else {}
        return {"intercept_s": a, "per_token_s": b, "per_request_s": c, **out,
                "verify_step_s": self.verify_step_s, "new_shape_s": self.new_shape_s,
                "tree_step_s": self.tree_step_s, "tree_token_s": self.tree_token_s,
                "count_costs_ms": {str(n): round(1e3 * float(v), 3)
                                   for n, v in enumerate(self.by_count.tolist()) if v},
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
        self._dirty = False
        self._fitted_at = self.num_observed
        n = self._len
        if n < self.warmup:
            return
        used = self._used
        used[:] = (self.use_verify_step, self.use_shape, self.use_tree_step)
        last = self._last
        last[:] = (self.verify_step_s, self.new_shape_s,
                   self.tree_token_s if self.tree_per_token else self.tree_step_s)
        got = self._got
        status, codes, dropped, rmse, slope_se = refit(
            self._x, self._y, n, self.use_batch, self.use_context, used, last,
            float(self._MIN_MODE_STEPS), got)
        if status == 0:
            return  # one token count: the slope is not identifiable yet
        self._outliers, self._rmse, self.slope_se = int(dropped), float(rmse), float(slope_se)
        a, b, c, d, verify, shape, tree = got.tolist()
        self._coef = (a, b, c, d)
        self.fit_id += 1
        fitted = set(codes.tolist())
        if VERIFY in fitted:
            self.verify_step_s = verify
        if NEW_SHAPE in fitted:
            self.new_shape_s = shape
        if TREE in fitted:
            if self.tree_per_token:
                self.tree_token_s = tree
            else:
                self.tree_step_s = tree
        if self.count_prior > 0:
            charged = np.array((a, b, c, d, self.verify_step_s, self.new_shape_s,
                                self.tree_token_s if self.tree_per_token else self.tree_step_s))
            self.by_count = count_costs(self._x, self._y, n, charged, self.count_prior)
        self._warm = True


_NO_COUNTS = np.zeros(0)


class RecentSizes:
    """The last ``capacity`` distinct token counts of engine steps, least
    recently used first: the counts whose kernels the runtime still holds
    (vLLM's CPU linear layers keep 32 per layer)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._recent: dict[int, None] = {}   # insertion order = recency
        self._array: np.ndarray | None = None   # the counts, while they stand

    def touch(self, tokens: int) -> bool:
        """Record a step of ``tokens`` tokens; True if the count was new."""
        if self.capacity <= 0:
            return False
        tokens = int(tokens)
        new = self._recent.pop(tokens, True) is True
        self._recent[tokens] = None
        if new:
            self._array = None
            if len(self._recent) > self.capacity:
                del self._recent[next(iter(self._recent))]
        return new

    def array(self) -> np.ndarray | None:
        """The counts held, in no particular order (the rule asks whether a
        count is among them every step; they change only with a new one)."""
        if self.capacity <= 0:
            return None
        if self._array is None:
            self._array = np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))
        return self._array
