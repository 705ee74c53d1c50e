"""End to end: one vllm.LLM (default model, CPU) with GrammarLogitsProcessor.

Slow (an engine start is ~30-60 s on the 2-core CI box, plus a second engine
in a subprocess for the no-processor reference): ``pytest -m slow``.
"""

from __future__ import annotations

import gc
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import pytest

from vllm_plugins.bench.data import shared_data

pytestmark = pytest.mark.slow

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("vllm")

FQCN = "vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor"
ENGINE_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # collective_rpc with a Python callable (used to look inside the worker)
    "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",
}
ENGINE_KW = dict(
    enforce_eager=True, dtype="float32", max_model_len=1024, gpu_memory_utilization=0.1, seed=0
)
# Ten dev schemas (both splits; flat and nested objects, enums, arrays, format
# "date", required lists) whose greedy output from the default model finishes
# well inside MAX_TOKENS: they were picked from a 40-schema sweep in which
# 23/40 finished within 400 tokens and all 23 validated.
# A truncated output still counts as a failure here.
E2E_SCHEMAS = [
    "calculate_area_eda9f9ab.json",
    "o58909.json",
    "o50970.json",
    "calculate_area_092db49e.json",
    "calculate_area_90872462.json",
    "o58906.json",
    "calculate_area_22566a70.json",
    "calculate_area_092f0b0f.json",
    "book_flight_e9f45f3c.json",
    "search_news_64606f82.json",
]
MAX_TOKENS = 400
PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:",
    "Once upon a time",
]
PLAIN_MAX_TOKENS = 32


def _chat_prompt(tokenizer, schema) -> str:
    msg = [{
        "role": "user",
        "content": "Write a JSON object that follows this JSON schema:\n"
        + json.dumps(schema)
        + "\nReply with the JSON only.",
    }]
    return tokenizer.apply_chat_template(msg, add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def llm(model_path):
    with pytest.MonkeyPatch.context() as mp:
        for k, v in ENGINE_ENV.items():
            mp.setenv(k, v)
        from vllm import LLM

        engine = LLM(model=model_path, logits_processors=[FQCN], **ENGINE_KW)
        yield engine
        del engine
        gc.collect()


def _greedy(max_tokens, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_engine_runs_exactly_one_active_grammar_processor(llm):
    # Runs inside the worker (a lambda: cloudpickle sends it by value).
    (procs,) = llm.collective_rpc(
        lambda w: [(type(p).__name__, bool(getattr(p, "_idle", False)))
                   for p in w.model_runner.input_batch.logitsprocs.all]
    )
    ours = [idle for name, idle in procs if name == "GrammarLogitsProcessor"]
    # entry point + logits_processors=[...]: two instances, one idle
    assert ours.count(False) == 1, procs


def test_json_schemas_from_dev_set_validate(llm):
    rows = {r["name"]: r for r in map(json.loads, open(shared_data("json_schemas_dev.jsonl")))}
    schemas = [rows[name]["schema"] for name in E2E_SCHEMAS]
    tok = llm.get_tokenizer()
    prompts = [_chat_prompt(tok, s) for s in schemas]
    params = [_greedy(MAX_TOKENS, extra_args={"grammar": {"json_schema": s}}) for s in schemas]
    outs = llm.generate(prompts, params, use_tqdm=False)
    failures = []
    for name, schema, out in zip(E2E_SCHEMAS, schemas, outs):
        c = out.outputs[0]
        try:
            assert c.finish_reason == "stop", f"finish_reason={c.finish_reason} after {len(c.token_ids)} tokens"
            jsonschema.validate(json.loads(c.text), schema)
        except Exception as e:  # noqa: BLE001 - collect all, then report
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]}\n  {c.text[:300]!r}")
    print(f"\n{len(schemas) - len(failures)}/{len(schemas)} outputs validate")
    assert not failures, "\n".join(failures)


