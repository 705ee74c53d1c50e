"""The grammar benchmark: vLLM structured output with and without
grammar-forced drafts, and the cost of the grammar logits processor.

    python -m vllm_plugins.bench grammar --schemas 60 --max-tokens 256
    python -m vllm_plugins.bench grammar --processor --schemas 0 [--generate 100]
    python -m vllm_plugins.bench grammar --modes all --schemas 16 --max-tokens 128

``--modes``: native structured output against our grammar processor, per
mode (``vllm_plugins.bench.grammar_modes``); ``--awrs``: the processor's
``"sampling": "awrs"`` against its mask mode (``vllm_plugins.bench.grammar_awrs``),
``--awrs-engine`` the same end to end (``vllm_plugins.bench.grammar_awrs_engine``).

Schemas are JSONSchemaBench dev schemas (``json_schemas_dev.jsonl`` of the
shared data, or ``--schema-file``), ``--schemas N`` of them spread evenly over
the file (0: all).

**Grammar-forced drafts** (default). One process builds one engine per method
once (default model, greedy, batch 1) and runs every schema on each engine in
turn, rotating which engine goes first, so host noise falls on all methods
alike. Every request uses vLLM's own structured outputs
(``StructuredOutputsParams(json=schema)``, the engine's backend, ``auto`` by
default). MAT (output tokens per target forward) is exact, from
``LLMEngine.step``; "mismatches" counts outputs that differ from the engine
without speculation (must be 0). Also reported, per run:

* coverage: schemas vLLM accepted (compiled) / outputs that finished and
  validate with ``jsonschema``; schemas llguidance compiles for the drafts;
* compile time of a schema to an llguidance matcher (what the guidance backend
  and our proposer do per new schema), p50 / p99;
* per-token mask time: llguidance's next-token bitmask, replayed over the
  generated outputs (the guidance backend's per-token cost), p50 / p99;
* the proposer's own cost per request per step (follow + forced walk + grammar
  check of the inner draft), p50 / p99, from its metrics.

**The grammar logits processor** (``--processor``). Every schema is compiled
exactly as ``extra_args={"grammar": {"json_schema": schema}}`` would be
(coverage, compile time). For each compiled schema a random walk is decoded
through ``GrammarLogitsProcessor.apply`` on CPU logits (random logits, so any
allowed token may come next), with no model: the time per step is the
processor's whole per-token cost, split into

* advance: consuming the newly sampled token(s) into the matcher,
* fill:    llguidance computing the next-token bitmask,
* mask:    writing -inf into the logits from the bitmask,

wall-clock per decoding step per batch (batch 1: per token). No vLLM engine is
started for this part; vLLM is imported for its SamplingParams and BatchUpdate
types and the processor class. ``--generate N`` then starts one ``vllm.LLM``
with the processor and decodes N of the compiled schemas (spread evenly)
greedily, reporting how many outputs finish (EOS before ``--max-tokens``) and
how many of those validate with ``jsonschema`` (the ``test`` extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import time

METHODS = {
    "none": None,
    "grammar": {"method": "grammar_forced", "num_speculative_tokens": 6},
    "grammar+token_recycling": {"method": "grammar_forced", "inner": "token_recycling",
                                "num_speculative_tokens": 6},
    # Not run unless asked for: the inner proposer alone, to show what the
    # grammar adds to it.
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 6},
}
DEFAULT_METHODS = ["none", "grammar", "grammar+token_recycling"]
PROMPT = ("Write a JSON object that follows this JSON schema:\n{schema}\n"
          "Reply with the JSON only.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench grammar",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--processor", action="store_true",
                   help="measure the grammar logits processor instead of "
                        "grammar-forced drafts")
    p.add_argument("--awrs", action="store_true",
                   help='"sampling": "awrs" against the mask mode: evaluations, time a '
                        "step, a check's calls (bench.grammar_awrs)")
    p.add_argument("--awrs-engine", action="store_true",
                   help='"sampling": "awrs" against the mask mode: end-to-end tok/s in '
                        "one vllm.LLM (bench.grammar_awrs_engine)")
    p.add_argument("--modes", default=None,
                   help="compare native structured output and our processor "
                        "per mode (comma list or 'all'; see bench.grammar_modes)")
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--schemas", type=int, default=60,
                   help="how many dev schemas, spread evenly over the file (0: all)")
    p.add_argument("--schema-file", default=None,
                   help="JSON lines with a 'schema' field (default: "
                        "json_schemas_dev.jsonl of the shared data)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--compact", action="store_true",
                   help="no whitespace between JSON tokens (drafts: "
                        "structured_outputs_config.disable_any_whitespace; "
                        'processor: "whitespace_flexible": false)')
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    drafts = p.add_argument_group("grammar-forced drafts")
    drafts.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma list of: {', '.join(METHODS)}")
    drafts.add_argument("--backend", default="auto",
                        help="vLLM structured_outputs_config.backend (auto, xgrammar, guidance)")
    drafts.add_argument("--warmup", type=int, default=1, help="untimed schemas first")
    drafts.add_argument("--num-speculative-tokens", type=int, default=6)
    drafts.add_argument("--kv-cache-mib", type=int, default=256)
    drafts.add_argument("--out", default="bench_out/grammar")
    proc = p.add_argument_group("--processor")
    proc.add_argument("--tokens", type=int, default=64,
                      help="max decode steps per schema walk")
    proc.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    proc.add_argument("--threads", type=int, default=1,
                      help="torch CPU threads (0: leave)")
    proc.add_argument("--generate", type=int, default=0,
                      help="also decode N schemas with vllm.LLM and the processor")
    awrs = p.add_argument_group("--awrs, --awrs-engine")
    awrs.add_argument("--vocab", type=int, default=None,
                      help="--awrs: also replay on a random tiny model with this "
                           "vocabulary size (e.g. 262144)")
    return p.parse_args(argv)


def load_schemas(n: int, path: str | None = None) -> list[dict]:
    """Rows of the schema file, ``n`` of them spread evenly (0: all)."""
    from pathlib import Path

    from vllm_plugins.bench.data import shared_data

    text = Path(path).read_text() if path else shared_data("json_schemas_dev.jsonl").read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    if n and n < len(rows):
        step = len(rows) / n
        rows = [rows[int(i * step)] for i in range(n)]
    return rows


def build(model: str, spec: dict | None, args):
    """As ``engines.build_engine``, plus the structured-output settings."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    so = {"backend": args.backend}
    if args.compact:
        so["disable_any_whitespace"] = True
    return LLM(model=model, dtype="float32", max_model_len=args.max_model_len,
               max_num_seqs=4, enforce_eager=True, seed=args.seed,
               speculative_config=dict(spec) if spec else None,
               kv_cache_memory_bytes=args.kv_cache_mib * 2**20,
               structured_outputs_config=so, disable_log_stats=False)


