"""Token Recycling on Model Runner V2 through a real OpenAI server.

Every process of the server (API server, engine core, worker) starts with
``tests/v2_site`` on ``PYTHONPATH``, whose ``sitecustomize`` puts Triton's
stand-in CPU backend in place before vLLM is imported
(``vllm_plugins.v2_on_cpu``): the worker then runs V2, its kernels in
Triton's interpreter. ``VLLM_USE_V2_MODEL_RUNNER=1`` makes a server that
could not run V2 refuse to start, so none passes on V1. A KV cache smaller than the four concurrent requests
need makes the scheduler preempt. The reference is a plain V2 server on the
same tiny model, started first and stopped before the drafting one. Then
tensor parallel 2 on V2, against plain V2 at the same size. Slow: four
server starts, short outputs.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from tests.serving import post, running_server, scrape, stream_and_leave

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

SITE = Path(__file__).resolve().parent / "v2_site"
PROMPTS = [[1, 2, 3, 4, 5, 6] * 4, [100, 200, 300], [7, 7, 7, 7, 7, 7, 7],
           [4000, 41, 4000, 41, 4000, 41, 4000]]
MAX_TOKENS = 100
# 2 KiB of KV a token (4 layers, 2 KV heads of 32 float32 values, K and V):
# 384 tokens, the least vLLM takes at max_model_len 256 being 256, while the
# four requests need about 470.
KV_BYTES = 768 * 2**10
SERVER_ARGS = ["--max-model-len", "256", "--block-size", "32", "--max-num-seqs", "4",
               "--kv-cache-memory-bytes", str(KV_BYTES), "--seed", "0"]
# The random model is rarely sure: min_confidence 0 lets Token Recycling
# draft at every step.
SPEC = {"method": "token_recycling", "num_speculative_tokens": 3, "draft_length": "fixed",
        "min_confidence": 0.0}


def v2_env() -> dict[str, str | None]:
    path = os.pathsep.join(p for p in (str(SITE), os.environ.get("PYTHONPATH")) if p)
    # kv_cache_memory_bytes decides (vLLM's CPU platform lets
    # VLLM_CPU_KVCACHE_SPACE replace it).
    return {"PYTHONPATH": path, "VLLM_CPU_KVCACHE_SPACE": None, "VLLM_USE_V2_MODEL_RUNNER": "1"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", num_layers=4,
                      hidden_size=128, num_heads=4, num_kv_heads=2, intermediate_size=256,
                      initializer_range=0.05, tie_word_embeddings=True)


def complete(base, model, prompt, **body):
    return post(base + "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                 "temperature": 0, "return_token_ids": True, **body})


def all_at_once(base, model) -> list[list[int]]:
    """The prompts' greedy tokens, the four requests in flight together."""
    out: list = [None] * len(PROMPTS)

    def one(i):
        status, body = complete(base, model, PROMPTS[i])
        out[i] = body["choices"][0]["token_ids"] if status == 200 else (status, body)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def counter(base, name) -> float:
    return sum(v for (n, _), v in scrape(base, name).items() if n == name)


@pytest.fixture(scope="module")
def plain(tiny, tmp_path_factory):
    log = tmp_path_factory.mktemp("plain") / "server.log"
    with running_server(tiny, SERVER_ARGS, log, env=v2_env()) as base:
        return all_at_once(base, tiny)


@pytest.fixture(scope="module")
def server(tiny, plain, tmp_path_factory):
    log = tmp_path_factory.mktemp("v2") / "server.log"
    with running_server(tiny, SERVER_ARGS + ["--speculative-config", json.dumps(SPEC)],
                        log, env=v2_env()) as base:
        yield base, tiny


def test_preempted_requests_on_v2_decode_as_plain_v2(server, plain):
    base, model = server
    got = all_at_once(base, model)
    assert got == plain
    assert counter(base, "vllm:num_preemptions_total") > 0, "no preemption: no teeth"
    assert counter(base, "vllm:spec_decode_num_accepted_tokens_total") > 0
    assert counter(base, "vllm_plugins:malformed_drafts_total") == 0


def test_an_abort_and_a_bad_request_on_v2_leave_the_server_serving(server, plain):
    base, model = server
    # A streamed request whose client leaves after two chunks: vLLM aborts it.
    stream_and_leave(base, {"model": model, "prompt": PROMPTS[1], "max_tokens": 150,
                            "temperature": 0, "ignore_eos": True})
    # A bad per-request option: HTTP 400 naming it, that request alone.
    status, body = complete(base, model, PROMPTS[0],
                            vllm_xargs={"speculation": json.dumps({"max_draftx": 1})})
    assert status == 400, body
    assert "max_draftx" in json.dumps(body), body
    status, body = complete(base, model, PROMPTS[2])
    assert status == 200, body
    assert body["choices"][0]["token_ids"] == plain[2]


def test_tensor_parallel_2_on_v2_decodes_as_plain_v2(tiny, tmp_path):
    """Two ranks on V2, one core each; the reference is plain V2 at the same
    size (its sums split across ranks as the drafting server's are)."""
    args = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
            "--max-num-seqs", "4", "--seed", "0"]
    env = {**v2_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    got = {}
    for name, extra in (("plain", []), ("token_recycling",
                                        ["--speculative-config", json.dumps(SPEC)])):
        log = tmp_path / f"{name}.log"
        with running_server(tiny, args + extra, log, env=env, start_seconds=1200) as base:
            got[name] = [complete(base, tiny, p, max_tokens=32)[1]["choices"][0]["token_ids"]
                         for p in PROMPTS]
            if name != "plain":
                accepted = counter(base, "vllm:spec_decode_num_accepted_tokens_total")
    assert got["token_recycling"] == got["plain"]
    assert accepted > 0
