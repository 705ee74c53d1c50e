"""A synthetic world for the draft-length controller tests.

No vLLM: StepContext / RequestStep are built directly, the way the bridge
builds them; drafts are accepted with a given probability and the engine's
step time comes from a synthetic cost curve.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.draft_length import make_controller
from vllm_plugins.proposers.draft_length.step_cost import RecentSizes
from vllm_plugins.step_context import Drafts, RequestStep, StepContext

D = 6
_E = np.zeros(0, dtype=np.int64)
DRAFT_TOKEN = 7   # every synthetic draft; any other token is a target token
POLICIES = ("acceptance", "confidence", "goodput")


def request_step(rid: str, n: int, m: int, prefill: bool = False, bonus: int = 0) -> RequestStep:
    """m accepted drafts, then the target's own token ``bonus``."""
    accepted = _E if prefill else np.array([DRAFT_TOKEN] * m + [bonus], dtype=np.int64)
    return RequestStep(req_id=rid, accepted=accepted, context=_E, num_prompt_tokens=0,
                       num_draft=n, verified_tokens=_E, topk_ids=None,
                       topk_logprobs=None, temperature=0.0)


class World:
    """Drives a controller: per step, each request's drafts are accepted with
    probability alpha (geometric), and the step time follows ``cost``."""

    def __init__(self, controller, batch: int = 1, cost=(0.02, 0.001, 0.0),
                 noise: float = 0.0, seed: int = 0, max_draft: int = D,
                 proposer=None, new_shape_cost: float = 0.0, awake_cost: float = 0.0,
                 by_count=None):
        self.c = controller
        self.proposer = proposer   # drive a PluginProposer's step() instead
        # Seconds a step costs when the proposer works in it (top-k
        # extraction, learning, drafting), on top of the curve: the part of
        # an awake step that resting saves and no term of the model names.
        self.awake_cost = awake_cost
        # A runtime that keeps kernels for the last 32 token counts and pays
        # new_shape_cost for any other count.
        self.new_shape_cost = new_shape_cost
        self.kernels = RecentSizes(32)
        # Seconds a step of N tokens costs beyond the curve, per N: a runtime
        # whose kernels differ by token count (None: none).
        self.by_count = by_count
        self.batch = batch
        self.cost = cost
        self.noise = noise
        self.rng = np.random.default_rng(seed)
        self.d = max_draft
        self.ids = [f"r{i}" for i in range(batch)]
        self.n = np.zeros(batch, np.int64)
        self.m = np.zeros(batch, np.int64)
        self.bonus = np.zeros(batch, np.int64)
        self.seconds = None
        self.tokens = 0
        self.finished: set[str] = set()

    def ctx(self) -> StepContext:
        reqs = [request_step(self.ids[i], int(self.n[i]), int(self.m[i]), bonus=int(self.bonus[i]))
                for i in range(self.batch)]
        # The proposer's own time is part of the synthetic curve (awake_cost),
        # not the host's clock: a loaded host must not move the decisions.
        ctx = StepContext(requests=reqs, finished=self.finished, max_draft=self.d,
                          last_step_seconds=self.seconds, last_step_tokens=self.tokens,
                          last_propose_seconds=0.0)
        self.finished = set()
        return ctx

    def step(self, alpha, confidence=None) -> np.ndarray:
        alpha = np.broadcast_to(np.asarray(alpha, dtype=float), (self.batch,))
        ctx = self.ctx()
        if self.proposer is not None:
            keep = np.array([len(t) for t in self.proposer.step(ctx).tokens])
        else:
            observation = self.c.observe(ctx)
            conf = None
            if confidence is not None:
                conf = [np.full(self.d, confidence, np.float32) for _ in range(self.batch)]
            keep = np.asarray(self.c.decide(
                ctx, Drafts([[DRAFT_TOKEN] * self.d] * self.batch, confidence=conf),
                observation))
        assert keep.shape == (self.batch,)
        assert ((keep >= 0) & (keep <= self.d)).all()
        draws = self.rng.random((self.batch, self.d)) < alpha[:, None]
        run = np.cumprod(draws, axis=1).sum(1)
        self.n, self.m = keep.copy(), np.minimum(run, keep)
        # The target's token after the kept drafts equals the next draft
        # exactly when that draft would have been accepted.
        self.bonus = np.where(run > keep, DRAFT_TOKEN, 0)
        self.tokens = int((keep + 1).sum())
        a, b, c, *d = self.cost   # d: the extra cost of a step verifying drafts
        t = a + b * self.tokens + c * self.batch + (d[0] if d and keep.any() else 0.0)
        if self.kernels.touch(self.tokens):
            t += self.new_shape_cost
        if self.by_count is not None:
            t += self.by_count[self.tokens]
        if not resting(self.c):
            t += self.awake_cost
        self.seconds = t * (1.0 + self.noise * self.rng.normal()) if self.noise else t
        return keep

    def run(self, alpha, steps: int, **kw) -> np.ndarray:
        return np.array([self.step(alpha, **kw) for _ in range(steps)])


def resting(c) -> bool:
    """Whether the controller's current step rests (goodput only)."""
    rest = getattr(c, "rest", None)
    return bool(rest is not None and rest.resting)


def make_policy(policy: str, **opts):
    if policy == "goodput":
        opts.setdefault("explore", 0.0)
    return make_controller(policy, opts, D)


class CountingProposer:
    """A proposer that drafts D copies of DRAFT_TOKEN and counts its calls."""

    def __new__(cls, can_rest: bool):
        from vllm_plugins.proposers.base import PluginProposer

        class Counting(PluginProposer):
            CAN_REST = can_rest
            TOPK = 4
            calls = 0

            def draft(self, ctx):
                self.calls += 1
                return Drafts([[DRAFT_TOKEN] * D for _ in ctx.requests])

        return Counting(None, {"draft_length": "goodput",
                               "draft_length_options": {"explore": 0.0}},
                        vocab_size=16)
