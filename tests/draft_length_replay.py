"""A deterministic engine-like step sequence for replaying proposers under
each draft-length policy.

The world plays the engine's part without vLLM: each request has a hidden
text (prompts and outputs built from a phrase bank, so drafts from tables
and from n-gram lookup hit sometimes and miss sometimes), chunked prefill,
requests that join and finish (rows condensed as vLLM's input batch does),
batch sizes 1, 8 and 16, the target's top-k at every verified position, and
step times from a cost curve with seeded noise. It is closed-loop: what a
proposer keeps decides what is verified and accepted next, so any change in
drafts or in the controller's decisions shows in every step after it.

    python tests/draft_length_replay.py OUT.json.gz   # record a fixture

``tests/test_draft_length_replay.py`` replays the fixture recorded at the
commit before the controllers became a package and requires the same
drafts, draft budgets, kept lengths, rests and statistics.
"""

from __future__ import annotations

import gzip
import json
import math
import sys

import numpy as np

from vllm_plugins.step_context import RequestStep, StepContext

VOCAB = 1024
CHUNK = 64            # prefill tokens a request runs per step
# (steps, concurrent requests, share of requests with repetitive text)
PHASES = ((120, 1, 0.7), (160, 8, 0.5), (160, 16, 0.3), (100, 16, 0.0),
          (80, 4, 0.8))
# Step time: a + b * tokens + c * batch, plus d on a step that verifies drafts.
COST = (0.025, 0.0009, 0.0005, 0.004)
POLICIES = ("fixed", "acceptance", "confidence", "goodput")
METHODS = ("token_recycling", "ngram_adaptive")
# Non-default options, for the estimator's window mode and the cost model
# without the batch term.
VARIANTS = {"goodput-window": ("goodput", {"estimator": "window",
                                           "cost_features": "tokens",
                                           "use_confidence": False})}


class _Request:
    def __init__(self, rid: str, text: np.ndarray, prompt: int, max_out: int,
                 abort_at: int | None):
        self.rid = rid
        self.text = text
        self.prompt = prompt
        self.max_out = max_out
        self.abort_at = abort_at
        self.prefilled = 0      # prompt tokens run so far
        self.pos = 0            # tokens known (prompt + output), once prefilled
        self.drafts: list[int] = []
        self.out = 0


