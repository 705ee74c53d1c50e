"""Where a tree step's time goes, part by part, against a chain step of
the same tokens.

Two Token Recycling engines in this process draft the same kind of tree
(``--nodes`` nodes a request, ``draft_length`` fixed, no confidence floor);
one sends each tree as drafted, the other sends the same nodes as a chain
(node order, parents dropped), which vLLM verifies on its own path. So both
verify the same token counts, and only the tree path's own work differs.
The same prompts run on both in turn, ``--batch`` at a time. The bridge's
tree-path functions are timed where the runner calls them (planning,
positions, attention, sampling, acceptance, the K/V move), with vLLM's
attention layers and the proposer's step beside them; a step's time is the
bridge's own (``StepContext.last_step_seconds``).

    python -m vllm_plugins.bench tree-profile --batch 8 --nodes 16

Prints the median milliseconds of each part per verifying step, then the
median step time by token count for both engines.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import time
from collections import defaultdict

CHAIN, TREE = "chain", "tree"

# The attention layers, timed by ``time_attention``, and the bridge's tree
# route on them.
ATTENTION = ("attention layers (all)", "vllm.v1.attention.backends.cpu_attn",
             "CPUAttentionBackendImpl.forward")
ATTENTION_ROUTE = "tree.cpu_attention"

# (label, module, attribute) of each timed part. Callers reach each through
# its module (or class), so replacing that attribute times every call.
PARTS = (
    ("plan (positions, masks)", "vllm_plugins.bridge.v1.tree_step", "plan"),
    ("rotary positions by depth", "vllm_plugins.bridge.v1.tree_step", "depth_positions"),
    ATTENTION,
    ("  tree path's plan", "vllm_plugins.bridge.v1.tree_step", "plan_attention"),
    ("  tree rows", "vllm_plugins.bridge.v1.tree_step", "tree_attention_planned"),
    ("sampling (all)", "vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample"),
    ("  tree acceptance", "vllm_plugins.bridge.v1.tree_step", "accept"),
    ("  K/V move", "vllm_plugins.bridge.v1.tree_step", "move_accepted_kv"),
    ("proposer step", "vllm_plugins.proposers.base", "PluginProposer.step"),
)


def install_timers(spent: dict) -> None:
    """Wraps every part of ``PARTS`` but the attention layers
    (``time_attention``) so its seconds add up in ``spent``."""
    for label, module, attr in PARTS:
        if (label, module, attr) == ATTENTION:
            continue
        owner = importlib.import_module(module)
        *path, name = attr.split(".")
        for p in path:
            owner = getattr(owner, p)
        setattr(owner, name, timer(spent, label, getattr(owner, name), {}))


def timer(spent: dict, label: str, fn, running: dict):
    """``fn`` adding its seconds to ``spent[label]``; timers sharing
    ``running`` count a call within another's once, in the outer one."""

    def timed(*args, **kwargs):
        if running.get(label):
            return fn(*args, **kwargs)
        running[label] = True
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            running[label] = False
            spent[label] += time.perf_counter() - t0

    return timed


def time_attention(spent: dict) -> None:
    """Times the attention layers as one part on both engines: vLLM's CPU
    attention as the class runs it (a chain step, and the rows a tree step
    leaves to vLLM), and the bridge's per-instance tree route
    (``tree.cpu_attention``) that a tree step's layers run instead. The
    class's timer goes on before the bridge's patches, which then wrap it
    as vLLM's own (so the route stays an applied patch), and the route's
    replacement is rebuilt timed; the vLLM call within it counts once."""
    from vllm_plugins.bridge import install
    from vllm_plugins.bridge.patches import named
    from vllm_plugins.bridge.patching import rebuild

    label, module, attr = ATTENTION
    owner_name, name = attr.split(".")
    owner = getattr(importlib.import_module(module), owner_name)
    running: dict = {}
    setattr(owner, name, timer(spent, label, vars(owner)[name], running))
    install()
    rebuild(named(ATTENTION_ROUTE), lambda fn: timer(spent, label, fn, running))


