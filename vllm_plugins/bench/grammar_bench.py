"""vLLM structured output with and without grammar-forced drafts, side by side.

    python -m vllm_plugins.bench.grammar_bench --schemas 60 --max-tokens 256

One process builds one engine per method once (default model, greedy, batch 1)
and runs every JSONSchemaBench dev schema on each engine in turn, rotating
which engine goes first, so host noise falls on all methods alike. Every
request uses vLLM's own structured outputs
(``StructuredOutputsParams(json=schema)``, the engine's backend, ``auto`` by
default). MAT (output tokens per target forward) is exact, from
``LLMEngine.step``; "mismatches" counts outputs that differ from the engine
without speculation (must be 0).

Also reported, per run:

* coverage: schemas vLLM accepted (compiled) / outputs that finished and
  validate with ``jsonschema``; schemas llguidance compiles for the drafts;
* compile time of a schema to an llguidance matcher (what the guidance backend
  and our proposer do per new schema), p50 / p99;
* per-token mask time: llguidance's next-token bitmask, replayed over the
  generated outputs (the guidance backend's per-token cost), p50 / p99;
* the proposer's own cost per request per step (follow + forced walk + grammar
  check of the inner draft), p50 / p99, from its metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import time

METHODS = {
    "none": None,
    "grammar": {"method": "grammar", "num_speculative_tokens": 6},
    "grammar+token_recycling": {"method": "grammar", "inner": "token_recycling",
                                "num_speculative_tokens": 6},
    # Not run unless asked for: the inner proposer alone, to show what the
    # grammar adds to it.
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 6},
}
# What add_request raises for a schema vLLM refuses; set in main (vLLM import).
REFUSED: tuple = (ValueError,)
DEFAULT_METHODS = ["none", "grammar", "grammar+token_recycling"]
PROMPT = ("Write a JSON object that follows this JSON schema:\n{schema}\n"
          "Reply with the JSON only.")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench.grammar_bench",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma list of: {', '.join(METHODS)}")
    p.add_argument("--schemas", type=int, default=60,
                   help="how many dev schemas, spread evenly over the file (0: all)")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--backend", default="auto",
                   help="vLLM structured_outputs_config.backend (auto, xgrammar, guidance)")
    p.add_argument("--compact", action="store_true",
                   help="structured_outputs_config.disable_any_whitespace=True")
    p.add_argument("--warmup", type=int, default=1, help="untimed schemas first")
    p.add_argument("--num-speculative-tokens", type=int, default=6)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--out", default="bench_out/grammar")
    return p.parse_args(argv)


def load_schemas(n: int) -> list[dict]:
    from vllm_plugins.bench.data import shared_data

    rows = [json.loads(line) for line in
            shared_data("json_schemas_dev.jsonl").read_text().splitlines() if line.strip()]
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
               max_num_seqs=4, enforce_eager=True, seed=0,
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


def _pct(values, q) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if len(values) else None


def grammar_costs(tok, vocab: int, outputs: list[tuple[dict, list[int]]]) -> dict:
    """Compile time per schema and per-token mask time, llguidance, replayed
    over the generated outputs (no model)."""
    import llguidance
    import numpy as np

    from vllm_plugins.logits_processors.masking import build_ll_tokenizer
    from vllm_plugins.logits_processors.spec import GrammarSpecError
    from vllm_plugins.proposers.grammar_source import grammar_for

    from vllm.sampling_params import StructuredOutputsParams

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


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from vllm.exceptions import VLLMClientError

    from vllm_plugins.bench.engines import (acceptance_between, engine_stats,
                                           resolve_model, run_batch, shutdown_all)
    from vllm_plugins.bench.report import Tally, title, write

    global REFUSED
    REFUSED = (ValueError, VLLMClientError)

    model = resolve_model(args.model)
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; known: {list(METHODS)}")
    if "none" not in methods:
        methods.insert(0, "none")
    specs = {m: (dict(METHODS[m], num_speculative_tokens=args.num_speculative_tokens)
                 if METHODS[m] else None) for m in methods}
    rows = load_schemas(args.schemas + args.warmup)
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
                except REFUSED:
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
        except REFUSED as e:  # vLLM refused the schema
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


if __name__ == "__main__":
    raise SystemExit(main())