class World:
    def __init__(self, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        r = self.rng
        self.phrases = [r.integers(0, VOCAB, r.integers(4, 11)) for _ in range(80)]
        self.next_id = 0

    def text(self, repetitive: bool, length: int) -> np.ndarray:
        r = self.rng
        own = r.choice(len(self.phrases), 5, replace=False)
        out: list[int] = []
        while len(out) < length:
            if repetitive and r.random() < 0.85:
                out += list(self.phrases[own[r.integers(0, 5)]])
            elif r.random() < 0.3:
                out += list(self.phrases[r.integers(0, len(self.phrases))])
            else:
                out += list(r.integers(0, VOCAB, r.integers(1, 6)))
        return np.array(out[:length], dtype=np.int64)

    def request(self, repetitive: bool) -> _Request:
        r = self.rng
        prompt = int(r.integers(12, 160))
        max_out = int(r.integers(20, 90))
        abort = int(r.integers(5, max_out)) if r.random() < 0.1 else None
        rid = f"{self.next_id}-{'rep' if repetitive else 'free'}"
        self.next_id += 1
        return _Request(rid, self.text(repetitive, prompt + max_out + 16), prompt,
                        max_out, abort)


def topk_at(text: np.ndarray, pos: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The target's top-k for the token at ``pos``: the text's token first,
    with a confidence that depends on the position and token."""
    tok = int(text[pos])
    h = (tok * 2654435761 + pos * 40503) % 1000
    top = 0.2 + 0.78 * h / 999.0
    ids = [tok] + [(tok * 7 + 131 * j + pos) % VOCAB for j in range(1, k)]
    rest = (1.0 - top) / max(k - 1, 1)
    lps = [math.log(top)] + [math.log(rest * 0.8 ** j) for j in range(1, k)]
    return np.array(ids, dtype=np.int64), np.array(lps, dtype=np.float32)


def run(proposer, seed: int = 0) -> dict:
    """Drive ``proposer`` through the phases; returns what it did each step."""
    world = World(seed)
    noise = np.random.default_rng(seed + 1)
    a, b, c, d = COST
    batch: list[_Request] = []
    finished: set[str] = set()
    topk_rows = proposer.TOPK
    want_topk = proposer.topk_wanted()
    last_propose = None
    steps = []
    budgets: list[int] = []
    called = []

    real_budget = proposer.draft_budget
    real_draft = proposer.draft

    def budget(ctx, req_id):
        out = real_budget(ctx, req_id)
        budgets.append(int(out))
        return out

    def draft(ctx):
        called.append(True)
        return real_draft(ctx)

    proposer.draft_budget = budget
    proposer.draft = draft
    keeps: list[list[int]] = []
    if proposer.controller is not None:
        real_decide = proposer.controller.decide

        def decide(*args, **kwargs):
            out = real_decide(*args, **kwargs)
            keeps.append([int(k) for k in out])
            return out

        proposer.controller.decide = decide

    for target, share in ((n, s) for steps_, n, s in PHASES for _ in range(steps_)):
        # Arrivals: up to 3 a step until the phase's concurrency is reached.
        for _ in range(min(3, max(target - len(batch), 0))):
            batch.append(world.request(world.rng.random() < share))
        # The forward: prefill chunks, and verification of last step's drafts.
        tokens = 0
        verifies = False
        requests = []
        for q in batch:
            if q.prefilled < q.prompt:
                chunk = min(CHUNK, q.prompt - q.prefilled)
                q.prefilled += chunk
                tokens += chunk
                if q.prefilled < q.prompt:
                    accepted = np.zeros(0, np.int64)
                else:   # the last chunk samples the first output token
                    q.pos = q.prompt + 1
                    q.out = 1
                    accepted = q.text[q.prompt:q.prompt + 1].copy()
                num_draft, verified, ids, lps = 0, np.zeros(0, np.int64), None, None
                if len(accepted):
                    verified = q.text[q.prompt - 1:q.prompt].copy()
                    if want_topk:
                        ids, lps = (x[None] for x in topk_at(q.text, q.prompt, topk_rows))
            else:
                dr = np.asarray(q.drafts, dtype=np.int64)
                tokens += 1 + len(dr)
                verifies |= len(dr) > 0
                truth = q.text[q.pos:q.pos + len(dr)]
                miss = np.nonzero(dr != truth)[0]
                m = int(miss[0]) if len(miss) else len(dr)
                accepted = q.text[q.pos:q.pos + m + 1].copy()
                verified = np.concatenate([q.text[q.pos - 1:q.pos], dr])
                num_draft = len(dr)
                ids = lps = None
                if want_topk:
                    rows = [topk_at(q.text, q.pos + j, topk_rows) for j in range(len(dr) + 1)]
                    ids = np.stack([x[0] for x in rows])
                    lps = np.stack([x[1] for x in rows])
                q.pos += m + 1
                q.out += m + 1
            requests.append(RequestStep(
                req_id=q.rid, accepted=accepted, context=q.text[:q.pos].copy()
                if q.prefilled >= q.prompt else q.text[:q.prefilled].copy(),
                num_prompt_tokens=q.prompt, num_draft=num_draft,
                verified_tokens=verified, topk_ids=ids, topk_logprobs=lps,
                temperature=0.0, group_id=q.rid))
        size = len(batch)
        seconds = ((a + b * tokens + c * size + (d if verifies else 0.0))
                   * max(0.3, 1.0 + 0.05 * noise.normal()))
        topk_seconds = 0.0002 * size if want_topk and size else None
        ctx = StepContext(requests=requests, finished=finished,
                          max_draft=proposer.max_draft,
                          last_step_seconds=seconds if size else None,
                          last_step_tokens=tokens,
                          last_propose_seconds=last_propose,
                          last_topk_seconds=topk_seconds,
                          last_gap_seconds=0.002 * (1.0 + 0.1 * noise.random()))
        finished = set()
        budgets.clear()
        called.clear()
        n_keeps = len(keeps)
        drafts = proposer.step(ctx)
        want_topk = proposer.topk_wanted()
        tokens_out = [[int(t) for t in row] for row in drafts.tokens]
        steps.append({
            "batch": [q.rid for q in batch],
            "drafts": tokens_out,
            "budgets": list(budgets),
            "drafted": bool(called),
            "keep": keeps[n_keeps] if len(keeps) > n_keeps else None,
            "topk_next": int(want_topk),
        })
        # The proposer's own time: deterministic, larger when it worked.
        last_propose = 0.0003 + (0.00008 * size if called else 0.0)
        for q, row in zip(batch, tokens_out):
            q.drafts = row if q.prefilled >= q.prompt else []
        # Finished and aborted requests leave; vLLM's condense moves the
        # last row into each hole.
        i = 0
        while i < len(batch):
            q = batch[i]
            done = q.prefilled >= q.prompt and (
                q.out >= q.max_out or (q.abort_at is not None and q.out >= q.abort_at))
            if done:
                finished.add(q.rid)
                last = batch.pop()
                if last is not q:
                    batch[i] = last
                continue
            i += 1
    stats = proposer.metrics().get("draft_length")
    return {"steps": steps, "stats": _plain(stats)}


def _plain(value):
    """JSON-ready, floats rounded to 12 significant digits."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (np.floating, float)):
        v = float(value)
        return v if not math.isfinite(v) else float(f"{v:.12g}")
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.bool_):
        return bool(value)
    return value


def make_proposer(method: str, policy: str):
    policy, policy_options = VARIANTS.get(policy, (policy, None))
    options = {"draft_length": policy, "draft_length_options": policy_options}
    if method == "token_recycling":
        from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

        return TokenRecyclingProposer(options=options, vocab_size=VOCAB)
    from vllm_plugins.proposers.ngram_adaptive import NgramAdaptiveProposer

    return NgramAdaptiveProposer(options=options)


def simulator_runs() -> dict:
    """Every policy on the simulator's scenarios, shortened."""
    from dataclasses import replace

    from vllm_plugins.proposers.draft_length import simulator as sim

    out = {}
    for sc in sim.SCENARIOS:
        for policy in ("fixed", "acceptance", "confidence", "goodput", "oracle"):
            r = sim.simulate(policy, replace(sc, steps=150))
            r.pop("controller_ms_per_step")
            out[f"{sc.name}/{policy}"] = _plain(r)
    return out


def record() -> dict:
    runs = {f"{m}/{p}": run(make_proposer(m, p))
            for m in METHODS for p in (*POLICIES, *VARIANTS)}
    return {"runs": runs, "simulator": simulator_runs()}


if __name__ == "__main__":
    data = record()
    with gzip.open(sys.argv[1], "wt") as f:
        json.dump(data, f, separators=(",", ":"))
    for name, r in data["runs"].items():
        st = r["stats"] or {}
        print(name, len(r["steps"]), "steps; kept", sum(sum(s["keep"] or [0])
                                                         for s in r["steps"]),
              "rest", st.get("rest_steps"), "probes", st.get("probes"))
