"""What Token Recycling adds to a step on a large vocabulary, against vLLM ngram.

Token Recycling learns from the target's top-k at every verified row, so its
own work grows with the vocabulary where vLLM's ngram lookup does not. This
measures that difference on a random tiny Llama whose vocabulary is
``--vocab`` (262144 by default, the size of the largest families'), where
the model's layers cost little and the vocabulary-wide work shows.

Both engines live in this process and take turns, one batch each (the
order alternates), so host noise hits both alike. The model (tied
embeddings, small weights) mostly repeats its last token, and the prompts
are a token repeated, so both methods often draft their full ``--drafts``
tokens. Steps are compared at the token count both engines reach most
often: there both verify the same rows, and the step-time difference is
each method's own work (drafting, and for Token Recycling the top-k it
learns from), not a difference in what the target computes. Both engines
decode greedily, and the outputs that differ between them are counted.

Per step it records the process's CPU time (``time.process_time``: on a
shared host, wall time mostly measures the neighbours) of the engine step
(``LLMEngine.step``), of the runner's ``_sample`` (vLLM's sampler, plus the
top-k stash for Token Recycling), of the stash alone, and of
``propose_draft_token_ids`` (each method's drafting). It reports medians
with the 25th and 75th percentiles at the most common token count, and the
per-round difference of the two engines' median steps (its median and
range). Wall-clock medians are printed beside them.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=0 \\
        python -m vllm_plugins.bench vocab-cost --batch-sizes 1,16 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

ENGINES = {
    "ngram": {"method": "ngram", "prompt_lookup_max": 5, "prompt_lookup_min": 2},
    "token_recycling": {"method": "token_recycling", "draft_length": "fixed",
                        "min_confidence": 0},
}


def tiny_vocab_llama(path: str | Path, vocab: int, *, num_layers: int = 2,
                     hidden_size: int = 64, seed: int = 0) -> str:
    """A random Llama with a ``vocab``-sized vocabulary and no tokenizer
    (the bench feeds token ids): tied embeddings with a small initial range
    make it mostly repeat its last token. Reused when already written."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    spec = {"vocab": vocab, "num_layers": num_layers, "hidden_size": hidden_size,
            "seed": seed}
    marker = path / "vllm_plugins_vocab_cost.json"
    if marker.is_file() and json.loads(marker.read_text()) == spec:
        return str(path)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1,
                         head_dim=hidden_size // 2, max_position_embeddings=2048,
                         tie_word_embeddings=True, initializer_range=0.05,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None,
                         dtype="float32")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(json.dumps(spec))
    return str(path)


def build(model: str, spec: dict, drafts: int, max_num_seqs: int):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    # A [tokens, vocab] float32 tensor is 1 MiB a token here: the token
    # budget is kept to what a batch of these prompts needs.
    llm = LLM(model=model, dtype="float32", max_model_len=1024,
              max_num_seqs=max_num_seqs, max_num_batched_tokens=1024,
              enforce_eager=True, skip_tokenizer_init=True,
              speculative_config={**spec, "num_speculative_tokens": drafts}, seed=0,
              kv_cache_memory_bytes=128 * 2**20, use_tqdm_on_load=False)
    return llm


def runner_of(llm):
    # In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): the one worker's runner.
    core = llm.llm_engine.engine_core.engine_core
    return core.model_executor.driver_worker.worker.model_runner


