"""Measure the grammar processor on a file of JSON schemas: compile coverage and
per-token mask time.

    python -m vllm_plugins.logits_processors.bench_grammar \
        [--schemas SHARED_DATA/json_schemas_dev.jsonl] [--tokens 64] [--batch 1 8]

For every schema (one JSON object per line with a "schema" field, as in
json_schemas_dev.jsonl) the request is compiled exactly as
``extra_args={"grammar": {"json_schema": schema}}`` would be. For each compiled
schema a random walk is decoded through ``GrammarLogitsProcessor.apply`` on CPU
logits (random logits, so any allowed token may come next), with no model: the
time per step is the processor's whole per-token cost, split into

* advance: consuming the newly sampled token(s) into the matcher,
* fill:    llguidance computing the next-token bitmask,
* mask:    writing -inf into the logits from the bitmask,

Timings are wall-clock per decoding step per batch (batch 1: per token).
No vLLM engine is started for this part; vLLM is imported for its
SamplingParams and BatchUpdate types and the processor class.

``--generate N`` then starts one ``vllm.LLM`` on the default model (CPU
settings as in the tests) and decodes N of the compiled schemas (spread evenly
over the file) greedily with a chat prompt, reporting how many outputs finish
(EOS before ``--max-tokens``) and how many of those validate with
``jsonschema`` (needs the ``test`` extra).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch



def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--schemas", default=None,
                    help="default: json_schemas_dev.jsonl of the shared data")
    ap.add_argument("--tokens", type=int, default=64, help="max decode steps per schema walk")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--limit", type=int, default=0, help="use only the first N schemas")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--generate", type=int, default=0, help="also decode N schemas with vllm.LLM")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--compact", action="store_true", help='"whitespace_flexible": false when generating')
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)

    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.sample.logits_processor import BatchUpdate

    from vllm_plugins.default_model import default_model_path
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor
    from vllm_plugins.logits_processors.spec import GrammarSpecError, compile_grammar_request

    if args.schemas is None:
        from vllm_plugins.bench.data import shared_data

        args.schemas = shared_data("json_schemas_dev.jsonl")
    rows = [json.loads(line) for line in Path(args.schemas).read_text().splitlines() if line.strip()]
    if args.limit:
        rows = rows[: args.limit]

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
    print(f"schemas: {args.schemas}  ({total})")
    print("\n| split | schemas | compiled | % |\n| --- | ---: | ---: | ---: |")
    for split, (n, c) in sorted(by_split.items()):
        print(f"| {split} | {n} | {c} | {100 * c / n:.1f} |")
    print(f"| **all** | **{total}** | **{ok}** | **{100 * ok / max(total, 1):.1f}** |")
    print("\nrefused:", *(f"  {n}  {r}" for r, n in reasons.most_common()), sep="\n")
    print(f"\ncompile+validate (frontend, no tokenizer) ms: p50 {_pct(compile_ms, 50):.2f} "
          f"p99 {_pct(compile_ms, 99):.2f} max {max(compile_ms):.2f}")

    # ---- per-token cost through the processor -------------------------------
    cfg = EngineArgs(
        model=default_model_path(), max_model_len=1024, enforce_eager=True, dtype="float32"
    ).create_engine_config()
    vocab = cfg.model_config.get_vocab_size()
    tok = AutoTokenizer.from_pretrained(default_model_path())
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
        print(f"| {batch} | {len(steps)} | {_pct(steps, 50):.3f} | {_pct(steps, 99):.3f} | "
              f"{_pct(fills, 50):.3f} | {_pct(fills, 99):.3f} | {_pct(masks, 50):.3f} | "
              f"{_pct(masks, 99):.3f} | {_pct(advs, 50):.3f} | {statistics.median(adds):.3f} | "
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
          f"{_pct(no_grammar_ns, 50) / 1e3:.2f} us, p99 {_pct(no_grammar_ns, 99) / 1e3:.2f} us")
    print(f"torch threads: {torch.get_num_threads()}, vocab: {vocab}")
    if args.generate:
        generate(compiled_schemas, args)
    return 0


def generate(schemas: list, args) -> None:
    import os

    import jsonschema

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from vllm_plugins.default_model import default_model_path

    step = max(1, len(schemas) // args.generate)
    picked = schemas[::step][: args.generate]
    llm = LLM(model=default_model_path(), enforce_eager=True, dtype="float32",
              max_model_len=4096, gpu_memory_utilization=0.1, seed=args.seed)
    tok = llm.get_tokenizer()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": "Write a JSON object that follows this JSON schema:\n"
              + json.dumps(s) + "\nReply with the JSON only."}],
            add_generation_prompt=True, tokenize=False,
        )
        for s in picked
    ]
    grammar = lambda s: {"json_schema": s, **({"whitespace_flexible": False} if args.compact else {})}  # noqa: E731
    params = [SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                             extra_args={"grammar": grammar(s)}) for s in picked]
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
        try:
            jsonschema.validate(json.loads(c.text), schema)
            valid += 1
        except Exception as e:  # noqa: BLE001 - report, keep counting
            print(f"INVALID: {str(e)[:200]}\n  {c.text[:200]!r}")
    print(f"\ngenerate: {len(picked)} schemas, greedy, max_tokens {args.max_tokens}, "
          f"{'compact' if args.compact else 'flexible'} whitespace: finished {finished}, "
          f"valid {valid}/{finished} finished, truncated {len(picked) - finished}; "
          f"{n_tokens} tokens in {dt:.1f} s")


if __name__ == "__main__":
    raise SystemExit(main())
