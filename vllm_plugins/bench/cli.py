"""Speculative methods side by side on Spec-Bench dev, in one process.

All engines live in this process and are built once; for each batch size,
each batch of prompts runs on every engine in turn (rotating which goes
first), so host noise hits all methods alike. With several batch sizes, each
size gets its own prompts (disjoint sets), so proposers that learn across
requests never meet a prompt whose output they have already seen.
"""

from __future__ import annotations

import argparse

DEFAULT_METHODS = ["none", "ngram", "suffix", "token_recycling", "hybrid"]
# The no-speculation engine run a second time on every batch: an A/A pair
# whose "speedup" is the host's noise on that batch.
RERUN = "none(rerun)"


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers, "
                                         f"got {text!r}") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench methods",
                                description=__doc__)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help="comma list of: none, ngram, suffix, token_recycling, "
                        "token_recycling+goodput, hybrid, ngram+goodput, ngram_adaptive")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="add a method: a name and its speculative_config as JSON, "
                        "e.g. tr-o1='{\"method\": \"token_recycling\", "
                        "\"context_order\": 1}'")
    p.add_argument("--categories", default=None, help="comma list; default all")
    p.add_argument("--per-category", type=_int_list, default=None,
                   help="prompts per category; a comma list gives one count per "
                        "batch size (disjoint prompt sets); default all")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=None, help="one batch size")
    p.add_argument("--batch-sizes", type=_int_list, default=None,
                   help="comma list, e.g. 1,8,16: engines are built once and reused")
    p.add_argument("--queue", type=int, default=1, metavar="K",
                   help="with K > 1, each measured unit is K x batch-size prompts "
                        "run with at most batch-size in flight, a finished "
                        "request replaced at once (a server at that concurrency); "
                        "1: static batches that drain as requests finish")
    p.add_argument("--aa", action="store_true",
                   help=f"run no speculation twice per batch ('{RERUN}'): "
                        "the A/A spread measures the host's noise")
    p.add_argument("--mat-only", action="store_true",
                   help="skip the no-speculation engine (MAT needs no baseline; "
                        "no speedups or mismatch checks)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=2, help="batches run untimed first")
    p.add_argument("--compile", action="store_true", help="inductor, not eager")
    p.add_argument("--turn", type=int, choices=(1, 2), default=1,
                   help="2: the two-turn questions' second turn, after the first "
                        "and the target's own greedy answer to it (--max-tokens)")
    p.add_argument("--quick", action="store_true",
                   help="2 prompts per category, 128 tokens: a short demo")
    p.add_argument("--host-time", action="store_true",
                   help="engines in this process; per method our host CPU ms a step "
                        "(everything of ours but the forward, the top-k stash apart) "
                        "by host-profile's timers, and h: ours over a plain step")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--verbose", action="store_true",
                   help="keep vLLM's logging (default: errors only)")
    args = p.parse_args(argv)
    if args.batch_sizes and args.batch_size:
        p.error("give --batch-size or --batch-sizes, not both")
    args.batch_sizes = args.batch_sizes or [args.batch_size or 1]
    per = args.per_category
    if per is not None and len(per) not in (1, len(args.batch_sizes)):
        p.error(f"--per-category has {len(per)} counts for "
                f"{len(args.batch_sizes)} batch sizes")
    if args.queue < 1:
        p.error(f"--queue must be >= 1, got {args.queue}")
    if args.mat_only and args.aa:
        p.error("--aa needs the no-speculation engine; drop --mat-only")
    return args


def run_interleaved(engines, runs, batch, bi, tok, params, tally, greedy,
                    batch_times=None, in_flight=None, host=None):
    """One batch (or queue unit, with ``in_flight``) on every engine,
    rotating which goes first.

    ``runs`` are labels; RERUN runs on the "none" engine again. Per-batch
    seconds go to ``batch_times[label]`` for the paired noise intervals.
    ``host`` (a ``HostTime``) times each run's components.
    """
    from vllm_plugins.bench.data import render
    from vllm_plugins.bench.engines import run_batch

    prompts = [render(tok, q) for q in batch]
    order = runs[bi % len(runs):] + runs[:bi % len(runs)]
    results = {}
    for m in order:
        engine = engines["none" if m == RERUN else m]
        if RERUN in runs and m in ("none", RERUN):
            # The rerun and "none" are one engine given the same prompts: the
            # second would find the first's prompts in vLLM's prefix cache
            # and measure the cache, not the engine.
            reset = getattr(engine, "reset_prefix_cache", None)
            if reset is not None:
                reset()
        if host is None:
            results[m] = run_batch(engine, prompts, params, in_flight)
        else:
            with host.timing(m):
                results[m] = run_batch(engine, prompts, params, in_flight)
    ref = results["none"][0] if "none" in results else None
    for m in runs:
        res, secs = results[m]
        toks = sum(len(r.token_ids) for r in res)
        if batch_times is not None:
            batch_times.setdefault(m, []).append(secs)
        for i, (q, r) in enumerate(zip(batch, res)):
            share = secs * len(r.token_ids) / max(toks, 1)
            mismatch = greedy and ref is not None and r.token_ids != ref[i].token_ids
            tally.add(m, q["category"], len(r.token_ids), r.forwards, share, mismatch)