def test_regex_lark_and_json_object(llm):
    tok = llm.get_tokenizer()
    chat = lambda q: tok.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )
    cases = [
        (chat("What is the phone number of the office?"), {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
        (chat("Is the sky blue? Answer yes or no."), {"lark": 'start: "yes" | "no"'}),
        (chat("Describe a cat as JSON."), {"json_object": True, "whitespace_flexible": False}),
    ]
    outs = llm.generate(
        [p for p, _ in cases],
        [_greedy(200, extra_args={"grammar": g}) for _, g in cases],
        use_tqdm=False,
    )
    texts = [o.outputs[0].text for o in outs]
    assert all(o.outputs[0].finish_reason == "stop" for o in outs), texts
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[0]), texts[0]
    assert texts[1] in ("yes", "no"), texts[1]
    assert isinstance(json.loads(texts[2]), dict), texts[2]


def test_bad_schema_fails_its_request_only(llm):
    from vllm.exceptions import VLLMValidationError

    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    good = _greedy(24, extra_args={"grammar": {"regex": "[a-z]{3,8}"}})
    bad = _greedy(24, extra_args={"grammar": {"json_schema": {"type": "frobnicate"}}})
    engine.add_request("good-1", {"prompt": _chat_prompt(tok, {"type": "string"})}, good)
    with pytest.raises(VLLMValidationError, match=r'extra_args\["grammar"\]\["json_schema"\].*frobnicate'):
        engine.add_request("bad-1", {"prompt": "x"}, bad)
    two_keys = _greedy(8, extra_args={"grammar": {"regex": "a", "lark": "start: 'a'"}})
    with pytest.raises(VLLMValidationError, match="exactly one of the keys"):
        engine.add_request("bad-2", {"prompt": "x"}, two_keys)
    finished = {}
    # By time, not by steps: the good request waits for its grammar to
    # compile off the engine loop, and a step with nothing scheduled is so
    # quick that a step count bounds nothing.
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"good-1"}
    text = finished["good-1"].outputs[0].text
    assert re.fullmatch("[a-z]{3,8}", text), text
    # and the offline API keeps working afterwards
    out = llm.generate(["Say hi"], [_greedy(8)], use_tqdm=False)
    assert out[0].outputs[0].token_ids


_REFERENCE = textwrap.dedent(
    """
    import json, os, sys
    def main():
        import vllm.v1.sample.logits_processor as lp
        lp._load_logitsprocs_plugins = lambda: []  # no entry-point processors at all
        from vllm import LLM, SamplingParams
        args = json.loads(sys.argv[1])
        llm = LLM(model=args["model"], **args["engine"])
        procs = llm.collective_rpc(
            lambda w: [type(p).__name__ for p in w.model_runner.input_batch.logitsprocs.all])
        sp = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"])
        outs = llm.generate(args["prompts"], sp, use_tqdm=False)
        print("RESULT " + json.dumps({"procs": procs[0],
                                      "ids": [list(o.outputs[0].token_ids) for o in outs]}))
    if __name__ == "__main__":
        main()
    """
)


def test_plain_requests_identical_to_engine_without_processor(llm, model_path, tmp_path):
    from vllm import SamplingParams

    sp = _greedy(PLAIN_MAX_TOKENS)
    alone = [list(o.outputs[0].token_ids) for o in llm.generate(PLAIN_PROMPTS, sp, use_tqdm=False)]
    # The same plain prompts batched together with grammar requests.
    grammar_sp = SamplingParams(
        temperature=0.0, max_tokens=PLAIN_MAX_TOKENS, extra_args={"grammar": {"json_object": True}}
    )
    mixed_outs = llm.generate(
        PLAIN_PROMPTS + ["Describe a dog as JSON:"] * 2,
        [sp] * len(PLAIN_PROMPTS) + [grammar_sp] * 2,
        use_tqdm=False,
    )
    mixed = [list(o.outputs[0].token_ids) for o in mixed_outs[: len(PLAIN_PROMPTS)]]

    script = tmp_path / "reference.py"
    script.write_text(_REFERENCE)
    env = dict(os.environ, **ENGINE_ENV, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    args = {"model": model_path, "engine": ENGINE_KW, "prompts": PLAIN_PROMPTS,
            "max_tokens": PLAIN_MAX_TOKENS}
    proc = subprocess.run(
        [sys.executable, str(script), json.dumps(args)],
        env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    ref = json.loads(lines[-1][len("RESULT "):])
    assert "GrammarLogitsProcessor" not in ref["procs"], ref["procs"]
    assert alone == ref["ids"]
    assert mixed == ref["ids"]