def prompt_ids(tok, schema) -> list[int]:
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT.format(schema=json.dumps(schema))}],
        add_generation_prompt=True, tokenize=False)
    return tok(text, add_special_tokens=False)["input_ids"]


def valid_json(text: str, schema) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except Exception:  # noqa: BLE001 - any failure is "not valid"
        return False
    return True


def _pct(values, q, empty=None) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else empty


def grammar_costs(tok, vocab: int, outputs: list[tuple[dict, list[int]]]) -> dict:
    """Compile time per schema and per-token mask time, llguidance, replayed
    over the generated outputs (no model)."""
    import llguidance
    import numpy as np

    from vllm_plugins.grammar.runtime import build_ll_tokenizer
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_plugins.grammar.spec import GrammarSpecError
    from vllm_plugins.grammar.structured_outputs import grammar_for

    lltok = build_ll_tokenizer(tok, vocab)
    compile_ms, mask_ms = [], []
    for schema, tokens in outputs:
        t = time.perf_counter()
        try:
            compiled = grammar_for(StructuredOutputsParams(json=schema))
            m = llguidance.LLMatcher(lltok, compiled.grammar)
        except GrammarSpecError:
            continue
        compile_ms.append((time.perf_counter() - t) * 1e3)
        for tok_id in tokens:
            t = time.perf_counter()
            m.compute_bitmask()
            mask_ms.append((time.perf_counter() - t) * 1e3)
            if not m.consume_token(tok_id):
                break
    return {"compile_ms_p50": _pct(compile_ms, 50), "compile_ms_p99": _pct(compile_ms, 99),
            "mask_ms_p50": _pct(mask_ms, 50), "mask_ms_p99": _pct(mask_ms, 99),
            "mask_tokens": len(mask_ms), "compiled_for_drafts": len(compile_ms)}


