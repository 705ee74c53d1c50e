"""Speculative methods side by side on Spec-Bench dev, in one process.

All engines live in this process; each batch of prompts runs on every engine
in turn (rotating which goes first), so host noise hits all methods alike.
"""

from __future__ import annotations

import argparse
import json

DEFAULT_METHODS = ["none", "ngram", "suffix", "token_recycling"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench",
                                description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list of: none, ngram, suffix, token_recycling, "
                        "token_recycling+goodput, ngram+goodput")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="add a method: a name and its speculative_config as JSON, "
                        "e.g. tr-o1='{\"method\": \"token_recycling\", "
                        "\"context_order\": 1}'")
    p.add_argument("--categories", default=None, help="comma list; default all")
    p.add_argument("--per-category", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="batches run untimed first")
    p.add_argument("--compile", action="store_true", help="inductor, not eager")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts per category, 128 tokens: a short demo")
    p.add_argument("--out", default="bench_out")
    return p.parse_args(argv)


def run_interleaved(engines, methods, batch, bi, tok, params, tally, greedy):
    """One batch on every engine, rotating which goes first."""
    from vllm_plugins.bench.data import render
    from vllm_plugins.bench.engines import run_batch

    prompts = [render(tok, q) for q in batch]
    order = methods[bi % len(methods):] + methods[:bi % len(methods)]
    results = {m: run_batch(engines[m], prompts, params) for m in order}
    ref = results["none"][0]
    for m in methods:
        res, secs = results[m]
        toks = sum(len(r.token_ids) for r in res)
        for q, r, b in zip(batch, res, ref):
            share = secs * len(r.token_ids) / max(toks, 1)
            mismatch = greedy and r.token_ids != b.token_ids
            tally.add(m, q["category"], len(r.token_ids), r.forwards, share, mismatch)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.per_category = args.per_category or 2
        args.max_tokens = min(args.max_tokens, 128)
    from tqdm import tqdm
    from vllm import SamplingParams

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.bench.engines import (METHOD_CONFIGS, build_engine,
                                            engine_stats, run_batch,
                                            suffix_available)
    from vllm_plugins.bench.report import Tally, markdown, title, write

    model = args.model
    if model is None:
        from vllm_plugins.default_model import default_model_path

        model = default_model_path()
    methods = [m for m in args.methods.split(",") if m]
    configs = dict(METHOD_CONFIGS)
    for item in args.extra:
        name, sep, spec = item.partition("=")
        if not sep:
            raise SystemExit(f"--extra wants NAME=JSON, got {item!r}")
        configs[name] = json.loads(spec)
        methods.append(name)
    if "suffix" in methods and not suffix_available():
        print("suffix: arctic-inference is not installed; skipping that method")
        methods.remove("suffix")
    unknown = [m for m in methods if m not in configs]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(configs)}")
    if "none" not in methods:
        methods.insert(0, "none")
    cats = args.categories.split(",") if args.categories else None
    questions = load_questions(cats, args.per_category)
    engines = {m: build_engine(model, configs[m], max_num_seqs=max(
        args.batch_size, 1), enforce_eager=not args.compile) for m in methods}
    tok = engines["none"].get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0 if args.temperature > 0 else None)
    batches = [questions[i:i + args.batch_size]
               for i in range(0, len(questions), args.batch_size)]
    # Warm caches and allocators, untimed, on prompts outside the measured set
    # (a proposer that learns must not see a measured prompt beforehand).
    measured = {q["question_id"] for q in questions}
    spare = [q for q in load_questions(cats) if q["question_id"] not in measured]
    for q in spare[:args.warmup]:
        for m in methods:
            run_batch(engines[m], [render(tok, q)] * args.batch_size, params)
    tally = Tally()
    try:
        for bi, batch in enumerate(tqdm(batches, desc="batches")):
            run_interleaved(engines, methods, batch, bi, tok, params, tally,
                            greedy=args.temperature == 0)
    except Exception as e:  # report what was measured before the failure
        print(f"benchmark stopped early: {type(e).__name__}: {e}")
        partial = tally.table(methods, list(dict.fromkeys(
            q["category"] for q in questions)))
        print(markdown(partial))
        raise
    stats = {m: engine_stats(engines[m]) for m in methods}
    acceptance = {m: (s["accepted"] / s["drafted"]) if s.get("drafted") else None
                  for m, s in stats.items()}
    categories = list(dict.fromkeys(q["category"] for q in questions))
    rows = tally.table(methods, categories, acceptance)
    heading = title(model, f"batch={args.batch_size} T={args.temperature} "
                           f"max_tokens={args.max_tokens}")
    write(args.out, "bench", rows, heading, {"args": vars(args), "engine_stats": stats})
    return 0
