"""The base every proposer of ours derives from.

vLLM builds the class as ``Class(vllm_config)`` and calls ``load_model``; the
bridge then calls ``step(ctx)`` each engine step instead of vLLM's raw
``propose``. The base owns what every method shares: options, the draft-length
controller, per-request lifecycle, and the rule that a proposer error costs a
draft, never the engine.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np

from vllm_plugins.options import Option
from vllm_plugins.proposers.draft_length import draft_length_options, make_controller
from vllm_plugins.proposers.draft_length.controllers import trim  # noqa: F401 (re-exported)
from vllm_plugins.drafter import Drafter
from vllm_plugins.step_context import Drafts, RequestStep, StepContext

logger = logging.getLogger("vllm_plugins")


class PluginProposer(Drafter):
    # Declared options, see vllm_plugins.options: every method takes the
    # draft-length options, and a subclass adds its own after them.
    OPTIONS: tuple[Option, ...] = draft_length_options()
    DEFAULT_NUM_SPECULATIVE_TOKENS = 6
    # How many of the target's top-k per verified position the bridge extracts
    # (0: the method does not learn from logits).
    TOPK = 0
    # Whether whole engine steps may pass without calling draft(): true for
    # methods that keep no per-step state (they read each request's context
    # afresh). The goodput controller rests such a proposer where drafts
    # cannot pay, and the step then costs what a step without speculation
    # costs, nearly (no top-k extraction, no learning, no drafting).
    CAN_REST = False
    # Whether the draft-length policy may choose which nodes of this
    # method's draft trees to verify (a node subset closed under ancestors,
    # re-laid; docs/draft_length_design.md, "Trees"), rather than cut each tree to
    # a prefix. The method then learns from the drafts ``proposed`` gets.
    SHAPES_TREES = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # A method registered from another package may declare its options
        # without the draft-length ones every method takes: they come first.
        if not any(o.name == "draft_length" for o in cls.OPTIONS):
            cls.OPTIONS = (*draft_length_options(), *cls.OPTIONS)

    def __init__(self, vllm_config: Any = None, options: dict | None = None,
                 vocab_size: int | None = None):
        from vllm_plugins.options import resolve
        from vllm_plugins.registry import PLUGIN_OPTIONS_ATTR

        spec = getattr(vllm_config, "speculative_config", None)
        given = options
        if given is None:
            given = dict(getattr(spec, PLUGIN_OPTIONS_ATTR, None) or {})
            given.pop("method", None)
        self.options = resolve(type(self).__name__, self.OPTIONS, given)
        self.check_options(type(self).__name__, self.options)
        self.max_draft = int(getattr(spec, "num_speculative_tokens", None)
                             or self.DEFAULT_NUM_SPECULATIVE_TOKENS)
        self.vocab_size = vocab_size
        if vllm_config is not None:
            self.vocab_size = vllm_config.model_config.get_vocab_size()
        if "topk" in self.options:  # methods that learn from the target's top-k
            self.TOPK = self.options["topk"]
        self.controller = self._make_controller()
        if self.controller is not None:
            self.controller.can_rest = self.CAN_REST
            self.controller.shapes_trees = self.SHAPES_TREES
        # What the controller observed of the step being drafted (its
        # max_length reads it); None outside a step.
        self._observation = None
        self.num_errors = 0
        self._logged_error = False
        self._last_propose_seconds: float | None = None  # the engine waits for it

    # ------------------------------------------------------------ vLLM route
    @classmethod
    def check_options(cls, where: str, options: dict) -> None:
        """Rules between resolved options (each is already valid alone); a
        ValueError names the options. Called at translation, before any
        model loads, and again in the worker."""

    @classmethod
    def runner_v2_refusal(cls, options: dict) -> str | None:
        """Why Model Runner V2 cannot serve this method with these (resolved)
        options, or None when it can. V2 verifies one chain per request and
        gives the drafter no hook into the target's layers, so trees and
        self-drafting stay on the V1 runner while it exists."""
        if options.get("draft_shape") == "tree":
            return ("drafts trees, and Model Runner V2 verifies chains only "
                    "(use draft_shape='chain')")
        return None

    def load_model(self, target_model: Any) -> None:
        """Nothing to load: no draft model of our own. The target is never kept
        as ``self.model``, which vLLM reads as a drafter's own model
        (GPUModelRunner.get_draft_model, EPLB)."""

    def propose(self, *args, **kwargs):  # vLLM's raw custom_class call
        raise RuntimeError(
            f"{type(self).__name__} needs the vllm_plugins bridge, which is "
            "installed by the 'vllm.general_plugins' entry point; it did not "
            "run in this worker (is VLLM_PLUGINS set to exclude 'vllm_plugins'?)"
        )

    # ------------------------------------------------------------ our route
    def step(self, ctx: StepContext) -> Drafts:
        """One engine step: learn, draft, trim. Never raises."""
        # The bridge gives ctx.last_propose_seconds itself (the same on every
        # tensor-parallel rank); this process's own time is the fallback.
        start = time.perf_counter()
        if ctx.last_propose_seconds is None:
            ctx.last_propose_seconds = self._last_propose_seconds
        try:
            return self._step(ctx)
        finally:
            self._last_propose_seconds = time.perf_counter() - start

    def _step(self, ctx: StepContext) -> Drafts:
        try:
            for req_id in sorted(ctx.finished):  # one order on every rank
                self.free(req_id)
            if self.controller is None:
                drafts = self.draft(ctx)
            else:
                observation = self._observation = self.controller.observe(ctx)
                if observation.resting:
                    drafts = Drafts([[] for _ in ctx.requests])
                else:
                    drafts = self.controller.shape(ctx, self.draft(ctx), observation)
            drafts = cap_requests(ctx, drafts)
            self.proposed(ctx, drafts)
            return drafts
        except Exception:  # a proposer bug costs drafts, never the engine
            self.num_errors += 1
            if not self._logged_error:
                self._logged_error = True
                logger.exception("%s failed; proposing no drafts for this step "
                                 "(logged once, counted in num_errors)",
                                 type(self).__name__)
            return Drafts([[] for _ in ctx.requests])
        finally:
            self._observation = None

    def draft(self, ctx: StepContext) -> Drafts:
        raise NotImplementedError

    def proposed(self, ctx: StepContext, drafts: Drafts) -> None:
        """The drafts this step hands vLLM, after the draft-length policy
        (a tree may come back as a subset of its nodes, re-laid)."""

    def continue_draft(self, request: RequestStep, prefix: np.ndarray, n: int) -> np.ndarray:
        """Up to ``n`` token ids that follow ``request.context`` + ``prefix``.

        A composing proposer (grammar) replaces part of this proposer's draft
        with tokens of its own and asks how the draft goes on after them;
        ``prefix`` (int64) is the draft so far, not yet in ``request.context``.
        Called within the step, after ``draft``. The default cannot continue:
        an empty array, and the caller's draft ends there.
        """
        return np.zeros(0, dtype=np.int64)

    def topk_wanted(self) -> int:
        """How many of the target's top-k the bridge extracts this step: none
        on a step the controller has already decided to rest."""
        if self.controller is not None and self.controller.rests_next_step:
            return 0
        return self.TOPK

    def draft_budget(self, ctx: StepContext, req_id: str) -> int:
        """The most tokens worth drafting for a request this step. Where
        the controller chooses the next step's k, up to the engine's
        ``max_draft``: its choice weighs drafts this step will not send."""
        length = ctx.max_draft
        if self._observation is not None:
            if self._observation.step_k is not None:
                length = self.max_draft
            length = min(length, self.controller.max_length(req_id, self._observation))
        return length

    def next_step_k(self) -> int | None:
        return None if self.controller is None else self.controller.next_step_k

    def drafting_requests(self, ctx: StepContext):
        """(row, request, draft budget) for each request that drafts this step.

        A request in (chunked) prefill emitted no token this step, so there
        is no last token to draft after: its row keeps the caller's empty
        draft. Budgets are read lazily, one request at a time between the
        caller's drafts: ``max_length`` notes the requests it bounds to none.
        """
        for i, r in enumerate(ctx.requests):
            if not r.in_prefill:
                budget = self.draft_budget(ctx, r.req_id)
                cap = request_draft_cap(r)
                yield i, r, budget if cap is None else min(budget, cap)

    def free(self, req_id: str) -> None:
        """Drop per-request state of a finished or aborted request."""

    def metrics(self) -> dict:
        out = {"num_errors": self.num_errors}
        if self.controller is not None:
            out["draft_length"] = self.controller.stats()
        return out

    def counters(self) -> dict[str, dict[str, int]]:
        """Totals that only grow, for the server's ``/metrics``: {metric:
        {label value: total}}, "" where the metric has no label of its own.
        The bridge reads them after every step, so they are plain reads
        (``metrics()`` is the full, costlier report); the metric names are
        declared in ``vllm_plugins.bridge.counters.METRICS``."""
        out = {"proposer_errors": {"": self.num_errors}}
        if self.controller is not None:
            out.update(self.controller.counters())
        return out

    def _make_controller(self):
        name = self.options["draft_length"]
        if name == "fixed":
            return None
        options = self.options["draft_length_options"]
        if name == "goodput" and self.SHAPES_TREES and self.options.get("draft_shape") == "tree":
            # Trees grow where the context copies, over long prompts whose
            # steps cost more at any token count: without the context term
            # the tree-step and per-token costs take that up
            # (docs/draft_length_design.md, "Trees").
            options = {"cost_features": "tokens+batch+context", **(options or {})}
        return make_controller(name, options, self.max_draft)


def request_draft_cap(request: RequestStep) -> int | None:
    """A request's own draft cap (``extra_args["speculation"]["max_draft"]``,
    parsed once by the bridge: ``RequestStep.speculation``), or None. A
    request the front end should have refused drafts nothing (cap 0)."""
    spec = request.speculation
    return None if spec is None else spec.max_draft


def cap_requests(ctx: StepContext, drafts: Drafts) -> Drafts:
    """Every request's drafts cut to its own cap and to the step's
    ``max_draft``, whatever drafted them (a prefix of a tree is a tree): a
    request's ``max_draft`` holds for every method, and ``proposed`` then
    records only drafts the runner will verify."""
    keep = [len(t) for t in drafts.tokens]
    capped = False
    for i, r in enumerate(ctx.requests[:len(keep)]):
        cap = request_draft_cap(r)
        cap = ctx.max_draft if cap is None else min(cap, ctx.max_draft)
        if cap < keep[i]:
            keep[i], capped = cap, True
    return trim(drafts, keep) if capped else drafts


def verification_depends_on_token(sampling_params) -> bool:
    """Whether vLLM verifies a draft of this request only up to the first
    token its grammar rejects (SamplingParams.structured_outputs set: the
    scheduler's ``update_draft_token_ids`` runs the structured-output
    manager's ``validate_tokens``). Such drafts must go out without
    probability rows: with one-hot rows vLLM's rejection sampling is exact
    whatever chose the token (proposers/stand.py, rule 3)."""
    return getattr(sampling_params, "structured_outputs", None) is not None
