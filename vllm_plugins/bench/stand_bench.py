"""STAND under test-time scaling: n samples per prompt, beside Token Recycling
and vLLM's n-gram, on Spec-Bench dev, all engines in one process.

Each batch is one prompt with ``n`` samples (``SamplingParams(n=...)``, one
seed per batch, so the samples get seeds seed..seed+n-1), run on every engine
in turn with the starting engine rotating, so host noise hits all methods
alike. MAT counts, per sample, output tokens per target forward that produced
some of them (exact, from ``LLMEngine.step``). Warm-up batches use prompts of
other categories: STAND keeps a prompt's store after its requests finish, and
warming up on the measured prompts would hand it their n-grams for free.

    python -m vllm_plugins.bench stand --per-category 4 --max-tokens 128
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

DEFAULT_CATEGORIES = ["math_reasoning", "reasoning", "coding"]
WARMUP_CATEGORY = "writing"

METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5,
              "prompt_lookup_max": 5, "prompt_lookup_min": 2},
    # Both plugin methods' chains with fixed drafts: what each drafts, not
    # what a draft-length policy keeps on this host.
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 6,
                        "draft_length": "fixed"},
    "stand": {"method": "stand", "num_speculative_tokens": 6, "draft_length": "fixed"},
    # Each under goodput, its default; not run unless asked for (--methods ...).
    "token_recycling+goodput": {"method": "token_recycling", "num_speculative_tokens": 6,
                                "draft_length": "goodput"},
    "stand+goodput": {"method": "stand", "num_speculative_tokens": 6,
                      "draft_length": "goodput"},
}
DEFAULT_METHODS = ["none", "ngram", "token_recycling", "stand"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench stand",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="add a method: a name and its speculative_config as JSON, "
                        "e.g. stand-tree32='{\"method\": \"stand\", "
                        "\"num_speculative_tokens\": 32, \"draft_shape\": \"tree\"}'")
    p.add_argument("--categories", default=",".join(DEFAULT_CATEGORIES))
    p.add_argument("--per-category", type=int, default=4)
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=1,
                   help=f"untimed batches first, on {WARMUP_CATEGORY!r} prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench_out/stand")
    return p.parse_args(argv)


def run_samples(llm, prompt: list[int], params, tag: str):
    """One prompt, params.n samples; per sample (tokens, forwards) and seconds."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    rid = f"{tag}-{time.monotonic_ns()}"
    tokens: dict[int, list[int]] = defaultdict(list)
    forwards: dict[int, int] = defaultdict(int)
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            for c in out.outputs:
                if c.token_ids:
                    tokens[c.index].extend(c.token_ids)
                    forwards[c.index] += 1
    seconds = time.perf_counter() - start
    return [(tokens[i], forwards[i]) for i in range(params.n)], seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_plugins.bench.engines import numba_threads_as_the_engines
    numba_threads_as_the_engines()
    from tqdm import tqdm
    from vllm import SamplingParams

    from vllm_plugins.bench.data import load_questions, render
    from vllm_plugins.bench.engines import (acceptance_between, add_extra_methods,
                                           build_engine, engine_stats, resolve_model,
                                           shutdown_all)
    from vllm_plugins.bench.report import Tally, title, write

    model = resolve_model(args.model)
    methods = [m for m in args.methods.split(",") if m]
    configs = dict(METHODS)
    add_extra_methods(configs, methods, args.extra)
    unknown = [m for m in methods if m not in configs]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(configs)}")
    if "none" not in methods:
        methods.insert(0, "none")
    cats = args.categories.split(",")
    questions = load_questions(cats, args.per_category)
    warm = load_questions([WARMUP_CATEGORY], args.warmup) if args.warmup else []
    engines = {m: build_engine(model, configs[m], max_num_seqs=max(args.n, 1))
               for m in methods}
    tok = engines["none"].get_tokenizer()

    def params(i):
        return SamplingParams(n=args.n, temperature=args.temperature,
                              max_tokens=args.max_tokens, seed=args.seed + 1000 * i)

    for i, q in enumerate(warm):
        for m in methods:
            run_samples(engines[m], render(tok, q), params(10_000 + i), m)
    before = {m: engine_stats(engines[m]) for m in methods}
    tally = Tally()
    for bi, q in enumerate(tqdm(questions, desc="prompts")):
        prompt = render(tok, q)
        order = methods[bi % len(methods):] + methods[:bi % len(methods)]
        results = {m: run_samples(engines[m], prompt, params(bi), m) for m in order}
        for m in methods:
            samples, secs = results[m]
            total = sum(len(t) for t, _ in samples)
            for toks, fwd in samples:
                tally.add(m, q["category"], len(toks), fwd,
                          secs * len(toks) / max(total, 1), False)
    stats = {m: engine_stats(engines[m]) for m in methods}
    acceptance = acceptance_between(before, stats)
    categories = list(dict.fromkeys(q["category"] for q in questions))
    rows = tally.table(methods, categories, acceptance)
    heading = title(model, f"n={args.n} T={args.temperature} max_tokens={args.max_tokens} "
                           f"{len(questions)} prompts")
    write(args.out, "stand_bench", rows, heading,
          {"args": vars(args), "engine_stats": stats, "acceptance": acceptance})
    shutdown_all(engines.values())
    return 0