def run_drafts(args) -> int:
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_plugins.bench.engines import (acceptance_between, engine_stats,
                                           resolve_model, run_batch, shutdown_all)
    from vllm_plugins.bench.report import Tally, title, write

    refused_errors = (ValueError, VLLMClientError)  # add_request on a schema vLLM refuses

    model = resolve_model(args.model)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    if "none" not in methods:
        methods.insert(0, "none")
    specs = {m: (dict(METHODS[m], num_speculative_tokens=args.num_speculative_tokens)
                 if METHODS[m] else None) for m in methods}
    rows = load_schemas(args.schemas + args.warmup, args.schema_file)
    warm, rows = rows[:args.warmup], rows[args.warmup:]
    engines = {}
    for m in methods:
        t = time.perf_counter()
        engines[m] = build(model, specs[m], args)
        print(f"engine {m}: {time.perf_counter() - t:.0f} s to start", flush=True)
    tok = engines["none"].get_tokenizer()
    vocab = engines["none"].llm_engine.model_config.get_vocab_size()

    def params(schema):
        return SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))

    def fits(ids):
        return len(ids) + args.max_tokens <= args.max_model_len

    for row in warm:
        ids = prompt_ids(tok, row["schema"])
        for m in methods:
            if fits(ids):
                try:
                    run_batch(engines[m], [ids], params(row["schema"]))
                except refused_errors:
                    pass
    before = {m: engine_stats(engines[m]) for m in methods}
    tally = Tally()
    coverage = {"schemas": 0, "too_long": 0, "refused": 0, "compiled": 0,
                "finished": 0, "valid": 0}
    refused: dict[str, int] = {}
    generated = []
    for i, row in enumerate(tqdm(rows, desc="schemas")):
        schema = row["schema"]
        coverage["schemas"] += 1
        ids = prompt_ids(tok, schema)
        if not fits(ids):
            coverage["too_long"] += 1
            continue
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        results = {}
        try:
            for m in order:
                results[m] = run_batch(engines[m], [ids], params(schema))
        except refused_errors as e:  # vLLM refused the schema
            coverage["refused"] += 1
            reason = str(e).splitlines()[0][:100]
            refused[reason] = refused.get(reason, 0) + 1
            continue
        coverage["compiled"] += 1
        ref = results["none"][0][0].token_ids
        text = tok.decode(ref, skip_special_tokens=True)
        finished = len(ref) < args.max_tokens
        coverage["finished"] += finished
        coverage["valid"] += finished and valid_json(text, schema)
        generated.append((schema, ref))
        for m in methods:
            (res,), secs = results[m]
            tally.add(m, row.get("split", "-"), len(res.token_ids), res.forwards, secs,
                      res.token_ids != ref)
    stats = {m: engine_stats(engines[m]) for m in methods}
    acceptance = acceptance_between(before, stats)
    shutdown_all(engines.values())
    costs = grammar_costs(tok, vocab, generated)
    categories = sorted({r.get("split", "-") for r in rows})
    table_rows = tally.table(methods, categories, acceptance)
    ws = "compact" if args.compact else "any-whitespace"
    heading = title(model, f"greedy batch 1 max_tokens={args.max_tokens} "
                           f"backend={args.backend} {ws} k={args.num_speculative_tokens} "
                           f"{coverage['compiled']} schemas")
    proposer = {m: stats[m].get("proposer") for m in methods}
    write(args.out, "grammar_bench", table_rows, heading,
          {"args": vars(args), "coverage": coverage, "refused": refused,
           "costs": costs, "proposer": proposer, "acceptance": acceptance,
           "engine_stats": stats})
    print(f"\ncoverage: {json.dumps(coverage)}")
    if refused:
        print("refused by vLLM:", *(f"  {n}  {r}" for r, n in refused.items()), sep="\n")
    print("llguidance costs:", json.dumps({k: (round(v, 4) if isinstance(v, float) else v)
                                           for k, v in costs.items()}))
    for m in methods:
        p = proposer[m] or {}
        if "draft_ms_p50" in p:
            print(f"{m}: proposer per request-step ms p50 {p['draft_ms_p50']:.3f} "
                  f"p99 {p['draft_ms_p99']:.3f}; forced tokens {p['forced_tokens']}, "
                  f"inner tokens kept {p['inner_tokens']}, grammar lost "
                  f"{p['grammar_lost']}, unusable {p['grammar_unusable']}")
    return 0


