"""Time to first token of a plain request submitted while a large schema compiles.

A grammar request's matcher must be compiled before its first token; where
that happens on the engine loop, every running request and every request
that arrives behind it waits. This drives one engine step by step:

1. warm-up: a small grammar request and a plain one (the llguidance
   tokenizer and the first paths are built);
2. a plain request R runs (the engine is busy decoding);
3. a grammar request G with a large, never-seen schema is added, then at
   once a plain request P;
4. recorded: P's time to first token (from its own add_request), R's longest
   gap between tokens while G waits or compiles, G's time to first token.

Run: ``python -m vllm_plugins.bench grammar-compile-ttft`` (one engine start;
the default model, CPU). ``tests/test_grammar_compile_e2e.py`` runs
:func:`measure` and checks the result.
"""

from __future__ import annotations

import argparse
import json
import time


def large_schema(alternatives: int = 600, keys: int = 10, salt: str = "") -> dict:
    """An array of objects that are each one of ``alternatives`` closed shapes:
    llguidance's compile time grows with the number of alternatives (the
    lexer's initial configuration stays under its size limit up to about a
    thousand). ``salt`` makes a schema no cache has seen."""
    shapes = [{
        "type": "object",
        "properties": {f"{salt}k{i}_{j}": {"type": ["string", "integer", "boolean"]}
                       for j in range(keys)},
        "required": [f"{salt}k{i}_{j}" for j in range(keys)],
        "additionalProperties": False,
    } for i in range(alternatives)]
    return {"type": "object", "properties": {"items": {"type": "array",
                                                       "items": {"anyOf": shapes}}}}


def measure(llm, *, alternatives: int = 600, salt: str | None = None,
            running_tokens: int = 200) -> dict:
    """Seconds: ``ttft_plain`` (P), ``ttft_grammar`` (G), ``max_gap_running``
    (R's longest wait between two tokens from P's submission, right after
    G's, until G and P are done), ``frontend_add`` (G's add_request),
    ``typical_gap_running`` (R's median gap before G), ``frontend_validate``
    (G's validation in this, the front end's, process: done before the timed
    part, so that what is timed is the engine's work)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_plugins.grammar.spec import compile_grammar_request

    engine = llm.llm_engine
    delta = RequestOutputKind.DELTA
    plain = SamplingParams(max_tokens=4, temperature=0, output_kind=delta)
    tag = salt if salt is not None else f"s{time.monotonic_ns()}_"

    def drain(ids):
        left = set(ids)
        while left:
            for out in engine.step():
                if out.finished:
                    left.discard(out.request_id)

    engine.add_request(f"{tag}warm-g", "Say yes:", SamplingParams(
        max_tokens=3, temperature=0, output_kind=delta,
        extra_args={"grammar": {"regex": "(yes|no)"}}))
    engine.add_request(f"{tag}warm-p", "Hello", plain)
    drain([f"{tag}warm-g", f"{tag}warm-p"])

    rid, gid, pid = f"{tag}R", f"{tag}G", f"{tag}P"
    engine.add_request(rid, "Count from one to one hundred: one, two,", SamplingParams(
        max_tokens=running_tokens, min_tokens=running_tokens, temperature=0,
        output_kind=delta))
    r_times: list[float] = []
    while len(r_times) < 6:
        for out in engine.step():
            if out.request_id == rid and out.outputs and out.outputs[0].token_ids:
                r_times.append(time.perf_counter())
    before = sorted(b - a for a, b in zip(r_times, r_times[1:]))
    schema = large_schema(alternatives, salt=tag)
    g_params = SamplingParams(max_tokens=4, temperature=0, output_kind=delta,
                              extra_args={"grammar": {"json_schema": schema}})
    # Validated here first: the front end's own compile (this process) is
    # cached, so what is timed below is the engine's, not this thread's.
    t0 = time.perf_counter()
    compile_grammar_request(g_params.extra_args["grammar"])
    frontend = time.perf_counter() - t0
    t_g = time.perf_counter()
    engine.add_request(gid, "Write JSON:", g_params)
    t_p = time.perf_counter()
    engine.add_request(pid, "The capital of France is", plain)
    first: dict[str, float] = {}
    gaps_after: list[float] = []
    # From P's submission on: before it, this thread was busy submitting G
    # (the front end copies and sends its 0.6 MB spec) and R's tokens only
    # queued up; the engine cannot compile G before it has it.
    last_r = t_p
    finished: set[str] = set()
    while not {gid, pid} <= finished:
        for out in engine.step():
            now = time.perf_counter()
            got = bool(out.outputs and out.outputs[0].token_ids)
            if got and out.request_id not in first:
                first[out.request_id] = now
            if out.request_id == rid and got:
                gaps_after.append(now - last_r)
                last_r = now
            if out.finished:
                finished.add(out.request_id)
                if out.request_id in (gid, pid) and out.request_id not in first:
                    first[out.request_id] = now
    engine.abort_request([rid])
    return {
        "ttft_plain": first[pid] - t_p,
        "ttft_grammar": first[gid] - t_g,
        "max_gap_running": max(gaps_after) if gaps_after else float("nan"),
        "typical_gap_running": before[len(before) // 2],
        "frontend_validate": frontend,
        "frontend_add": t_p - t_g,
        "schema_bytes": len(json.dumps(schema)),
    }


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m vllm_plugins.bench grammar-compile-ttft",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the package's default model")
    ap.add_argument("--alternatives", type=int, default=600)
    ap.add_argument("--repeat", type=int, default=3)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from vllm_plugins.bench.engines import build_engine, quiet_vllm
    from vllm_plugins.default_model import default_model_path

    quiet_vllm()
    llm = build_engine(args.model or default_model_path(), None, max_num_seqs=8,
                       max_model_len=1024)
    for i in range(args.repeat):
        res = measure(llm, alternatives=args.alternatives)
        print(json.dumps({k: round(v, 3) for k, v in res.items()}), flush=True)
    return 0
