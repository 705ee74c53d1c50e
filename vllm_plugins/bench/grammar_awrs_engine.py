"""AWRS against the mask mode end to end: output tok/s through one
``vllm.LLM``, greedy and at temperature 1, at each ``--batch``.

    python -m vllm_plugins.bench grammar --awrs-engine --schemas 16 --max-tokens 96 --batch 1 16

Why one engine: the grammar processor's mode is per request
(``"sampling"`` in the grammar spec), so one engine serves both modes and
nothing but the mode differs between them: the same model, prompts,
compiled grammars and prefix cache. The default model, CPU, float32,
``enforce_eager``, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``
unless set), the dev schemas with the grammar bench's prompt.

Before the timed runs every prompt is run once in each mode for two
tokens: its prompt is then in the prefix cache (sized to hold all of them)
and its grammar compiled, so the timed runs differ only in decoding. The
schemas are cut into groups of ``batch``, each group one ``LLM.generate``
per mode (all its requests at once), the mode that goes first alternating
per group; when the number of groups is odd every group runs twice, in
both orders, so each mode goes first equally often. Temperature 1 is
unseeded: both modes draw from the same distribution, not the same tokens.

Per decoding and batch: output tokens over the seconds of the mode's
``generate`` calls, the ratio, and (greedy) the runs whose outputs equal the
mask mode's in the same group; AWRS's grammar checks and masks per token
from the engine's processor.
"""

from __future__ import annotations

import os
import time

_MODES = ("mask", "awrs")


def _kv_cache_bytes(model: str, tokens: int) -> int:
    """Room for ``tokens`` tokens of the model's float32 KV cache, with a
    margin for block rounding."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 4
    return int(tokens * per_token * 1.5) + 64 * 2**20


def _awrs_counts(llm) -> tuple[int, int, int]:
    """(rows, grammar checks, masks) of the engine's AWRS requests so far."""
    (counts,) = llm.collective_rpc(lambda w: [
        (p.awrs_stats.rows, p.awrs_stats.checks, p.awrs_stats.masks)
        for p in w.model_runner.input_batch.logitsprocs.all
        if type(p).__name__ == "GrammarLogitsProcessor"])
    return tuple(map(sum, zip(*counts))) if counts else (0, 0, 0)


def run_awrs_engine(args) -> int:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm_plugins.bench.engines import quiet_vllm, resolve_model

    quiet_vllm()
    import torch
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    from vllm_plugins.bench.grammar_bench import load_schemas, prompt_ids
    from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request

    if args.threads:
        torch.set_num_threads(args.threads)
    model = resolve_model(args.model)
    tok = AutoTokenizer.from_pretrained(model)
    schemas, prompts = [], []
    for row in load_schemas(args.schemas, args.schema_file):
        try:
            compile_grammar_request({"json_schema": row["schema"]})
        except GrammarSpecError:
            continue
        ids = prompt_ids(tok, row["schema"])
        if len(ids) + args.max_tokens <= args.max_model_len:
            schemas.append(row["schema"])
            prompts.append(ids)
    if not schemas:
        raise SystemExit("--awrs-engine: no schema compiles and fits --max-model-len")
    tokens = sum(len(p) + args.max_tokens for p in prompts)
    t = time.perf_counter()
    llm = LLM(model=model, dtype="float32", max_model_len=args.max_model_len,
              max_num_seqs=max(args.batch), enforce_eager=True, seed=args.seed,
              enable_prefix_caching=True,
              max_num_batched_tokens=max(args.max_model_len, 2048),
              kv_cache_memory_bytes=_kv_cache_bytes(model, tokens), use_tqdm_on_load=False)
    print(f"model {model}, {len(schemas)} schemas, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens, max tokens {args.max_tokens}, engine "
          f"{time.perf_counter() - t:.0f} s to start, torch threads {torch.get_num_threads()}",
          flush=True)

    def params(i: int, mode: str, temperature: float, max_tokens: int):
        return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                              extra_args={"grammar": {"json_schema": schemas[i],
                                                      "sampling": mode}})

    def run(group: list[int], mode: str, temperature: float, max_tokens: int):
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in group],
                            [params(i, mode, temperature, max_tokens) for i in group],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - start

    for i in range(len(schemas)):  # prefix cache and compiled grammars, both modes
        for mode in _MODES:
            run([i], mode, 0.0, 2)

    print("\n| decoding | batch | runs | tokens, mask | AWRS | tok/s, mask | AWRS | "
          "AWRS / mask | greedy outputs equal | AWRS checks / token | masks / token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
          flush=True)
    for temperature, label in ((0.0, "greedy"), (1.0, "temperature 1")):
        for batch in args.batch:
            idx = list(range(len(schemas)))
            groups = [idx[i:i + batch] for i in range(0, len(idx), batch)]
            runs = groups * (2 if len(groups) % 2 else 1)
            n_tok = {m: 0 for m in _MODES}
            secs = {m: 0.0 for m in _MODES}
            equal = 0
            before = _awrs_counts(llm)
            for k, group in enumerate(runs):
                got = {}
                for mode in (_MODES if k % 2 == 0 else _MODES[::-1]):
                    got[mode], s = run(group, mode, temperature, args.max_tokens)
                    n_tok[mode] += sum(map(len, got[mode]))
                    secs[mode] += s
                equal += sum(a == m for a, m in zip(got["awrs"], got["mask"]))
            rows, checks, masks = (a - b for a, b in zip(_awrs_counts(llm), before))
            tps = {m: n_tok[m] / secs[m] for m in _MODES}
            same = f"{equal}/{sum(map(len, runs))}" if temperature == 0.0 else "-"
            print(f"| {label} | {batch} | {len(runs)} | {n_tok['mask']} | {n_tok['awrs']} | "
                  f"{tps['mask']:.1f} | {tps['awrs']:.1f} | {tps['awrs'] / tps['mask']:.2f} | "
                  f"{same} | {checks / max(rows, 1):.2f} | {masks / max(rows, 1):.3f} |",
                  flush=True)
    return 0
