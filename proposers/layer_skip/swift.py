"""SWIFT: the target with some sublayers skipped drafts for itself.

Paper: "SWIFT: On-the-Fly Self-Speculative Decoding for LLM Inference
Acceleration". No training and no fixed recipe: which attention and MLP
sublayers to skip is searched while serving (skip_search.SkipSetSearch:
random search, then Bayesian optimization), each candidate scored by its
agreement with the target on the running requests' recent tokens. Scoring is
teacher-forced over the committed context with no KV writes (TargetLayers
.score), so it never disturbs the cache. The best set then drafts; when the
measured acceptance drifts well below the score the set was chosen with, the
search runs again. Drafting stops at the first token whose draft probability
is below ``stop_below``.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import Option, positive_int, unit_float
from vllm_plugins.proposers.layer_skip.base import SelfDraftProposer
from vllm_plugins.proposers.layer_skip.skip_search import SkipSetSearch, mask_to_skips
from vllm_plugins.self_draft import LayerPlan
from vllm_plugins.step_context import StepContext


def _skip_layers_ok(value) -> bool:
    if value is None:
        return True
    return (isinstance(value, dict) and set(value) <= {"attn", "mlp"}
            and all(isinstance(v, list) and all(isinstance(i, int) and i >= 0 for i in v)
                    for v in value.values()))


class SwiftProposer(SelfDraftProposer):
    OPTIONS = (
        *SelfDraftProposer.COMMON_SELF_DRAFT_OPTIONS,
        Option("skip_ratio", 0.25, (int, float), lambda v: 0.0 <= v < 0.9,
               "a fraction of the sublayers in [0, 0.9)"),
        positive_int("search_rounds", 24, 4096),
        positive_int("candidates_per_round", 2, 64),
        positive_int("window", 32, 4096),
        positive_int("score_requests", 4, 256),
        unit_float("retune_below", 0.6),
        Option("skip_layers", None, (dict, type(None)), _skip_layers_ok,
               '{"attn": [layer, ...], "mlp": [layer, ...]} (a fixed skip set, '
               "no search)"),
        Option("seed", 0, int),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.search: SkipSetSearch | None = None
        self.rounds_left = self.options["search_rounds"]
        self.plan: LayerPlan | None = None
        self.plan_score = 0.0
        self.num_layers = 0
        self.retunes = 0
        self.acc_drafted = 0.0
        self.acc_accepted = 0.0

    # -------------------------------------------------------------- learning
    def learn(self, ctx: StepContext) -> None:
        target = ctx.target
        if target is None:
            return
        if self.num_layers == 0:
            self._start(target.num_layers)
        drafted = sum(r.num_draft for r in ctx.requests)
        accepted = sum(min(r.num_accepted_drafts, r.num_draft) for r in ctx.requests)
        if drafted:
            decay = 0.97 ** drafted
            self.acc_drafted = decay * self.acc_drafted + drafted
            self.acc_accepted = decay * self.acc_accepted + accepted
        if self.search is not None and self.rounds_left > 0:
            self._search_round(ctx)
        elif (self.search is not None and self.acc_drafted > 20
              and self.acceptance < self.options["retune_below"] * self.plan_score):
            self.retunes += 1
            self.rounds_left = max(self.options["search_rounds"] // 2, 1)
            self.acc_drafted = self.acc_accepted = 0.0

    @property
    def acceptance(self) -> float:
        return self.acc_accepted / self.acc_drafted if self.acc_drafted else 0.0

    def _start(self, num_layers: int) -> None:
        self.num_layers = num_layers
        fixed = self.options["skip_layers"]
        if fixed is not None:
            bad = [i for v in fixed.values() for i in v if i >= num_layers]
            if bad:
                raise ValueError(f"skip_layers names layers {bad}, but the model "
                                 f"has {num_layers} layers")
            self.plan = LayerPlan.skipping(num_layers, fixed.get("attn", ()),
                                           fixed.get("mlp", ()))
            return
        self.search = SkipSetSearch(num_layers, self.options["skip_ratio"],
                                    seed=self.options["seed"],
                                    protect=(0, num_layers - 1))

    def _search_round(self, ctx: StepContext) -> None:
        width = self.options["window"]
        picks = [i for i, r in enumerate(ctx.requests)
                 if not r.in_prefill and len(r.context) > width + 1]
        if not picks:
            return
        picks = picks[: self.options["score_requests"]]
        windows, starts, nexts = [], [], []
        for i in picks:
            ctx_tokens = ctx.requests[i].context
            end = len(ctx_tokens) - 1  # the last token is not in the cache yet
            windows.append(ctx_tokens[end - width:end])
            nexts.append(ctx_tokens[end - width + 1:end + 1])
            starts.append(end - width)
        windows = np.asarray(windows, dtype=np.int64)
        nexts = np.asarray(nexts, dtype=np.int64)
        candidates = self.search.propose(self.options["candidates_per_round"])
        for mask in candidates:
            attn, mlp = mask_to_skips(mask)
            plan = LayerPlan.skipping(self.num_layers, attn, mlp)
            pred, _ = ctx.target.score(np.asarray(picks), windows,
                                       np.asarray(starts), plan)
            self.search.record(mask, float((pred == nexts).mean()))
        self.rounds_left -= 1
        best, score = self.search.best()
        attn, mlp = mask_to_skips(best)
        self.plan = LayerPlan.skipping(self.num_layers, attn, mlp)
        self.plan_score = score

    # --------------------------------------------------------------- drafting
    def plan_for(self, ctx: StepContext, i: int):
        if self.plan is None:
            return None
        return self.plan, ctx.max_draft

    def metrics(self) -> dict:
        out = super().metrics()
        if self.plan is not None:
            out["skip_attn"] = [i for i, run in enumerate(self.plan.attn) if not run]
            out["skip_mlp"] = [i for i, run in enumerate(self.plan.mlp) if not run]
            out["plan_cost"] = round(self.plan.cost(), 3)
        out.update(matchness=round(self.plan_score, 3),
                   acceptance=round(self.acceptance, 3),
                   candidates_scored=self.search.num_evaluated if self.search else 0,
                   retunes=self.retunes)
        return out
