"""Adaptive draft-length controllers that work with every proposer.

A proposer drafts up to ``max_draft`` tokens per request; a controller
decides how many of them each request keeps this step (the per-step
contract: ``controllers.DraftLengthController``). Policies, chosen with a
method's ``"draft_length"`` option, their own options in
``"draft_length_options"``:

``fixed``       keep every draft.
``acceptance``  per-request acceptance estimates; the smallest k that reaches
                most of the achievable expected accepted length, 0 when
                acceptance is near zero (with periodic 1-token probes).
``confidence``  SpecDec++-style: keep drafting while the calibrated cumulative
                confidence (estimated P(all kept drafts accepted)) stays above
                a threshold; history estimates where no confidence is given.
``goodput``     SmartSpec's rule: per step, the k_i (0 included) maximising
                expected generated tokens / predicted step time, the step
                time learned online from the engine's own timings.

Modules: ``slots`` (per-request rows), ``acceptance`` (estimates),
``calibration``, ``step_cost`` (the step-time model), ``controllers`` (the
contract, acceptance, confidence), ``goodput`` and ``rest``, ``simulator``;
``controller_kernels``, ``estimator_kernels``, ``calibration_kernels`` and
``step_cost_kernels``, their per-step loops compiled with numba, and
``warm_up``, which compiles them as a controller is made; ``batch_k``, the
batch-wide k from an engine core's counts (Model Runner V2's device route).
No vLLM import. See docs/draft_length.md.
"""

from __future__ import annotations

from vllm_plugins.options import Option, choice, resolve
from vllm_plugins.proposers.draft_length.controllers import (
    AcceptanceController, ConfidenceController, DraftLengthController,
    EstimatingController, FixedController, Observation)
from vllm_plugins.proposers.draft_length.goodput import GoodputController, goodput_allocation
from vllm_plugins.proposers.draft_length.tree_goodput import TreeGoodputController
from vllm_plugins.proposers.draft_length.warm_up import warm_up

# Policy name -> controller. ``goodput`` is the tree-aware controller, which
# on chains decides as GoodputController (the chain rule, "goodput_chain").
CONTROLLERS: dict[str, type[DraftLengthController]] = {
    c.name: c for c in (FixedController, AcceptanceController, ConfidenceController,
                        TreeGoodputController)
}
POLICIES = tuple(CONTROLLERS)

__all__ = ["CONTROLLERS", "POLICIES", "AcceptanceController", "ConfidenceController",
           "DraftLengthController", "EstimatingController", "FixedController",
           "GoodputController", "Observation", "TreeGoodputController",
           "draft_length_options",
           "goodput_allocation", "make_controller", "policy_options"]


def draft_length_options(default: str = "fixed") -> tuple[Option, ...]:
    """The options every method takes: its policy (``default``: "fixed"
    unless the method has measured goodput beating fixed drafts end to
    end; docs/draft_length.md) and the policy's own options."""
    return (choice("draft_length", default, POLICIES),
            Option("draft_length_options", None, (dict, type(None))))


def policy_options(name: str, options: dict | None) -> dict:
    """A policy's defaults overlaid with validated values; ValueError names
    the option."""
    if name not in CONTROLLERS:
        raise ValueError(f"unknown draft_length policy {name!r}; "
                         f"choose one of {list(POLICIES)}")
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"draft_length options must be a dict, got {options!r}")
    return resolve(name, CONTROLLERS[name].OPTIONS, dict(options or {}),
                   scope="policy", label="draft_length option")


def make_controller(name: str, options: dict | None, max_draft: int
                    ) -> DraftLengthController:
    """Build a controller; a bad name, option or value raises ValueError naming it."""
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
        raise ValueError(f"max_draft must be a positive integer, got {max_draft!r}")
    resolved = policy_options(name, options)
    controller = CONTROLLERS[name](max_draft, resolved)
    warm_up(controller)   # its compiled loops now, not in the first engine steps
    return controller
