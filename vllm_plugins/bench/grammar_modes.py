"""vLLM's native structured output against our grammar logits processor, per
mode, on the same schemas, prompts and token budget.

    python -m vllm_plugins.bench grammar --modes all --schemas 32 --max-tokens 128

A mode is how a request asks for its JSON schema (``native``: vLLM's
``structured_outputs``; ``ours``: ``extra_args["grammar"]`` for the grammar
logits processor, default reading) and the engine's speculative config. One
engine per mode (greedy, batch 1, default model, ``enforce_eager``): modes
never share an engine, so no mode sees another's prefix cache or the
tables Token Recycling learned from another mode's run of the same schema.
Each schema runs on every mode in turn, rotating which goes first. Per mode:

* compiled: schemas the engine accepted (a refused request raises at
  ``add_request``), of those run; plus, for the whole schema file, how many
  the mode's compile path accepts (no engine: vLLM's ``auto`` choice and its
  backend for native, ``compile_grammar_request`` for ours);
* valid: outputs that finished before ``--max-tokens`` and validate with
  ``jsonschema``;
* same as native: outputs token-identical to the ``native`` mode's, of the
  schemas both compiled; same unspeculated: a speculating mode's outputs
  token-identical to its own kind's without speculation (``native`` or
  ``ours``), which greedy verification must keep exact;
* tok/s: output tokens over wall-clock seconds of the mode's requests;
* mask ms per token, p50 / p99: the mode's grammar replayed over its own
  outputs after the engines are gone: next-token bitmask plus applying it to
  a logits row (native: vLLM's xgrammar backend grammar and xgrammar's
  ``apply_token_bitmask_inplace``; ours: ``GrammarRuntime.fill`` and
  ``apply``, what the processor runs per row), with ``--threads`` torch
  threads (default 1, as ``--processor``). Ours under speculation: the
  processor itself replayed on its drafted rows (``verified_mask_times``),
  per output token.
"""

from __future__ import annotations

import json
import time

# mode -> (how the request asks for its schema, speculative config or None).
# A mode is one line here, and one engine.
MODES = {
    "native": ("native", None),
    "native+grammar_forced(token_recycling)": (
        "native", {"method": "grammar_forced", "inner": "token_recycling",
                   "num_speculative_tokens": 6}),
    "ours": ("ours", None),
    "ours+grammar_forced(token_recycling)": (
        "ours", {"method": "grammar_forced", "inner": "token_recycling",
                 "num_speculative_tokens": 6}),
}


def _params(kind: str, schema, max_tokens: int):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if kind == "native":
        return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                              structured_outputs=StructuredOutputsParams(json=schema))
    return SamplingParams(temperature=0.0, max_tokens=max_tokens,
                          extra_args={"grammar": {"json_schema": schema}})


def native_compiles(schema) -> bool:
    """vLLM's ``auto`` validation for a JSON schema: xgrammar, else guidance."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    try:
        validate_xgrammar_grammar(sp)
        return True
    except (ValueError, VLLMValidationError):
        pass
    try:
        validate_guidance_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        return True
    except (ValueError, VLLMValidationError):
        return False


def ours_compiles(schema) -> bool:
    from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request

    try:
        compile_grammar_request({"json_schema": schema})
        return True
    except GrammarSpecError:
        return False


def mask_times(kind: str, vllm_config, tok, outputs: list[tuple[dict, list[int]]]) -> list[float]:
    """Milliseconds per token: bitmask + applying it to one logits row,
    replayed over ``outputs`` with the mode's grammar."""
    import torch

    vocab = vllm_config.model_config.get_vocab_size()
    logits = torch.zeros(1, vocab)
    out: list[float] = []
    if kind == "native":
        import xgrammar as xgr
        from vllm.v1.structured_output.backend_types import StructuredOutputOptions
        from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

        backend = XgrammarBackend(vllm_config, tokenizer=tok, vocab_size=vocab)
        bitmask = backend.allocate_token_bitmask(1)
        for schema, tokens in outputs:
            try:
                grammar = backend.compile_grammar(StructuredOutputOptions.JSON, json.dumps(schema))
            except Exception:  # noqa: BLE001 - xgrammar refuses what guidance served
                continue
            for t in tokens:
                start = time.perf_counter()
                grammar.fill_bitmask(bitmask, 0)
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                out.append((time.perf_counter() - start) * 1e3)
                if not grammar.accept_tokens("bench", [t]) or grammar.is_terminated():
                    break
        return out

    from vllm_plugins.grammar.runtime import GrammarRuntime, build_ll_tokenizer
    from vllm_plugins.grammar.spec import compile_grammar_request

    runtime = GrammarRuntime(build_ll_tokenizer(tok, vocab))
    for schema, tokens in outputs:
        matcher = runtime.new_matcher(compile_grammar_request({"json_schema": schema}))
        for t in tokens:
            start = time.perf_counter()
            runtime.fill([(matcher, 0)], 1)
            runtime.apply(logits, [0], [0])
            out.append((time.perf_counter() - start) * 1e3)
            if not matcher.consume_token(t) or matcher.is_stopped():
                break
    return out