# ---------------------------------------------------------- --processor
NAN = float("nan")


class _Timed:
    """Wraps GrammarRuntime.fill / .apply to time them inside the processor."""

    def __init__(self, rt):
        self.rt = rt
        self.fill_s = 0.0
        self.mask_s = 0.0
        fill, apply = rt.fill, rt.apply

        def timed_fill(*a, **k):
            t = time.perf_counter()
            try:
                return fill(*a, **k)
            finally:
                self.fill_s += time.perf_counter() - t

        def timed_apply(*a, **k):
            t = time.perf_counter()
            try:
                return apply(*a, **k)
            finally:
                self.mask_s += time.perf_counter() - t

        rt.fill, rt.apply = timed_fill, timed_apply

    def reset(self):
        self.fill_s = self.mask_s = 0.0


def run_processor(args) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample.logits_processor import BatchUpdate

    from vllm_plugins.bench.engines import resolve_model
    from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    model = resolve_model(args.model)
    rows = load_schemas(args.schemas, args.schema_file)

    # ---- compile coverage ----------------------------------------------------
    by_split: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    reasons: collections.Counter = collections.Counter()
    compile_ms: list[float] = []
    compiled_schemas = []
    for row in rows:
        split = row.get("split", "-")
        by_split[split][0] += 1
        t = time.perf_counter()
        try:
            compile_grammar_request({"json_schema": row["schema"]})
        except GrammarSpecError as e:
            reasons[str(e).split(": ", 1)[-1].splitlines()[0][:80]] += 1
            continue
        compile_ms.append((time.perf_counter() - t) * 1e3)
        by_split[split][1] += 1
        compiled_schemas.append(row["schema"])
    total, ok = len(rows), len(compiled_schemas)
    print(f"schemas: {args.schema_file or 'json_schemas_dev.jsonl'}  ({total})")
    print("\n| split | schemas | compiled | % |\n| --- | ---: | ---: | ---: |")
    for split, (n, c) in sorted(by_split.items()):
        print(f"| {split} | {n} | {c} | {100 * c / n:.1f} |")
    print(f"| **all** | **{total}** | **{ok}** | **{100 * ok / max(total, 1):.1f}** |")
    print("\nrefused:", *(f"  {n}  {r}" for r, n in reasons.most_common()), sep="\n")
    print(f"\ncompile+validate (frontend, no tokenizer) ms: p50 {_pct(compile_ms, 50, NAN):.2f} "
          f"p99 {_pct(compile_ms, 99, NAN):.2f} max {max(compile_ms):.2f}")

    # ---- per-token cost through the processor -------------------------------
    cfg = EngineArgs(
        model=model, max_model_len=1024, enforce_eager=True, dtype="float32"
    ).create_engine_config()
    vocab = cfg.model_config.get_vocab_size()
    tok = AutoTokenizer.from_pretrained(model)
    proc = GrammarLogitsProcessor(cfg, torch.device("cpu"), False)
    eos = tok.eos_token_id
    gen = torch.Generator().manual_seed(args.seed)

    def sp(schema):
        p = SamplingParams(extra_args={"grammar": {"json_schema": schema}})
        p.update_from_generation_config({}, eos)
        return p

    # first request builds the llguidance tokenizer; time it separately
    t = time.perf_counter()
    proc.update_state(BatchUpdate(1, [], [(0, sp(compiled_schemas[0]), None, [])], []))
    print(f"\nllguidance tokenizer build (once per engine): {time.perf_counter() - t:.2f} s")
    proc.update_state(BatchUpdate(0, [0], [], []))
    timer = _Timed(proc._runtime)

    print("\n| batch | steps | step p50 ms | step p99 ms | fill p50 | fill p99 | mask p50 | mask p99 "
          "| advance p50 | request add p50 ms | finished by EOS |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    no_grammar_ns: list[float] = []
    for batch in args.batch:
        steps, fills, masks, advs, adds = [], [], [], [], []
        finished = started = 0
        for start in range(0, len(compiled_schemas), batch):
            group = compiled_schemas[start : start + batch]
            outs = [[] for _ in group]
            t = time.perf_counter()
            proc.update_state(
                BatchUpdate(len(group), [], [(i, sp(s), None, outs[i]) for i, s in enumerate(group)], [])
            )
            adds.append((time.perf_counter() - t) * 1e3 / len(group))
            started += len(group)
            live = list(range(len(group)))
            for _ in range(args.tokens):
                logits = torch.randn(len(group), vocab, generator=gen)
                timer.reset()
                t = time.perf_counter()
                proc.apply(logits)
                dt = time.perf_counter() - t
                steps.append(dt * 1e3)
                fills.append(timer.fill_s * 1e3)
                masks.append(timer.mask_s * 1e3)
                advs.append((dt - timer.fill_s - timer.mask_s) * 1e3)
                nxt = torch.argmax(logits, dim=-1).tolist()
                for i in list(live):
                    outs[i].append(nxt[i])
                    if nxt[i] == eos:
                        live.remove(i)
                        finished += 1
                if not live:
                    break
            proc.update_state(BatchUpdate(0, list(range(len(group)))[::-1], [], []))
        print(f"| {batch} | {len(steps)} | {_pct(steps, 50, NAN):.3f} | {_pct(steps, 99, NAN):.3f} | "
              f"{_pct(fills, 50, NAN):.3f} | {_pct(fills, 99, NAN):.3f} | {_pct(masks, 50, NAN):.3f} | "
              f"{_pct(masks, 99, NAN):.3f} | {_pct(advs, 50, NAN):.3f} | {statistics.median(adds):.3f} | "
              f"{finished}/{started} |")

    # ---- cost for a batch without grammar requests ---------------------------
    plain = SamplingParams()
    proc.update_state(BatchUpdate(8, [], [(i, plain, None, []) for i in range(8)], []))
    logits = torch.randn(8, vocab)
    for _ in range(2000):
        t = time.perf_counter_ns()
        proc.update_state(None)
        proc.apply(logits)
        no_grammar_ns.append(time.perf_counter_ns() - t)
    print(f"\nbatch of 8 without grammar requests: update_state+apply p50 "
          f"{_pct(no_grammar_ns, 50, NAN) / 1e3:.2f} us, p99 {_pct(no_grammar_ns, 99, NAN) / 1e3:.2f} us")
    print(f"torch threads: {torch.get_num_threads()}, vocab: {vocab}")
    if args.generate:
        generate_with_processor(model, compiled_schemas, args)
    return 0


def generate_with_processor(model: str, schemas: list, args) -> None:
    """Greedy decoding of ``args.generate`` schemas, spread evenly, through
    the processor (``extra_args["grammar"]``) in one ``vllm.LLM``."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    step = max(1, len(schemas) // args.generate)
    picked = schemas[::step][: args.generate]
    llm = LLM(model=model, enforce_eager=True, dtype="float32",
              max_model_len=args.max_model_len, gpu_memory_utilization=0.1, seed=args.seed)
    tok = llm.get_tokenizer()
    prompts = [{"prompt_token_ids": prompt_ids(tok, s)} for s in picked]
    compact = {"whitespace_flexible": False} if args.compact else {}
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             extra_args={"grammar": {"json_schema": s, **compact}})
              for s in picked]
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    finished = valid = n_tokens = 0
    for schema, out in zip(picked, outs):
        c = out.outputs[0]
        n_tokens += len(c.token_ids)
        if c.finish_reason != "stop":
            continue
        finished += 1
        if valid_json(c.text, schema):
            valid += 1
        else:
            print(f"INVALID: {c.text[:200]!r}")
    print(f"\ngenerate: {len(picked)} schemas, greedy, max_tokens {args.max_tokens}, "
          f"{'compact' if args.compact else 'flexible'} whitespace: finished {finished}, "
          f"valid {valid}/{finished} finished, truncated {len(picked) - finished}; "
          f"{n_tokens} tokens in {dt:.1f} s")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.awrs or args.awrs_engine:  # both: the replay first, then the engine
        from vllm_plugins.bench.grammar_awrs import run_awrs
        from vllm_plugins.bench.grammar_awrs_engine import run_awrs_engine

        rc = run_awrs(args) if args.awrs else 0
        return rc or (run_awrs_engine(args) if args.awrs_engine else 0)
    if args.modes:
        from vllm_plugins.bench.grammar_modes import run_modes

        return run_modes(args)
    return run_processor(args) if args.processor else run_drafts(args)