def _resolve_methods(args):
    from vllm_plugins.bench.engines import METHOD_CONFIGS, chosen_methods

    methods, configs = chosen_methods(args.methods, args.extra, METHOD_CONFIGS)
    unknown = [m for m in methods if m not in configs]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(configs)}")
    if args.mat_only:
        methods = [m for m in methods if m != "none"]
    elif "none" not in methods:
        methods.insert(0, "none")
    return methods, configs


def _host_load() -> str:
    import os

    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.host_time:   # the engines' steps on this process's clock
        import os

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    if args.quick:
        args.per_category = args.per_category or [2]
        args.max_tokens = min(args.max_tokens, 128)
    from vllm_plugins.bench.engines import numba_threads_as_the_engines, quiet_vllm
    numba_threads_as_the_engines()
    if not args.verbose:
        quiet_vllm()
    from tqdm import tqdm
    from vllm import SamplingParams

    from vllm_plugins.bench.data import disjoint_sets, render, second_turns
    from vllm_plugins.bench.engines import (acceptance_between, build_engine,
                                           engine_stats, resolve_model, run_batch)
    from vllm_plugins.bench.report import (Tally, controller_delta,
                                           controller_markdown, markdown, ratio_ci,
                                           title, tree_markdown, write)

    host = None
    if args.host_time:
        from vllm_plugins.bench.host_profile import HostTime

        host = HostTime()   # before any engine: a missing timed function stops here
    model = resolve_model(args.model)
    methods, configs = _resolve_methods(args)
    sizes = args.batch_sizes
    cats = args.categories.split(",") if args.categories else None
    per = args.per_category or [None]
    per = per * len(sizes) if len(per) == 1 and len(sizes) > 1 and per[0] else per
    if per == [None] and len(sizes) > 1:
        raise SystemExit("several batch sizes need --per-category (disjoint sets)")
    sets, spare = disjoint_sets(cats, per)
    engines = {m: build_engine(model, configs[m], max_num_seqs=max(sizes),
                               enforce_eager=not args.compile) for m in methods}
    tok = engines[methods[0]].get_tokenizer()
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=0 if args.temperature > 0 else None)
    if args.turn == 2:
        # Plain decoding answers where it runs: no proposer learns the answers.
        answerer = engines.get("none", engines[methods[0]])
        sets = [second_turns(s, _first_answers(answerer, tok, args.max_tokens))
                for s in sets]
    runs = methods + ([RERUN] if args.aa else [])
    greedy = args.temperature == 0
    # Warm caches and allocators, untimed, on prompts outside every measured
    # set (a proposer that learns must not see a measured prompt beforehand).
    for q in spare[:args.warmup]:
        for m in methods:
            run_batch(engines[m], [render(tok, q)] * max(sizes), params)
    counts = {m: engine_stats(engines[m]) for m in methods}
    before = {m: (counts[m].get("proposer") or {}).get("draft_length") for m in methods}
    all_rows, summary, controllers, loads = [], [], [], {}
    for size, questions in zip(sizes, sets):
        tally, times = Tally(), {}
        batches, in_flight = _units(questions, size, args.queue)
        loads[size] = [_host_load()]
        try:
            for bi, batch in enumerate(tqdm(batches, desc=f"batch {size}")):
                run_interleaved(engines, runs, batch, bi, tok, params, tally, greedy,
                                times, in_flight, host)
        except Exception as e:  # report what was measured before the failure
            print(f"benchmark stopped early: {type(e).__name__}: {e}")
            print(markdown(tally.table(runs, list(dict.fromkeys(
                q["category"] for q in questions)))))
            raise
        loads[size].append(_host_load())
        stats = {m: engine_stats(engines[m]) for m in methods}
        categories = list(dict.fromkeys(q["category"] for q in questions))
        rows = tally.table(runs, categories, acceptance_between(counts, stats))
        counts = stats
        for r in rows:
            r["batch"] = size
            if args.mat_only:
                r["mismatches"] = None   # nothing to compare with
        all_rows += rows
        spent = host.take() if host is not None else {}
        for m in runs:
            if "none" in times and m != "none":
                point, lo, hi = ratio_ci(times["none"], times[m])
                summary.append({"batch": size, "method": m, "speedup": point,
                                "lo": lo, "hi": hi, "batches": len(times[m]),
                                **host_columns(spent, m)})
        for m in methods:
            now = (stats[m].get("proposer") or {}).get("draft_length")
            if now:
                controllers.append({"batch": size, "method": m,
                                    **controller_delta(before[m], now)})
                before[m] = now
        heading = title(model, f"batch={size}{_queue_note(args)} T={args.temperature} "
                               f"max_tokens={args.max_tokens}")
        write(args.out, f"bench_b{size}" if len(sizes) > 1 else "bench", rows,
              heading, {"args": vars(args), "engine_stats": stats,
                        "host_load": loads[size],
                        # per method, each unit's seconds in run order: any
                        # two methods' paired ratio (report.ratio_ci)
                        "unit_seconds": times})
    if len(sizes) > 1 or args.aa or args.host_time:
        _write_summary(args, model, all_rows, summary, controllers, loads)
    elif controllers:
        print(controller_markdown(controllers))
        print(tree_markdown(controllers))
    return 0


