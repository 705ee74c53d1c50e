"""Synthetic simulation of draft-length controllers.

Requests draft ``max_draft`` tokens every step; each drafted token is accepted
with the request's current acceptance rate (which switches between regimes),
so a request with k drafts kept emits 1 + (accepted prefix) tokens. The step
time follows a synthetic cost curve ``a + b * tokens + c * batch`` (plus
the verify-step cost on a step that verifies any draft) with
multiplicative noise, and is
fed back to the controller as
``ctx.last_step_seconds`` exactly as the bridge does. Nothing here needs vLLM.

    python -m vllm_plugins.proposers.draft_length.simulator    # table of scenarios

``oracle`` is the goodput rule with the true acceptance rates and the true
cost curve: an upper reference for what a controller can reach.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field

import numpy as np

from vllm_plugins.proposers.draft_length import goodput_allocation, make_controller
from vllm_plugins.step_context import Drafts, RequestStep, StepContext

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class Scenario:
    name: str
    batch: int
    # a (s), b (s/token), c (s/request)[, verify-step cost (s, once per step
    # that verifies drafts)]
    cost: tuple[float, ...]
    regimes: tuple[float, ...] = (0.05, 0.5, 0.9)
    # Draft j (0-based) is accepted with probability alpha * pos_decay**j given
    # drafts before it were: 1.0 is the geometric model.
    pos_decay: float = 1.0
    switch_prob: float = 0.02                  # per request and step
    steps: int = 400
    max_draft: int = 6
    noise: float = 0.05                        # relative step-time noise (sd)
    mean_life: int = 100                       # steps per request
    confidence: str | None = None              # None | "calibrated" | "overconfident"
    seed: int = 0
    notes: str = field(default="", compare=False)


SCENARIOS = (
    Scenario("batch1-flat", batch=1, cost=(0.020, 0.00002, 0.0)),
    Scenario("batch8-moderate", batch=8, cost=(0.015, 0.0004, 0.0002)),
    Scenario("batch64-steep", batch=64, cost=(0.010, 0.0005, 0.0)),
    Scenario("batch64-steep-lowacc", batch=64, cost=(0.010, 0.0005, 0.0),
             regimes=(0.05, 0.3, 0.5)),
    Scenario("batch16-confidence", batch=16, cost=(0.015, 0.0003, 0.0),
             confidence="overconfident"),
    # A CPU-like curve at batch 16: 80 ms for a step without drafts, 1 ms
    # per drafted token, 6 ms more for a step that verifies any draft.
    Scenario("batch16-cpu-switch", batch=16, cost=(0.064, 0.001, 0.0, 0.006),
             regimes=(0.1, 0.35, 0.6)),
)


def _request_ids():
    i = 0
    while True:
        yield f"req-{i}"
        i += 1


def simulate(policy: str, scenario: Scenario, options: dict | None = None) -> dict:
    """Run one policy ('oracle' included) on a scenario; returns rates and stats."""
    sc = scenario
    rng = np.random.default_rng(sc.seed)          # the world: same for every policy
    ids = _request_ids()
    regimes = np.asarray(sc.regimes)
    a, b, c, *rest = sc.cost
    verify_step_s = rest[0] if rest else 0.0
    controller = None if policy == "oracle" else make_controller(
        policy, options or {}, sc.max_draft)

    req = [next(ids) for _ in range(sc.batch)]
    alpha = rng.choice(regimes, size=sc.batch)
    # Lifetimes count steps, not tokens, so every policy sees the same world:
    # the same requests, regime switches and acceptance draws at each step.
    left = rng.integers(sc.mean_life // 2, sc.mean_life * 3 // 2, size=sc.batch)
    prev_n = np.zeros(sc.batch, dtype=np.int64)     # drafts verified this step
    prev_m = np.zeros(sc.batch, dtype=np.int64)     # of which accepted
    prev_bonus = np.ones(sc.batch, dtype=np.int64)  # the target's token after them
    finished: set[str] = set()
    last_seconds, last_tokens = None, 0
    gen = exp = clock = 0.0
    ks = []
    t0 = time.perf_counter()

    for _ in range(sc.steps):
        # Drafts are token 0; the target's own token after the accepted
        # drafts is 0 exactly when the next draft would have been accepted.
        reqs = [RequestStep(req_id=req[i],
                            accepted=np.array([0] * prev_m[i] + [prev_bonus[i]], np.int64),
                            context=_EMPTY, num_prompt_tokens=0, num_draft=int(prev_n[i]),
                            verified_tokens=_EMPTY, topk_ids=None, topk_logprobs=None,
                            temperature=0.0) for i in range(sc.batch)]
        ctx = StepContext(requests=reqs, finished=finished, max_draft=sc.max_draft,
                          last_step_seconds=last_seconds, last_step_tokens=last_tokens)
        finished = set()
        # regime switches (the world moves before the drafts are made)
        switch = rng.random(sc.batch) < sc.switch_prob
        alpha = np.where(switch, rng.choice(regimes, size=sc.batch), alpha)
        cond = alpha[:, None] * sc.pos_decay ** np.arange(sc.max_draft)[None, :]
        conf = None
        if sc.confidence is not None:
            base = cond if sc.confidence == "calibrated" else np.sqrt(cond)
            noisy = base + rng.normal(0.0, 0.05, (sc.batch, sc.max_draft))
            conf = [np.clip(row, 0.0, 1.0).astype(np.float32) for row in noisy]
        drafts = Drafts(tokens=[[0] * sc.max_draft for _ in range(sc.batch)],
                        confidence=conf)
        if controller is None:
            pos = np.arange(sc.max_draft)
            q = np.cumprod(alpha[:, None] * sc.pos_decay ** pos[None, :], axis=1)
            keep, _, _ = goodput_allocation(q, np.ones_like(q, bool), a + c * sc.batch, b,
                                            verify_step_s)
        else:
            observation = controller.observe(ctx)
            keep = np.asarray(controller.decide(ctx, drafts, observation), dtype=np.int64)
        ks.append(keep)
        # verification
        draws = rng.random((sc.batch, sc.max_draft)) < cond
        run = np.cumprod(draws, axis=1).sum(1)           # leading accepted drafts
        m = np.minimum(run, keep)
        emitted = m + 1
        tokens = int((keep + 1).sum())
        seconds = ((a + b * tokens + c * sc.batch + (verify_step_s if keep.any() else 0.0))
                   * max(0.2, 1 + sc.noise * rng.normal()))
        gen += emitted.sum()
        exp += float((1 + (np.cumprod(cond, axis=1)
                           * (np.arange(sc.max_draft) < keep[:, None])).sum(1)).sum())
        clock += seconds
        last_seconds, last_tokens = seconds, tokens
        prev_n, prev_m = keep.copy(), m.copy()
        prev_bonus = np.where(run > keep, 0, 1)
        left = left - 1
        for i in np.nonzero(left <= 0)[0]:
            finished.add(req[i])
            req[i] = next(ids)
            left[i] = rng.integers(sc.mean_life // 2, sc.mean_life * 3 // 2)
            alpha[i] = rng.choice(regimes)
            prev_n[i] = prev_m[i] = 0
            prev_bonus[i] = 1

    ks = np.concatenate(ks)
    out = {
        "policy": policy,
        "scenario": sc.name,
        "tokens_per_s": gen / clock,
        "expected_tokens_per_s": exp / clock,
        "mean_k": float(ks.mean()),
        "zero_share": float((ks == 0).mean()),
        "controller_ms_per_step": 1e3 * (time.perf_counter() - t0) / sc.steps,
    }
    if controller is not None:
        out["stats"] = controller.stats()
    return out


def compare(scenarios=SCENARIOS, policies=("fixed", "acceptance", "confidence",
                                           "goodput", "oracle")) -> list[dict]:
    return [simulate(p, sc) for sc in scenarios for p in policies]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args(argv)
    scenarios = SCENARIOS
    if args.steps:
        from dataclasses import replace
        scenarios = tuple(replace(s, steps=args.steps) for s in SCENARIOS)
    print(f"{'scenario':22} {'policy':11} {'tok/s':>9} {'E tok/s':>9} "
          f"{'mean k':>7} {'k=0':>6}")
    for r in compare(scenarios):
        print(f"{r['scenario']:22} {r['policy']:11} {r['tokens_per_s']:9.1f} "
              f"{r['expected_tokens_per_s']:9.1f} {r['mean_k']:7.2f} "
              f"{r['zero_share']:6.2f}")


if __name__ == "__main__":
    main()