def timed(obj, name: str, sink: list) -> None:
    """Shadow ``obj.name`` by a wrapper appending each call's CPU seconds
    to sink."""
    original = getattr(obj, name)

    def wrapper(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            sink.append(time.process_time() - start)

    setattr(obj, name, wrapper)


class Probe:
    """Per step of one engine: its token count, and the seconds of the step,
    of ``_sample`` and of ``propose_draft_token_ids``."""

    def __init__(self, llm):
        self.runner = runner_of(llm)
        self.tokens: list[int] = []
        self.sample: list[float] = []
        self.propose: list[float] = []
        runner = self.runner
        original = runner.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            self.tokens.append(int(scheduler_output.total_num_scheduled_tokens))
            return original(scheduler_output, *args, **kwargs)

        runner.execute_model = execute_model
        timed(runner, "_sample", self.sample)
        timed(runner, "propose_draft_token_ids", self.propose)


# Every Token Recycling step's top-k stash, in call order (one engine runs
# at a time, so run_round attributes the new entries to the engine it runs).
STASHES: list[float] = []


def time_stashes() -> None:
    from vllm_plugins.bridge.v1 import step

    timed(step, "stash_topk", STASHES)


def run_round(llm, probe: Probe, prompts, params, records: list, name: str, rnd: int):
    """One batch through ``llm``, stepping the engine here so that each step
    is timed; appends one record per step that sampled."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    out_tokens = defaultdict(list)
    for i, p in enumerate(prompts):
        engine.add_request(f"{name}-{rnd}-{i}", {"prompt_token_ids": p}, params)
    while engine.has_unfinished_requests():
        n_tok, n_s, n_p = len(probe.tokens), len(probe.sample), len(probe.propose)
        n_stash = len(STASHES)
        start, cpu = time.perf_counter(), time.process_time()
        outs = engine.step()
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
        for o in outs:
            if o.outputs:
                out_tokens[o.request_id.split("-")[-1]].extend(o.outputs[0].token_ids)
        if len(probe.tokens) == n_tok + 1 and len(probe.sample) == n_s + 1:
            records.append({"engine": name, "round": rnd, "batch": len(prompts),
                            "tokens": probe.tokens[-1], "step": cpu, "wall": seconds,
                            "sample": probe.sample[-1],
                            "stash": sum(STASHES[n_stash:]),
                            "propose": probe.propose[-1] if len(probe.propose) > n_p
                            else 0.0})
    return [out_tokens[str(i)] for i in range(len(prompts))]


def quantiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


PARTS = ("step", "sample", "stash", "propose", "wall")


def summarize(records: list[dict], batch: int, names=tuple(ENGINES),
              base: str = "ngram") -> dict:
    """At the batch's most common token count among all engines: per engine
    the quartiles (ms) of each of PARTS; per round, each engine's median
    step less ``base``'s."""
    mine = [r for r in records if r["batch"] == batch]
    counts = None
    for name in names:
        c = Counter(r["tokens"] for r in mine if r["engine"] == name)
        counts = c if counts is None else counts & c
    if not counts:
        return {"batch": batch, "tokens": None}
    tokens = counts.most_common(1)[0][0]
    at = [r for r in mine if r["tokens"] == tokens]
    out = {"batch": batch, "tokens": tokens, "engines": {}, "round_diffs_ms": {}}
    for name in names:
        rs = [r for r in at if r["engine"] == name]
        out["engines"][name] = {"steps": len(rs), **{part: [1e3 * v for v in quantiles(
            [r[part] for r in rs])] for part in PARTS}}
    for name in names:
        if name == base:
            continue
        diffs = []
        for rnd in sorted({r["round"] for r in at}):
            mine_ = [r["step"] for r in at if r["round"] == rnd and r["engine"] == name]
            theirs = [r["step"] for r in at if r["round"] == rnd and r["engine"] == base]
            if mine_ and theirs:
                diffs.append(1e3 * (statistics.median(mine_) - statistics.median(theirs)))
        out["round_diffs_ms"][name] = diffs
    return out


def print_table(summaries: list[dict], base: str = "ngram") -> None:
    print("| batch | tokens/step | engine | steps | CPU ms a step (p25 / median / p75) "
          "| _sample | of which top-k stash | propose | wall ms (median) |")
    print("|---:|---:|---|---:|---|---:|---:|---:|---:|")
    for s in summaries:
        if s["tokens"] is None:
            print(f"| {s['batch']} | no common token count ||||||||")
            continue
        for name, e in s["engines"].items():
            lo, med, hi = e["step"]
            print(f"| {s['batch']} | {s['tokens']} | {name} | {e['steps']} | "
                  f"{lo:.1f} / {med:.1f} / {hi:.1f} | {e['sample'][1]:.2f} | "
                  f"{e['stash'][1]:.2f} | {e['propose'][1]:.2f} | {e['wall'][1]:.1f} |")
    print()
    for s in summaries:
        if s["tokens"] is None:
            continue
        ref = s["engines"][base]["step"][1]
        for name, d in s["round_diffs_ms"].items():
            added = s["engines"][name]["step"][1] - ref
            spread = (f"per round {statistics.median(d):+.2f} ms (range {min(d):+.2f} .. "
                      f"{max(d):+.2f}, {len(d)} rounds)" if d else "no round has both")
            print(f"batch {s['batch']}: {name} adds {added:+.2f} CPU ms a step to "
                  f"{base}'s ({100 * added / ref:+.1f}%); {spread}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench vocab-cost",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=262144)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--rounds", type=int, default=8, help="batches per engine and size")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--drafts", type=int, default=6, help="num_speculative_tokens")
    p.add_argument("--model-dir", default=None,
                   help="where the tiny model is written (default: a temporary folder)")
    p.add_argument("--out", default=None, help="a JSON file for the records")
    args = p.parse_args(argv)
    try:
        args.batch_sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--batch-sizes wants a comma list of integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes wants positive integers")
    if args.rounds < 1 or args.drafts < 1 or args.vocab < 2:
        p.error("--rounds, --drafts must be positive and --vocab at least 2")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm_plugins.bench.engines import numba_threads_as_the_engines, quiet_vllm

    numba_threads_as_the_engines()
    quiet_vllm()
    import numpy as np
    from vllm import SamplingParams

    model_dir = args.model_dir or tempfile.mkdtemp(prefix="vocab_cost_")
    model = tiny_vocab_llama(model_dir, args.vocab)
    time_stashes()
    largest = max(args.batch_sizes)
    engines, probes = {}, {}
    for name, spec in ENGINES.items():
        engines[name] = build(model, spec, args.drafts, largest)
        probes[name] = Probe(engines[name])
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True,
                            detokenize=False)
    rng = np.random.default_rng(0)
    records: list[dict] = []
    mismatches = 0
    for batch in args.batch_sizes:
        for rnd in range(-1, args.rounds):  # round -1: warm-up, not recorded
            prompts = [[int(t)] * 24 for t in rng.integers(0, args.vocab, batch)]
            order = list(ENGINES) if rnd % 2 == 0 else list(ENGINES)[::-1]
            outs = {}
            for name in order:
                sink = records if rnd >= 0 else []
                outs[name] = run_round(engines[name], probes[name], prompts, params,
                                       sink, name, rnd)
            mismatches += sum(a != b for a, b in zip(*outs.values()))
    summaries = [summarize(records, b) for b in args.batch_sizes]
    import torch

    print(f"vocab {args.vocab}, {args.drafts} drafts, {args.rounds} rounds of "
          f"{args.max_tokens} tokens, torch threads {torch.get_num_threads()}; "
          f"outputs differing between engines: {mismatches}\n")
    print_table(summaries)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "summaries": summaries, "records": records,
                       "mismatches": mismatches}, f, indent=1)
    return 0