def verified_mask_times(vllm_config, tok, outputs: list[tuple[dict, list[int]]],
                        num_drafts: int) -> list[float]:
    """Milliseconds per output token of our processor's work under
    speculation, replayed: each step drafts the output's next ``num_drafts``
    tokens (all accepted), the processor masks the bonus row and the target
    rows as the bridge has it do (``begin_verification``, ``apply``,
    ``apply_drafted``), and the step's time is spread over its tokens."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    vocab = vllm_config.model_config.get_vocab_size()
    out: list[float] = []
    for schema, tokens in outputs:
        proc = GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)
        sp = SamplingParams(temperature=0.0, extra_args={"grammar": {"json_schema": schema}})
        sp.update_from_generation_config({}, tok.eos_token_id)
        output: list[int] = []
        proc.update_state(BatchUpdate(1, [], [(0, sp, [0], output)], []))
        i = 0
        while i < len(tokens):
            draft = tokens[i:i + num_drafts][:len(tokens) - i - 1]
            bonus, target = torch.zeros(1, vocab), torch.zeros(len(draft), vocab)
            start = time.perf_counter()
            if draft:
                proc.begin_verification([draft])
                try:
                    proc.apply(bonus)
                    proc.apply_drafted(target, [len(draft)])
                finally:
                    proc.end_verification()
            else:
                proc.apply(bonus)
            per_token = (time.perf_counter() - start) * 1e3 / (len(draft) + 1)
            out += [per_token] * (len(draft) + 1)
            output.extend(tokens[i:i + len(draft) + 1])
            i += len(draft) + 1
    return out


def run_modes(args) -> int:
    import numpy as np
    from tqdm import tqdm
    from vllm.exceptions import VLLMClientError

    from vllm_plugins.bench.engines import resolve_model, run_batch, shutdown_all
    from vllm_plugins.bench.grammar_bench import build, load_schemas, prompt_ids, valid_json

    modes = list(MODES) if args.modes == "all" else [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {list(MODES)}")
    model = resolve_model(args.model)
    all_rows = load_schemas(0, args.schema_file)
    rows = load_schemas(args.schemas + args.warmup, args.schema_file)
    warm, rows = rows[:args.warmup], rows[args.warmup:]

    coverage = {"native": sum(native_compiles(r["schema"]) for r in all_rows),
                "ours": sum(ours_compiles(r["schema"]) for r in all_rows)}

    configs = {m: m for m in modes}  # one engine per mode
    engines = {}
    for m in modes:
        t = time.perf_counter()
        engines[configs[m]] = build(model, MODES[m][1], args)
        print(f"engine for {m}: {time.perf_counter() - t:.0f} s to start", flush=True)
    first = next(iter(engines.values()))
    tok = first.get_tokenizer()
    vllm_config = first.llm_engine.vllm_config
    refused_errors = (ValueError, VLLMClientError)

    for row in warm:
        ids = prompt_ids(tok, row["schema"])
        for m in modes:
            try:
                run_batch(engines[configs[m]], [ids], _params(MODES[m][0], row["schema"], args.max_tokens))
            except refused_errors:
                pass

    stats = {m: {"run": 0, "compiled": 0, "finished": 0, "valid": 0, "tokens": 0,
                 "seconds": 0.0, "forwards": 0} for m in modes}
    outputs: dict[str, list] = {m: [] for m in modes}
    by_schema: dict[str, dict[int, list[int]]] = {m: {} for m in modes}
    for i, row in enumerate(tqdm(rows, desc="schemas")):
        schema = row["schema"]
        ids = prompt_ids(tok, schema)
        if len(ids) + args.max_tokens > args.max_model_len:
            continue
        for m in modes[i % len(modes):] + modes[:i % len(modes)]:
            s = stats[m]
            s["run"] += 1
            try:
                (res,), secs = run_batch(engines[configs[m]], [ids],
                                         _params(MODES[m][0], schema, args.max_tokens))
            except refused_errors:
                continue
            s["compiled"] += 1
            s["tokens"] += len(res.token_ids)
            s["seconds"] += secs
            s["forwards"] += res.forwards
            finished = len(res.token_ids) < args.max_tokens
            s["finished"] += finished
            s["valid"] += finished and valid_json(tok.decode(res.token_ids, skip_special_tokens=True),
                                                  schema)
            outputs[m].append((schema, list(res.token_ids)))
            by_schema[m][i] = list(res.token_ids)
    shutdown_all(engines.values())

    print(f"\nwhole schema file: native compiles {coverage['native']}, ours {coverage['ours']} "
          f"of {len(all_rows)}")
    print(f"\n{len(rows)} schemas, greedy, batch 1, max_tokens {args.max_tokens}, "
          f"any-whitespace JSON\n")
    print("| mode | compiled | valid | finished | same as native | same unspeculated "
          "| tokens | tok/s | MAT | mask ms/token p50 | p99 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    import torch

    if args.threads:  # the replay's masked_fill on a shared, loaded CPU: see --threads
        torch.set_num_threads(args.threads)
    table = {}
    for m in modes:
        s = stats[m]
        spec = MODES[m][1]
        masks = (verified_mask_times(vllm_config, tok, outputs[m],
                                     spec.get("num_speculative_tokens", 6))
                 if MODES[m][0] == "ours" and spec else
                 mask_times(MODES[m][0], vllm_config, tok, outputs[m]))
        p50 = float(np.percentile(masks, 50)) if masks else float("nan")
        p99 = float(np.percentile(masks, 99)) if masks else float("nan")
        tps = s["tokens"] / s["seconds"] if s["seconds"] else float("nan")
        mat = s["tokens"] / s["forwards"] if s["forwards"] else float("nan")
        both = [i for i in by_schema[m] if i in by_schema.get("native", {})]
        same = f"{sum(by_schema[m][i] == by_schema['native'][i] for i in both)}/{len(both)}"
        plain = MODES[m][0]
        if MODES[m][1] and plain in by_schema:
            pair = [i for i in by_schema[m] if i in by_schema[plain]]
            unspec = f"{sum(by_schema[m][i] == by_schema[plain][i] for i in pair)}/{len(pair)}"
        else:
            unspec = "-"
        table[m] = {**s, "tok_s": tps, "mat": mat, "mask_ms_p50": p50, "mask_ms_p99": p99,
                    "same_as_native": same, "same_unspeculated": unspec}
        print(f"| {m} | {s['compiled']}/{s['run']} | {s['valid']} | {s['finished']} | {same} | "
              f"{unspec} | "
              f"{s['tokens']} | {tps:.1f} | {mat:.2f} | {p50:.3f} | {p99:.3f} |")
    if args.out:
        from pathlib import Path

        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "grammar_modes.json").write_text(json.dumps(
            {"args": vars(args), "coverage": coverage, "modes": table,
             "outputs": {m: {rows[i]["name"]: tok.decode(t) for i, t in by_schema[m].items()}
                         for m in modes}},
            indent=1, default=str, ensure_ascii=False))
    return 0