def _first_answers(engine, tok, max_tokens: int):
    """``answer`` for ``second_turns``: the engine's greedy first answers
    (speculation does not change them), as text."""
    from vllm import SamplingParams

    from vllm_plugins.bench.data import render
    from vllm_plugins.bench.engines import run_batch

    def answer(questions):
        results, _ = run_batch(engine, [render(tok, q) for q in questions],
                               SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return [tok.decode(r.token_ids, skip_special_tokens=True) for r in results]

    return answer


def host_columns(spent: dict, method: str) -> dict:
    """A method's host figures (``HostTime.take``): our CPU ms a step but the
    top-k stash, the stash's, and h: all of ours over the plain engine's
    step (vLLM's CPU time a step without speculation)."""
    if method not in spent or "none" not in spent:
        return {}
    mine = spent[method]
    plain = spent["none"]["plain_ms"]
    return {"ours_ms": mine["ours_ms"] - mine["topk_ms"], "topk_ms": mine["topk_ms"],
            "h": mine["ours_ms"] / plain if plain > 0 else float("nan")}


def _units(questions: list, size: int, queue: int) -> tuple[list[list], int | None]:
    """Measured units of prompts and how many run at once (None: all).

    Static batches are ``size`` prompts each. Queue units hold about
    ``queue`` x ``size`` prompts, split evenly so that no unit is a short
    remainder that never fills the batch. At batch size 1 a queue changes
    nothing but which prompts share a unit, so units stay single prompts
    (and each category keeps its own speedup)."""
    if queue <= 1 or size <= 1:
        return [questions[i:i + size] for i in range(0, len(questions), size)], None
    n = max(1, -(-len(questions) // (size * queue)))
    cuts = [len(questions) * i // n for i in range(n + 1)]
    return [questions[a:b] for a, b in zip(cuts, cuts[1:])], size


def _queue_note(args) -> str:
    return f" in flight (queue x{args.queue})" if args.queue > 1 else ""


def _write_summary(args, model, rows, summary, controllers, loads) -> None:
    """Speedup per batch size with paired-bootstrap intervals, the A/A noise,
    and what each draft-length controller chose."""
    import json as _json
    from pathlib import Path

    from vllm_plugins.bench.report import (controller_markdown, speedup_plot,
                                           title, tree_markdown)

    unit = "units" if args.queue > 1 else "batches"
    host = args.host_time
    extra = " ours ms a step | top-k ms a step | h |" if host else ""
    lines = [f"| batch | method | MAT | speedup | 95% interval | {unit} |" + extra,
             "|---:|---|---:|---:|---|---:|" + ("---:|---:|---:|" if host else "")]
    mats = {(r["batch"], r["method"]): r["MAT"] for r in rows
            if r["category"] == "overall"}
    for s in summary:
        cells = (f" {s['ours_ms']:.2f} | {s['topk_ms']:.2f} | {s['h']:.3f} |"
                 if host else "")
        lines.append(f"| {s['batch']} | {s['method']} | "
                     f"{mats.get((s['batch'], s['method']), float('nan')):.2f} | "
                     f"{s['speedup']:.3f}x | {s['lo']:.3f} .. {s['hi']:.3f} | "
                     f"{s['batches']} |" + cells)
    table = "\n".join(lines)
    ctl = controller_markdown(controllers) if controllers else ""
    trees = tree_markdown(controllers) if controllers else ""
    if trees:
        ctl += "\n\n" + trees
    load = "\n".join(f"batch {k}: start {v[0]}, end {v[-1]}" for k, v in loads.items())
    heading = title(model, f"batch sizes={args.batch_sizes}{_queue_note(args)} "
                           f"T={args.temperature} max_tokens={args.max_tokens}")
    text = f"{heading}\n\n{table}\n\n{ctl}\n\n{load}\n"
    print("\n" + text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(_json.dumps(
        {"summary": summary, "controllers": controllers, "host_load": loads,
         "rows": rows, "args": vars(args)}, indent=1, default=str))
    if summary:
        speedup_plot(summary, str(out / "speedup.png"), heading)
