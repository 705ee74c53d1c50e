"""SWIFT and DEL beside no speculation and Token Recycling, per Spec-Bench
category, all engines in one process, prompts interleaved.

Categories run one after another (the order of the dev split), as traffic
whose kind changes over time: SWIFT's skip set and DEL's exit choices are
snapshotted after each category, so the table says what each method chose
for that workload. Greedy; every method's tokens are checked against no
speculation (mismatches column). MAT is exact (from ``LLMEngine.step``).

    python -m vllm_plugins.bench layer-skip --per-category 2 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json

METHODS = {
    "none": None,
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 6},
    "swift": {"method": "swift", "num_speculative_tokens": 4},
    "del": {"method": "del", "num_speculative_tokens": 4},
}
DEFAULT_METHODS = list(METHODS)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench layer-skip",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="another speculative config to compare, e.g. "
                        "swift-r30='{\"method\": \"swift\", \"skip_ratio\": 0.3}'")
    p.add_argument("--categories", default=None, help="default: all")
    p.add_argument("--per-category", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed prompts first (from the last category's extra prompts)")
    p.add_argument("--out", default="bench_out/layer_skip")
    return p.parse_args(argv)


def choices(stats: dict) -> str:
    """What a self-drafting method chose, in a few words."""
    p = stats.get("proposer") or {}
    if "skip_attn" in p:
        return (f"skip attn {p['skip_attn']} mlp {p['skip_mlp']} "
                f"(cost {p['plan_cost']}, match {p['matchness']}, "
                f"accept {p['acceptance']}, retunes {p['retunes']})")
    if "chosen_exits" in p:
        chosen = p["chosen_exits"]
        top = sorted(chosen.items(), key=lambda kv: -kv[1])[:3]
        return (f"exits {dict(top)}, no-draft {p['no_draft_decisions']}, "
                f"shadow acc {dict(zip(p['exit_layers'], p['shadow_acceptance']))}")
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm
    from vllm import SamplingParams

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.bench.engines import (acceptance_between, build_engine,
                                           engine_stats, resolve_model, run_batch,
                                           shutdown_all)
    from vllm_plugins.bench.report import Tally, title, write

    model = resolve_model(args.model)
    configs = {m: METHODS[m] for m in args.methods.split(",") if m}
    for item in args.extra:
        name, _, spec = item.partition("=")
        configs[name] = json.loads(spec)
    configs = {"none": None, **configs}
    methods = list(configs)
    cats = args.categories.split(",") if args.categories else None
    questions = load_questions(cats, args.per_category + (1 if args.warmup else 0))
    by_cat: dict[str, list] = {}
    for q in questions:
        by_cat.setdefault(q["category"], []).append(q)
    warm = []
    if args.warmup:
        for cat in by_cat:
            warm.append(by_cat[cat].pop())  # each category's extra prompt
        warm = warm[-args.warmup:]
    engines = {m: build_engine(model, configs[m], max_num_seqs=4) for m in methods}
    tok = engines["none"].get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for q in warm:
        for m in methods:
            run_batch(engines[m], [render(tok, q)], params)
    base_stats = {m: engine_stats(engines[m]) for m in methods}
    tally = Tally()
    per_category = {}
    i = 0
    for cat, qs in by_cat.items():
        for q in tqdm(qs, desc=cat):
            prompt = render(tok, q)
            order = methods[i % len(methods):] + methods[:i % len(methods)]
            i += 1
            results = {m: run_batch(engines[m], [prompt], params) for m in order}
            want = results["none"][0][0].token_ids
            for m in methods:
                (res,), secs = results[m]
                tally.add(m, cat, len(res.token_ids), res.forwards, secs,
                          res.token_ids != want)
        per_category[cat] = {m: choices(engine_stats(engines[m])) for m in methods
                             if m != "none"}
    stats = {m: engine_stats(engines[m]) for m in methods}
    acceptance = acceptance_between(base_stats, stats)
    rows = tally.table(methods, list(by_cat), acceptance)
    heading = title(model, f"greedy max_tokens={args.max_tokens} "
                           f"{sum(len(v) for v in by_cat.values())} prompts, batch 1")
    write(args.out, "layer_skip_bench", rows, heading,
          {"args": vars(args), "configs": configs, "engine_stats": stats,
           "choices_per_category": per_category, "acceptance": acceptance})
    print("\nchoices after each category:")
    for cat, by_method in per_category.items():
        for m, text in by_method.items():
            if text:
                print(f"  {cat:>22} {m}: {text}")
    shutdown_all(engines.values())
    return 0
