"""A proposer's own time per engine step, no engine: methods side by side on
the same synthetic steps, interleaved.

The engine waits for the proposer every step (learning from the verified
rows, drafting, the draft-length policy), so its time adds to every step's.
Here each method's proposer runs alone on steps a synthetic target writes:
a Markov chain over ``--distinct`` token ids spread over a ``--vocab``
vocabulary, each id with eight successors of falling probability, so text
repeats itself as real output does and every source finds something. Each
request starts from a prompt the chain wrote (``--prompt`` tokens) and
writes ``--output`` tokens; a finished request is replaced at once, so the
batch stays full. The target accepts a draft as sampled decoding would
(a deterministic draft's tree walked with the target's draws) and hands
the proposer its top-k at every verified row, as the bridge does.

Times are the thread's CPU time (``time.thread_time``): on a shared host
other work stretches wall time, not this. Every method runs with
``draft_length: "fixed"`` unless ``--draft-length`` names another policy;
then each step carries a step time from a fixed cost line with seeded
noise (a policy that reads step times has them, and decides the same way
every run). Every method sees the same prompts, and the steps of the
methods alternate (rotating which goes first), so load on the host hits
all alike. ``--flush-mb`` writes that much memory before each step, as a
forward does, so each step starts with cold caches. Reported per method
and batch size: the median and mean CPU milliseconds of
``PluginProposer.step`` over the timed steps, drafted nodes and accepted
tokens per step, and each method's median over the first's of the paired
steps' times. ``--parts`` also times the hybrid's parts and the
draft-length controller's.

    python -m vllm_plugins.bench proposer-cost --batch-sizes 1,16 --parts
    # the goodput controller's own time at batch 1, caches cold:
    python -m vllm_plugins.bench proposer-cost --methods token_recycling --batch-sizes 1 \
        --draft-length goodput --flush-mb 64 --parts --steps 1500 --warmup 200
"""

from __future__ import annotations

import argparse
import json
import os
import time
from types import SimpleNamespace

import numpy as np

from vllm_plugins.bench.cli import _int_list

# Each method's defaults but the policy; Token Recycling's trees and the
# hybrid at 16 nodes, one size for both.
DEFAULT_METHODS = {
    "token_recycling": {"method": "token_recycling", "draft_length": "fixed"},
    "token_recycling_tree": {"method": "token_recycling", "draft_length": "fixed",
                             "draft_shape": "tree", "num_speculative_tokens": 16},
    "hybrid": {"method": "hybrid", "draft_length": "fixed", "num_speculative_tokens": 16},
}
SUCCESSORS = 8
# The synthetic step time under --draft-length: seconds = a + b * tokens +
# c * requests, plus d on a step that verifies drafts, times (1 + 5% noise).
STEP_COST = (0.020, 0.0012, 0.001, 0.002)


class Target:
    """The synthetic target: successor ids and probabilities per token."""

    def __init__(self, vocab: int, distinct: int, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.ids = rng.choice(vocab, size=distinct, replace=False).astype(np.int64)
        self.index = {int(t): i for i, t in enumerate(self.ids)}
        self.succ = self.ids[rng.integers(0, distinct, size=(distinct, SUCCESSORS))]
        p = rng.dirichlet(np.full(SUCCESSORS, 0.4), size=distinct)
        order = np.argsort(-p, axis=1)
        self.succ = np.take_along_axis(self.succ, order, 1)
        self.prob = np.take_along_axis(p, order, 1)
        self.cdf = np.cumsum(self.prob, 1)

    def draw(self, token: int, rng) -> int:
        i = self.index[int(token)]
        return int(self.succ[i, min(np.searchsorted(self.cdf[i], rng.random()),
                                    SUCCESSORS - 1)])

    def topk(self, tokens, k: int):
        rows = np.array([self.index[int(t)] for t in tokens], np.int64)
        ids = np.zeros((len(rows), k), np.int64)
        lps = np.full((len(rows), k), -30.0, np.float32)
        w = min(k, SUCCESSORS)
        ids[:, :w] = self.succ[rows, :w]
        lps[:, :w] = np.log(self.prob[rows, :w])
        return ids, lps


def build(spec: dict, vocab: int):
    """The method's proposer as the worker builds it (translated options,
    its num_speculative_tokens), loaded."""
    from vllm_plugins.registry import METHODS, PLUGIN_OPTIONS_ATTR, translate

    vllm_spec, options = translate(dict(spec))
    cls = METHODS[options["method"]].proposer_class()
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=vllm_spec["num_speculative_tokens"],
            **{PLUGIN_OPTIONS_ATTR: options}),
        model_config=SimpleNamespace(get_vocab_size=lambda: vocab))
    p = cls(config)
    p.load_model(None)
    return p


