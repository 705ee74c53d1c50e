"""Data parallel on the OpenAI server, and our counters on its /metrics.

One server with ``--data-parallel-size 2`` (two engine cores, one core each)
drafts with ``token_recycling`` on a tiny random Llama that mostly repeats
itself (drafts are accepted in runs). Requests go to each rank by vLLM's
``X-data-parallel-rank`` header: greedy output is vLLM's plain decoding on
both, per-request options work on both, an abort and a bad request on one
rank leave both serving, and each rank's ``vllm_plugins:`` counters move on
``/metrics`` with vLLM's labels. Slow: one plain in-process engine (the
reference, shut down before the server starts) and one server start.
"""

from __future__ import annotations

import json

import pytest

from tests.serving import post, running_server, scrape, stream_and_leave

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

PROMPTS = ["Monday: eggs. Tuesday: toast. Monday: eggs. Tuesday:",
           "one two three one two three one two",
           "The cat sat on the mat. The cat sat on the"]
MAX_TOKENS = 24
# The random model is rarely sure: min_confidence 0 lets Token Recycling
# draft at every step.
SPEC = {"method": "token_recycling", "num_speculative_tokens": 4, "draft_length": "fixed",
        "min_confidence": 0.0}
RANKS = ("0", "1")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", tie_word_embeddings=True,
                      initializer_range=0.05)


@pytest.fixture(scope="module")
def plain(tiny):
    """vLLM's own greedy tokens per prompt, from a plain in-process engine."""
    from vllm import SamplingParams

    from tests.conftest import shutdown
    from vllm_plugins.bench.engines import build_engine

    llm = build_engine(tiny, None, max_num_seqs=4, max_model_len=1024, kv_cache_mib=64)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        shutdown(llm)


@pytest.fixture(scope="module")
def server(tiny, plain, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    extra = ["--speculative-config", json.dumps(SPEC), "--data-parallel-size", "2",
             "--api-server-count", "1"]
    # Two engine cores start one after the other's neighbour on a 2-core
    # host that the suite's other worker shares: more time than one engine.
    with running_server(tiny, extra, log, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                        start_seconds=1200) as base:
        yield base, tiny


def complete(server, prompt, rank, **body):
    base, model = server
    return post(base + "/v1/completions",
                {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                 "temperature": 0, "return_token_ids": True, **body},
                headers={"X-data-parallel-rank": rank})


def ours(base):
    return scrape(base, "vllm_plugins:")


def series(samples, name, engine):
    return sum(v for (n, labels), v in samples.items()
               if n == name and dict(labels).get("engine") == engine)


def test_every_rank_decodes_as_plain_decoding_and_its_counters_move(server, plain):
    from vllm_plugins.bridge.counters import METRICS

    base, model = server
    before = ours(base)
    # Every unlabelled counter is exposed per engine with vLLM's labels
    # before any traffic.
    for metric in METRICS:
        if metric.label is None:
            for rank in RANKS:
                key = (f"vllm_plugins:{metric.name}_total",
                       (("engine", rank), ("model_name", model)))
                assert key in before, key
    for rank in RANKS:
        for prompt, want in zip(PROMPTS, plain):
            status, body = complete(server, prompt, rank)
            assert status == 200, body
            assert body["choices"][0]["token_ids"] == want, (rank, prompt)
        # Per-request options reach the rank that serves the request.
        status, body = complete(server, PROMPTS[0], rank,
                                vllm_xargs={"speculation": json.dumps({"max_draft": 1})})
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == plain[0], rank
    after = ours(base)
    drafted = scrape(base, "vllm:spec_decode_num_draft_tokens")
    for rank in RANKS:
        steps = "vllm_plugins:steps_total"
        assert series(after, steps, rank) > series(before, steps, rank), (rank, after)
        # vLLM's own speculative counters saw this rank draft too.
        assert series(drafted, "vllm:spec_decode_num_draft_tokens_total", rank) > 0
    assert series(after, "vllm_plugins:proposer_errors_total", "0") == 0
    assert series(after, "vllm_plugins:malformed_drafts_total", "0") == 0


def test_an_abort_and_a_bad_request_on_one_rank_leave_both_serving(server, plain):
    base, model = server
    # A streamed request on rank 0 whose client leaves after two chunks:
    # vLLM aborts it on that rank.
    stream_and_leave(base, {"model": model, "prompt": PROMPTS[1], "max_tokens": 600,
                            "temperature": 0, "ignore_eos": True},
                     headers={"X-data-parallel-rank": "0"})
    # A bad per-request option on rank 0: HTTP 400 that names it.
    status, body = complete(server, PROMPTS[0], "0",
                            vllm_xargs={"speculation": json.dumps({"max_draft": -1})})
    assert status == 400, body
    assert "max_draft" in json.dumps(body), body
    for rank in ("1", "0"):
        status, body = complete(server, PROMPTS[2], rank)
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == plain[2], rank