def as_chain(drafts):
    """The same nodes, sent as a chain in node order."""
    if drafts.parents is not None:
        drafts.parents = [None] * len(drafts.parents)
    return drafts


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench tree-profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--nodes", type=int, default=16, help="drafts (nodes) per request, 1..64")
    p.add_argument("--batch", type=int, default=1, help="requests per step")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--min-steps", type=int, default=3,
                   help="token counts need this many steps on both engines")
    p.add_argument("--out", default=None, help="a JSON file for the per-step records")
    args = p.parse_args(argv)
    if not 1 <= args.nodes <= 64:
        p.error(f"--nodes must be in 1..64, got {args.nodes}")
    if args.batch < 1 or args.prompts < args.batch:
        p.error("--batch must be positive and at most --prompts")
    return args


def median_or_none(values):
    values = list(values)
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_plugins.bench.engines import quiet_vllm

    quiet_vllm()
    from vllm import SamplingParams

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.bench.engines import build_engine, resolve_model, run_batch
    from vllm_plugins.proposers.base import PluginProposer

    model = resolve_model(args.model)
    spent: dict = defaultdict(float)
    time_attention(spent)   # before the engines: it applies the bridge's patches
    engines = {shape: build_engine(model, {
        "method": "token_recycling", "num_speculative_tokens": args.nodes,
        "draft_shape": "tree", "draft_length": "fixed", "min_confidence": 0})
        for shape in (CHAIN, TREE)}
    # After the engines: our patches are in place, and the timers wrap them.
    install_timers(spent)
    records: list[dict] = []
    current = {"engine": ""}
    timed_step = PluginProposer.step

    def step(self, ctx):
        # What the parts spent since the last call belongs to the step just
        # verified (and to the proposer step that drafted for it).
        if ctx.last_step_seconds is not None and len(ctx.requests) == args.batch \
                and any(int(r.num_draft) for r in ctx.requests):
            records.append({"engine": current["engine"], "tokens": int(ctx.last_step_tokens),
                            "step_ms": 1e3 * float(ctx.last_step_seconds),
                            **{k: 1e3 * v for k, v in spent.items()}})
        spent.clear()
        drafts = timed_step(self, ctx)
        return as_chain(drafts) if current["engine"] == CHAIN else drafts

    PluginProposer.step = step
    tokenizer = engines[CHAIN].get_tokenizer()
    questions = load_questions()
    stride = max(1, len(questions) // args.prompts)
    prompts = [render(tokenizer, q) for q in questions[::stride][:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    batches = [prompts[i:i + args.batch] for i in range(0, len(prompts), args.batch)]
    for i, batch in enumerate(batches):
        for shape in ((CHAIN, TREE) if i % 2 == 0 else (TREE, CHAIN)):
            current["engine"] = shape
            run_batch(engines[shape], batch, params)

    by_engine = {s: [r for r in records if r["engine"] == s] for s in (CHAIN, TREE)}
    print(f"Token Recycling, up to {args.nodes} nodes a request, batch {args.batch}, "
          f"{len(prompts)} prompts; the same nodes sent as a chain or as a tree.\n")
    print("Median ms per verifying step:\n\n| part | chain | tree |\n|---|---:|---:|")
    labels = ["step_ms"] + [label for label, _, _ in PARTS]
    for k in labels:
        cells = [median_or_none(r.get(k, 0.0) for r in by_engine[s]) for s in (CHAIN, TREE)]
        print(f"| {k.replace('step_ms', 'step')} | "
              + " | ".join("" if c is None else f"{c:.2f}" for c in cells) + " |")
    print(f"| steps | {len(by_engine[CHAIN])} | {len(by_engine[TREE])} |")
    print("\nMedian step ms by token count:\n\n| tokens | chain: steps, ms | tree: steps, ms "
          "| tree / chain |\n|---:|---|---|---:|")
    rows = []
    for tokens in sorted({r["tokens"] for r in records}):
        got = {s: [r["step_ms"] for r in by_engine[s] if r["tokens"] == tokens]
               for s in (CHAIN, TREE)}
        if min(len(g) for g in got.values()) < args.min_steps:
            continue
        chain, tree = (statistics.median(got[s]) for s in (CHAIN, TREE))
        rows.append({"tokens": tokens, "chain_ms": chain, "tree_ms": tree,
                     "chain_steps": len(got[CHAIN]), "tree_steps": len(got[TREE])})
        print(f"| {tokens} | {len(got[CHAIN])}, {chain:.1f} | {len(got[TREE])}, {tree:.1f} "
              f"| {tree / chain:.3f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "by_tokens": rows, "records": records}, f, indent=1)
    return 0
