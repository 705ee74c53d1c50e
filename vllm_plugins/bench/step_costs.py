"""What a verification step costs by its token count, chain against tree.

The goodput policy fits the engine's step time online as a line with a few
step-level terms (docs/draft_length_design.md). This measures the curve itself, one
request at a time: two engines in this process, Token Recycling drafting up
to ``--nodes`` nodes at every step (``draft_length`` fixed, no confidence
floor) as a chain in one and as a tree in the other, each prompt run on both
in turn. Each step's time is read where the bridge measures it for the
policy (``StepContext.last_step_seconds``: the runner's forward and vLLM's
sampler, the tree path's planning, masked attention, acceptance and K/V
moves included), and grouped by the step's token count and by what it
verified: nothing, a chain, or a tree.

    python -m vllm_plugins.bench step-costs --nodes 8 --prompts 6 --max-tokens 128

A tree step's own cost is the tree median less the chain median at the same
token count, to within how far the two engines' steps without drafts lie
apart (printed below the table). Token Recycling offers fewer nodes where
its tables know less, so both engines see a spread of counts up to
``--nodes + 1``. The engines run
in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which is what lets
the steps be read here; on a GPU the same command shows what a token and a
tree cost there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections import defaultdict
from dataclasses import dataclass

NONE, CHAIN, TREE = "none", "chain", "tree"


@dataclass
class StepRecord:
    engine: str       # "chain" or "tree": the engine's draft shape
    tokens: int       # the step's token count
    verified: str     # NONE, CHAIN or TREE: what the step verified
    seconds: float    # the bridge's step time
    propose_seconds: float


def verified_shape(parents, num_draft: int) -> str:
    """What a step verified, from the parents of the drafts sent for it and
    the number vLLM verified (a prefix): as the bridge decides."""
    if num_draft <= 0:
        return NONE
    from vllm_plugins.bridge.v1.tree_step import chain_length

    if parents is None:
        return CHAIN
    head = parents[:num_draft]
    return CHAIN if chain_length(head) == len(head) else TREE


def summarize(records: list[StepRecord]) -> list[dict]:
    """Per token count: steps and median milliseconds of each engine's
    steps by what they verified, and the tree's extra over the chain where
    both verified drafts at that count."""
    groups: dict[tuple, list[StepRecord]] = defaultdict(list)
    for r in records:
        groups[(r.tokens, r.verified)].append(r)
    rows = []
    for tokens in sorted({r.tokens for r in records}):
        row = {"tokens": tokens}
        for kind in (NONE, CHAIN, TREE):
            got = groups.get((tokens, kind), [])
            row[f"{kind}_steps"] = len(got)
            row[f"{kind}_ms"] = 1e3 * statistics.median(r.seconds for r in got) if got else None
        if row["chain_ms"] is not None and row["tree_ms"] is not None:
            row["tree_extra_ms"] = row["tree_ms"] - row["chain_ms"]
        else:
            row["tree_extra_ms"] = None
        rows.append(row)
    return rows


def table(rows: list[dict], min_steps: int) -> str:
    def ms(v):
        return "" if v is None else f"{v:.1f}"

    lines = ["| tokens | no drafts: steps, ms | chain: steps, ms | tree: steps, ms "
             "| tree - chain (ms) |", "|---:|---|---|---|---:|"]
    for r in rows:
        counts = [r[f"{k}_steps"] for k in (NONE, CHAIN, TREE)]
        if max(counts) < min_steps:
            continue
        cells = [f"{r[f'{k}_steps']}, {ms(r[f'{k}_ms'])}" if r[f"{k}_steps"] else ""
                 for k in (NONE, CHAIN, TREE)]
        extra = r["tree_extra_ms"] if min(r["chain_steps"], r["tree_steps"]) >= min_steps \
            else None
        lines.append(f"| {r['tokens']} | {' | '.join(cells)} | {ms(extra)} |")
    return "\n".join(lines)


def record_steps(records: list[StepRecord], current: dict) -> None:
    """Wraps ``PluginProposer.step`` in this process so every step of the
    engine named by ``current["engine"]`` is appended to ``records``."""
    from vllm_plugins.proposers.base import PluginProposer

    original = PluginProposer.step
    sent: dict = {}

    def step(self, ctx):
        if ctx.last_step_seconds is not None and len(ctx.requests) == 1 \
                and ctx.last_step_tokens <= 1 + int(self.max_draft):
            r = ctx.requests[0]
            parents = sent.get((id(self), r.req_id))
            records.append(StepRecord(current["engine"], int(ctx.last_step_tokens),
                                      verified_shape(parents, int(r.num_draft)),
                                      float(ctx.last_step_seconds),
                                      float(ctx.last_propose_seconds or 0.0)))
        drafts = original(self, ctx)
        for i, r in enumerate(ctx.requests):
            p = drafts.parents[i] if drafts.parents is not None and i < len(drafts.parents) \
                else None
            sent[(id(self), r.req_id)] = p
        return drafts

    PluginProposer.step = step


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench step-costs",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--nodes", type=int, default=8, help="drafts (nodes) per step, 1..64")
    p.add_argument("--prompts", type=int, default=6,
                   help="Spec-Bench dev prompts, spread over the split")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--min-steps", type=int, default=3,
                   help="table rows need this many steps of one kind")
    p.add_argument("--out", default=None, help="a JSON file for the records and rows")
    args = p.parse_args(argv)
    if not 1 <= args.nodes <= 64:
        p.error(f"--nodes must be in 1..64, got {args.nodes}")
    if args.prompts < 1:
        p.error(f"--prompts must be positive, got {args.prompts}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_plugins.bench.engines import quiet_vllm

    quiet_vllm()
    from vllm import SamplingParams

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.bench.engines import build_engine, resolve_model, run_batch

    records: list[StepRecord] = []
    current = {"engine": ""}
    record_steps(records, current)
    model = resolve_model(args.model)
    engines = {}
    for shape in (CHAIN, TREE):
        engines[shape] = build_engine(model, {
            "method": "token_recycling", "num_speculative_tokens": args.nodes,
            "draft_shape": shape, "draft_length": "fixed", "min_confidence": 0})
    tokenizer = engines[CHAIN].get_tokenizer()
    questions = load_questions()
    stride = max(1, len(questions) // args.prompts)
    prompts = [render(tokenizer, q) for q in questions[::stride][:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for i, prompt in enumerate(prompts):
        for shape in ((CHAIN, TREE) if i % 2 == 0 else (TREE, CHAIN)):
            current["engine"] = shape
            run_batch(engines[shape], [prompt], params)
    rows = summarize(records)
    propose = {s: 1e3 * statistics.median(r.propose_seconds for r in records if r.engine == s)
               for s in (CHAIN, TREE) if any(r.engine == s for r in records)}
    plain = {s: 1e3 * statistics.median(r.seconds for r in records
                                        if r.engine == s and r.verified == NONE)
             for s in (CHAIN, TREE) if any(r.engine == s and r.verified == NONE
                                           for r in records)}
    print(f"Token Recycling, {args.nodes} nodes a step, {len(prompts)} prompts, batch 1; "
          "median step time by token count:\n")
    print(table(rows, args.min_steps))
    # The two engines' steps without drafts: how far apart two engines of one
    # process run, the resolution of the tree - chain column.
    print("\nno drafts, median ms a step: " + ", ".join(f"{s} engine {v:.1f}"
                                                      for s, v in plain.items()))
    print("proposer, median ms a step: " + ", ".join(f"{s} {v:.2f}" for s, v in propose.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "propose_ms": propose,
                       "no_draft_ms": plain,
                       "records": [r.__dict__ for r in records]}, f, indent=1)
    return 0
