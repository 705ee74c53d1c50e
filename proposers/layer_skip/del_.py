"""DEL: early-exit self-speculation with the exit layer chosen per context.

Paper: "DEL: Context-Aware Dynamic Exit Layer for Efficient Self-Speculative
Decoding". The draft runs the target's first ``e`` layers, then the shared
final norm and LM head. Which ``e``, and how many tokens, depends on how often
an exit at ``e`` agrees with the target, which depends on the text.

Shadow acceptance, from hidden states the verification pass already computes:
the bridge asks vLLM's model for its residual stream after each candidate exit
layer (vLLM's aux-hidden-state outputs, as EAGLE-3 uses), so every verified
position on the accepted path tells, for each candidate ``e``, whether an exit
there would have drafted the token the target chose: ``argmax head(norm(h_e))
== target token``. For the first draft token this is exactly its acceptance;
later tokens are assumed to behave alike (geometric acceptance). Each LM-head
evaluation costs a quarter of a forward on the default model, so shadows are
sampled: ``shadow_rows`` positions x ``shadow_layers`` candidates per step,
rotating over the candidates.

Choice per request: with per-layer acceptance ``a_e`` (the request's own
counts, shrunk toward the engine-wide rate), pick ``(e, k)`` maximizing
expected tokens per unit of cost, ``(1 + a + ... + a^k) / (1 + b*k + k*c_e)``:
``b`` is the verification cost per drafted token, ``c_e`` the cost of one
draft step relative to a target decode step (layers run plus LM head, from the
parameter counts, plus a fixed per-step overhead). When no ``(e, k >= 1)`` beats
not drafting, the request drafts nothing this step, and shadows keep learning.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_plugins.options import Option, positive_int
from vllm_plugins.proposers.layer_skip.base import SelfDraftProposer
from vllm_plugins.self_draft import LayerPlan
from vllm_plugins.step_context import StepContext


def _layer_list_ok(value) -> bool:
    return value is None or (isinstance(value, list) and value
                             and all(isinstance(i, int) and i > 0 for i in value))


class DelProposer(SelfDraftProposer):
    OPTIONS = (
        *SelfDraftProposer.COMMON_SELF_DRAFT_OPTIONS,
        Option("exit_layers", None, (list, type(None)), _layer_list_ok,
               "a non-empty list of layer counts (exit after that many layers)"),
        positive_int("shadow_rows", 4, 64),
        positive_int("shadow_layers", 3, 256),
        Option("verify_cost_per_token", 0.04, (int, float), lambda v: v >= 0,
               "a non-negative number"),
        Option("draft_step_overhead", 0.1, (int, float), lambda v: v >= 0,
               "a non-negative number"),
        Option("prior_strength", 8.0, (int, float), lambda v: v > 0,
               "a positive number"),
        # Draft only when the expected tokens per unit of cost beat no
        # drafting by this factor (1.0: break-even; 0: always draft).
        Option("min_value", 1.0, (int, float), lambda v: v >= 0,
               "a non-negative number"),
    )

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exits: np.ndarray = np.zeros(0, dtype=np.int64)
        self.aux_layers: tuple[int, ...] = ()
        self.cost = np.zeros(0)
        # engine-wide shadow counts per candidate, with exponential forgetting
        self.hits = np.zeros(0)
        self.trials = np.zeros(0)
        self.per_request: dict[str, np.ndarray] = {}  # req -> [2, E] hits, trials
        self.last_exit: dict[str, int] = {}
        self._rotate = 0
        self.chosen = {}  # exit depth -> times chosen
        self.no_draft = 0
        self.idle_steps = 0

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        inner = target_model.model
        num_layers = inner.end_layer - inner.start_layer
        exits = self.options["exit_layers"]
        if exits is None:
            exits = list(range(max(2, num_layers // 3), num_layers - 1, 2))
        bad = [e for e in exits if e >= num_layers]
        if bad:
            raise ValueError(f"speculative_config option 'exit_layers' of method "
                             f"'del': {bad} must be below the model's "
                             f"{num_layers} layers")
        self.exits = np.asarray(sorted(set(exits)), dtype=np.int64)
        self.aux_layers = tuple(int(e) for e in self.exits)  # read by the bridge
        layer_params = sum(p.numel() for p in inner.layers[inner.start_layer]
                           .parameters())
        hidden = inner.norm.weight.numel()
        head_full = self.vocab_size * hidden
        head_draft = (self.draft_vocab.size if self.draft_vocab else self.vocab_size) * hidden
        full = num_layers * layer_params + head_full
        self.cost = ((self.exits * layer_params + head_draft) / full
                     + self.options["draft_step_overhead"])
        self.hits = np.zeros(len(self.exits))
        self.trials = np.zeros(len(self.exits))

    # -------------------------------------------------------------- learning
    def learn(self, ctx: StepContext) -> None:
        drafting = bool(self.last_exit)
        for req in ctx.requests:  # what the drafts themselves achieved
            e = self.last_exit.pop(req.req_id, None)
            attempts = self.attempts.pop(req.req_id, 0)
            if e is not None and attempts:
                # Per draft forward run, confident or not: a forward whose
                # token fell below stop_below cost as much as an accepted one.
                counts = self._counts(req.req_id)
                j = int(np.searchsorted(self.exits, e))
                counts[0, j] += min(req.num_accepted_drafts, req.num_draft)
                counts[1, j] += attempts
        self.idle_steps = 0 if drafting else self.idle_steps + 1
        # While no exit pays, shadows keep watching at a quarter of the rate:
        # the context may change, but the LM heads cost time every step.
        if (ctx.aux_streams and ctx.target is not None
                and (self.idle_steps < 16 or self.steps % 4 == 0)):
            self._shadow(ctx)

    def _counts(self, req_id: str) -> np.ndarray:
        if req_id not in self.per_request:
            self.per_request[req_id] = np.zeros((2, len(self.exits)))
        return self.per_request[req_id]

    def _shadow(self, ctx: StepContext) -> None:
        rows, toks, owners = [], [], []
        for req in ctx.requests:
            if req.verify_rows is None or req.in_prefill:
                continue
            on_path = min(len(req.accepted), len(req.verify_rows))
            for j in range(on_path):
                rows.append(int(req.verify_rows[j]))
                toks.append(int(req.accepted[j]))
                owners.append(req.req_id)
        if not rows:
            return
        limit = self.options["shadow_rows"]
        if len(rows) > limit:
            pick = np.linspace(0, len(rows) - 1, limit).round().astype(int)
            rows = [rows[i] for i in pick]
            toks = [toks[i] for i in pick]
            owners = [owners[i] for i in pick]
        n = min(self.options["shadow_layers"], len(self.exits))
        which = [(self._rotate + i) % len(self.exits) for i in range(n)]
        self._rotate = (self._rotate + n) % len(self.exits)
        rows_t = torch.as_tensor(rows, dtype=torch.int64)
        toks_np = np.asarray(toks)
        head = self._head(ctx.target)
        self.hits *= 0.995
        self.trials *= 0.995
        for j in which:
            stream = ctx.aux_streams.get(int(self.exits[j]))
            if stream is None:
                continue
            with torch.inference_mode():
                hidden = ctx.target.inner.norm(stream[rows_t.to(stream.device)])
                logits, ids = head(hidden) if head else (ctx.target.logits(hidden), None)
                pred = logits.argmax(-1)
                if ids is not None:
                    pred = ids[pred]
                hit = pred.cpu().numpy() == toks_np
            self.hits[j] += hit.sum()
            self.trials[j] += len(hit)
            for owner, h in zip(owners, hit):
                counts = self._counts(owner)
                counts[0, j] += h
                counts[1, j] += 1

    # --------------------------------------------------------------- drafting
    def acceptance(self, req_id: str | None = None) -> np.ndarray:
        glob = (self.hits + 1.0) / (self.trials + 2.0)
        if req_id is None or req_id not in self.per_request:
            return glob
        hits, trials = self.per_request[req_id]
        m = self.options["prior_strength"]
        return (hits + m * glob) / (trials + m)

    def choose(self, alpha: np.ndarray, max_k: int) -> tuple[int, int, float]:
        """(candidate index, k, value) maximizing tokens per unit cost; k=0
        when the best value is below ``min_value`` (drafting does not pay)."""
        ks = np.arange(1, max_k + 1)
        # expected tokens: 1 + a + a^2 + ... + a^k, for every (e, k)
        powers = alpha[:, None] ** ks[None, :]
        tokens = 1.0 + np.cumsum(powers, axis=1)
        cost = (1.0 + self.options["verify_cost_per_token"] * ks[None, :]
                + ks[None, :] * self.step_costs()[:, None])
        value = tokens / cost
        j, k = np.unravel_index(int(np.argmax(value)), value.shape)
        if value[j, k] < self.options["min_value"] or value[j, k] <= 0:
            return -1, 0, float(value[j, k])
        return int(j), int(ks[k]), float(value[j, k])

    def step_costs(self) -> np.ndarray:
        """Cost of one draft forward at each candidate exit, in target steps.

        From the parameter counts until this engine has timed its own draft
        forwards and target steps; then the measured ratio, carried to exits
        not yet timed in proportion to their parameter cost."""
        measured = {plan.depth: secs for plan, secs in self.forward_seconds.items()}
        if not measured or not self.step_seconds:
            return self.cost
        param = self.cost - self.options["draft_step_overhead"]
        ratios = [measured[int(e)] / self.step_seconds / param[j]
                  for j, e in enumerate(self.exits) if int(e) in measured]
        return param * float(np.median(ratios))

    def plan_for(self, ctx: StepContext, i: int):
        if not len(self.exits) or ctx.target is None:
            return None
        req = ctx.requests[i]
        j, k, _ = self.choose(self.acceptance(req.req_id), ctx.max_draft)
        if k == 0:
            self.no_draft += 1
            return None
        e = int(self.exits[j])
        self.last_exit[req.req_id] = e
        self.chosen[e] = self.chosen.get(e, 0) + 1
        return LayerPlan.early_exit(ctx.target.num_layers, e), k

    def free(self, req_id: str) -> None:
        super().free(req_id)
        self.per_request.pop(req_id, None)
        self.last_exit.pop(req_id, None)

    def metrics(self) -> dict:
        out = super().metrics()
        out.update(
            exit_layers=self.exits.tolist(),
            shadow_acceptance=[round(float(a), 3) for a in self.acceptance()],
            shadow_trials=[int(t) for t in self.trials],
            chosen_exits={int(k): v for k, v in sorted(self.chosen.items())},
            draft_step_cost=[round(float(c), 3) for c in self.step_costs()],
            no_draft_decisions=self.no_draft,
        )
        return out
