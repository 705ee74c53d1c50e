"""The estimating controllers' compiled loops, compiled before the first step.

numba compiles a loop at its first call, or loads it from its on-disk
cache. A controller's step calls a dozen loops, some in one variant per
configuration (prefix calibration and confidences on or off), and on a
fresh install compiling them takes seconds: at the first engine steps, a
request would wait on them. ``warm_up`` runs a twin of a new controller
through synthetic steps instead, while the worker starts.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.draft_length.controllers import DraftLengthController

_WARM: set = set()
# Enough steps with varying token counts for the step-time model's refit,
# under its default warm-up.
_STEPS = 24


def warm_up(controller: DraftLengthController) -> None:
    """Run a twin of ``controller`` (same class and options, its own state)
    through ``_STEPS`` synthetic steps of one request: every loop its
    configuration calls is compiled, or loaded, now. Once per configuration
    and process; the controller itself is untouched."""
    estimator = getattr(controller, "estimator", None)
    key = (type(controller), getattr(controller, "prefix", None) is None,
           getattr(controller, "calibrator", None) is None,
           estimator.mode if estimator is not None else None)
    if key in _WARM:
        return
    _WARM.add(key)
    from vllm_plugins.step_context import Drafts, RequestStep, StepContext

    twin = type(controller)(controller.max_draft, controller.options)
    depth = controller.max_draft
    context = np.arange(64, dtype=np.int64)
    kept = 0
    for step in range(_STEPS):
        accepted = context[:1 + min(kept, step % 3)]
        request = RequestStep("warm-up", accepted, context, 8, kept, context[:1 + kept],
                              None, None, 0.0)
        tokens = 1 + kept
        ctx = StepContext([request], max_draft=depth,
                          last_step_seconds=0.02 + 0.001 * tokens + 0.0001 * step,
                          last_step_tokens=tokens, last_propose_seconds=0.0004,
                          last_topk_seconds=0.0002, last_gap_seconds=0.001)
        observation = twin.observe(ctx)
        if observation.resting:
            kept = 0
            continue
        # Drafts of every length, and now and then none (a step with
        # nothing offered settles without prefix probabilities).
        offered = step % 4 != 3 and twin.max_length("warm-up", observation) > 0
        n = min(depth, 1 + step % depth) if offered else 0
        drafts = Drafts([list(range(n))], confidence=[np.full(n, 0.6)])
        kept = len(twin.shape(ctx, drafts, observation).tokens[0])
    from vllm_plugins.proposers.draft_length.goodput import GoodputController
    from vllm_plugins.proposers.draft_length.tree_goodput import (TreeGoodputController,
                                                                  tree_allocation)

    if isinstance(twin, GoodputController):
        # The twin may not rest (can_rest), so its rest comparison is not
        # reached, nor the learning a resting step runs without bounds.
        twin.rest.beats_drafting(1, 1.0, 1.0, 0)
        twin._learn(ctx)

    if isinstance(twin, TreeGoodputController):
        from vllm_plugins.proposers.draft_length import tree_kernels

        tree_kernels.warm_up()   # its per-tree loops, which synthetic chains never reach
        # ... and its allocation over both shapes (``TreeGoodputController._allocate``).
        q, valid = np.full((1, 2), 0.5), np.ones((1, 2), np.bool_)
        tree_allocation(q, valid, q, valid, 1.0, 0.1, 0.0, 0.0, 0.0, np.zeros(1, np.int64))
        if twin.path_calibration is not None:   # the twin's: nothing of it is kept
            twin.path_calibration.learn(np.full(2, 0.5), np.ones(2))