class Lane:
    """One method's requests, steps and timings."""

    def __init__(self, name, proposer, target, args, batch):
        from vllm_plugins.step_context import RequestStep, StepContext
        from vllm_plugins.tree import children

        self._RequestStep, self._StepContext, self._children = (RequestStep, StepContext,
                                                                children)
        self.name, self.p, self.target, self.args, self.batch = (name, proposer, target,
                                                                 args, batch)
        self.rng = np.random.default_rng(args.seed)   # same prompts for every method
        self.started = 0
        self.live = [self._new() for _ in range(batch)]
        self.finished: set[str] = set()
        self.times: list[float] = []
        self.nodes = self.accepted = self.steps = 0
        self.parts: dict[str, float] = {}
        self._timing = False
        self.noise = np.random.default_rng(args.seed + 1)
        self.flush = np.zeros((args.flush_mb << 20) // 8)

    def time_parts(self) -> None:
        """Time a hybrid's parts too: each source's ``learn``, ``propose``
        and ``sent``, the step's merge and outcomes, the calibration."""
        p = self.p
        targets = [(s, m, f"source {s.name}.{m}") for s in getattr(p, "sources", ())
                   for m in ("learn", "propose", "sent")]
        if hasattr(p, "merger"):
            targets += [(p.merger, "merge_step", "merge_step"),
                        (p.merger, "outcomes_step", "outcomes_step"),
                        (p.calibrator, "learn", "calibration")]
        if p.controller is not None:
            targets += [(p.controller, m, "controller") for m in ("observe", "max_length", "shape")]
        for obj, name, label in targets:
            def timed(*a, _f=getattr(obj, name), _label=label, **k):
                t0 = time.thread_time()
                try:
                    return _f(*a, **k)
                finally:
                    if self._timing:
                        self.parts[_label] = (self.parts.get(_label, 0.0)
                                              + time.thread_time() - t0)
            setattr(obj, name, timed)

    def _new(self) -> dict:
        t = self.target
        tok = [int(t.ids[self.rng.integers(len(t.ids))])]
        for _ in range(self.args.prompt):
            tok.append(t.draw(tok[-1], self.rng))
        self.started += 1
        return {"id": f"{self.name}-{self.started}", "context": tok, "accepted": tok[-1:],
                "verified": tok[-2:-1], "prompt": len(tok) - 1,
                "params": SimpleNamespace(temperature=1.0, extra_args=None)}

    def _step_times(self, reqs) -> dict:
        """The step's times for a policy that reads them (``--draft-length``):
        the previous step's seconds from ``STEP_COST``; fixed top-k,
        proposer and engine times, so the policy decides the same way on
        any host."""
        if self.args.draft_length is None:
            return {}
        a, b, c, d = STEP_COST
        tokens = sum(1 + int(r.num_draft) for r in reqs)
        verifies = any(r.num_draft for r in reqs)
        seconds = (a + b * tokens + c * len(reqs) + d * verifies) \
            * (1.0 + 0.05 * self.noise.standard_normal())
        return {"last_step_seconds": seconds, "last_step_tokens": tokens,
                "last_propose_seconds": 0.0004, "last_topk_seconds": 0.0002,
                "last_gap_seconds": 0.001}

    def step(self, timed: bool) -> None:
        k = max(self.p.topk_wanted(), 1)
        reqs = []
        for r in self.live:
            ids, lps = self.target.topk(r["verified"], k)
            reqs.append(self._RequestStep(
                r["id"], np.asarray(r["accepted"], np.int64),
                np.asarray(r["context"], np.int64), r["prompt"], len(r["verified"]) - 1,
                np.asarray(r["verified"], np.int64), ids, lps, 1.0,
                sampling_params=r["params"]))
        ctx = self._StepContext(reqs, finished=self.finished, max_draft=self.p.max_draft,
                                **self._step_times(reqs))
        self.flush[::8] += 1.0   # every cache line: the caches go cold, as after a forward
        self._timing = timed
        t0 = time.thread_time()
        d = self.p.step(ctx)
        dt = time.thread_time() - t0
        self._timing = False
        if timed:
            self.times.append(dt)
            self.steps += 1
        self.finished = set()
        for i, r in enumerate(self.live):
            tok = [int(x) for x in d.tokens[i]]
            par = (d.parents[i] if d.parents and d.parents[i] is not None
                   else list(range(-1, len(tok) - 1)))
            kids = self._children(par)
            out, row, last = [], 0, r["context"][-1]
            while True:
                x = self.target.draw(last if row == 0 else tok[row - 1], self.rng)
                out.append(x)
                child = next((c for c in kids[row] if tok[c] == x), None)
                if child is None:
                    break
                row = child + 1
            if timed:
                self.nodes += len(tok)
                self.accepted += len(out) - 1
            r["verified"] = [last] + tok
            r["accepted"] = out
            r["context"] = r["context"] + out
        for r in [r for r in self.live if len(r["context"]) - r["prompt"] >= self.args.output]:
            self.live.remove(r)
            self.finished.add(r["id"])
            self.live.append(self._new())


def run(methods: dict, batch_sizes, args) -> list[dict]:
    target = Target(args.vocab, args.distinct, args.seed)
    rows = []
    if args.draft_length is not None:
        methods = {name: {**spec, "draft_length": args.draft_length}
                   for name, spec in methods.items()}
    for batch in batch_sizes:
        lanes = [Lane(name, build(spec, args.vocab), target, args, batch)
                 for name, spec in methods.items()]
        if args.parts:
            for lane in lanes:
                lane.time_parts()
        for s in range(args.warmup + args.steps):
            order = lanes[s % len(lanes):] + lanes[:s % len(lanes)]
            for lane in order:
                lane.step(timed=s >= args.warmup)
        first = np.asarray(lanes[0].times)
        for lane in lanes:
            t = np.asarray(lane.times) * 1e3
            rows.append({
                "method": lane.name, "batch": batch, "steps": lane.steps,
                "median_ms": float(np.median(t)), "mean_ms": float(t.mean()),
                "nodes_per_step": lane.nodes / max(lane.steps, 1),
                "accepted_per_step": lane.accepted / max(lane.steps, 1),
                f"ratio_to_{lanes[0].name}": float(np.median(np.asarray(lane.times) / first)),
                "parts_ms": {k: v * 1e3 / max(lane.steps, 1) for k, v in
                             sorted(lane.parts.items(), key=lambda kv: -kv[1])},
            })
    return rows


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench proposer-cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 16],
                   help="comma list, e.g. 1,16")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of {list(DEFAULT_METHODS)}; the first is the "
                        f"ratios' reference")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="add a method: a name and its speculative_config as JSON")
    p.add_argument("--steps", type=int, default=300, help="timed steps per method")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps first")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--distinct", type=int, default=300,
                   help="token ids the target writes")
    p.add_argument("--prompt", type=int, default=400)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", action="store_true",
                   help="also time the hybrid's parts (sources, merge, outcomes, "
                        "calibration) and the draft-length controller: mean ms a step "
                        "and share of its step")
    p.add_argument("--draft-length", default=None, metavar="POLICY",
                   help="every method under this draft-length policy (default: fixed), "
                        "its steps timed by a synthetic cost line")
    p.add_argument("--flush-mb", type=int, default=0,
                   help="write this many MB before each step, so it starts with cold "
                        "caches as after a forward (64 is more than this host's caches)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    methods = {}
    for name in args.methods.split(","):
        if name not in DEFAULT_METHODS:
            raise SystemExit(f"--methods: unknown {name!r}; known {list(DEFAULT_METHODS)}")
        methods[name] = DEFAULT_METHODS[name]
    for item in args.extra:
        name, _, spec = item.partition("=")
        methods[name] = json.loads(spec)
    rows = run(methods, args.batch_sizes, args)
    ref = next(iter(methods))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"| batch | method | median CPU ms | mean CPU ms | nodes/step | accepted/step | "
          f"x {ref} |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['batch']} | {r['method']} | {r['median_ms']:.3f} | {r['mean_ms']:.3f} | "
              f"{r['nodes_per_step']:.1f} | {r['accepted_per_step']:.2f} | "
              f"{r[f'ratio_to_{ref}']:.2f} |")
    for r in rows:
        if r["parts_ms"]:
            rest = r["mean_ms"] - sum(r["parts_ms"].values())
            parts = [*r["parts_ms"].items(), ("the rest (its own loop)", rest)]
            print(f"{r['method']} at batch {r['batch']}, mean CPU ms a step and share: " + "; ".join(
                f"{k} {v:.3f} ({v / r['mean_ms']:.0%})" for k, v in parts if v >= 0.0005))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


