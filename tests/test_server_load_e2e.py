"""An OpenAI server with Token Recycling under load: exact, refusing, alive, flat.

A deployment's server sees many streams at once, clients that hang up
mid-stream, and requests that are malformed or merely unusual. None of that
may change another request's greedy tokens, stall the server, or grow the
engine's memory. Each parallel size (1, and tensor parallel 2 on a tiny
random Llama with even head counts) starts a plain server for the reference
answers, stops it, then starts the speculating one: one engine at a time on
two cores.

Three rounds of 64 concurrent greedy streams, every fourth one dropped by
the client after a few chunks; between rounds, bad requests (each must be a
4xx; a refused stream is vLLM's one error event, see ``refusal_code``) and
unusual ones (logprobs, penalties, stop strings, structured outputs, a
prompt at the context edge: each must equal the plain server's answer;
n > 1, which vLLM takes only sampled: answered in full). After: /health, a
normal answer, no request left in the engine, no proposer error, under
tensor parallel the ranks' per-step digests equal, and our state in each
worker holding as much after round 3 as after round 2
(``vllm_plugins_live_state``: request-keyed entries and instances of our
classes, counted on an idle engine, so a leak of one object per request
shows and nothing else moves them). The server tree's RSS is printed, not
checked: it creeps in plain servers too (the allocator, vLLM's own caches).
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pytest

from tests.serving import running_server

pytestmark = pytest.mark.slow
httpx = pytest.importorskip("httpx")
psutil = pytest.importorskip("psutil")

MAX_MODEL_LEN = 1024  # tests.serving.running_server's --max-model-len
MAX_TOKENS = 32
STREAMS = 64
ROUNDS = 3
DROP_EVERY = 4  # a quarter of each round's streams is dropped by the client
DROP_AFTER_CHUNKS = 2
REQUEST_TIMEOUT = 120.0  # seconds; a request slower than this is a hang
SPEC = {"method": "token_recycling", "num_speculative_tokens": 4,
        # The random model's distributions are flat: Token Recycling drafts
        # at every step only without its confidence floor.
        "min_confidence": 0.0}
WORDS = ("the quick brown fox jumps over a lazy dog and then one two three "
         "four five six seven alpha beta gamma delta red green blue def return "
         "class import while for if else").split()
PROMPTS = [" ".join(random.Random(i).choice(WORDS) for _ in range(4 + i % 13))
           for i in range(STREAMS)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    # As tests/test_tensor_parallel_e2e.py: heads split across two ranks, and
    # tied small weights repeat tokens in runs, so drafts are accepted.
    return tiny_llama(tmp_path_factory.mktemp("load") / "tiny", num_layers=4,
                      hidden_size=128, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, initializer_range=0.05,
                      tie_word_embeddings=True)


def server_args(tp: int, spec: dict | None) -> list[str]:
    args = ["--tensor-parallel-size", str(tp), "--max-num-seqs", str(STREAMS),
            "--seed", "0"]
    if tp > 1:
        args += ["--distributed-executor-backend", "mp"]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec)]
    return args


def server_env(tp: int) -> dict[str, str]:
    return {
        # One core per rank; a single rank keeps core 0 for the HTTP front end.
        "VLLM_CPU_OMP_THREADS_BIND": "0|1" if tp > 1 else "1",
        # Opens /collective_rpc (loopback only here), through which the test
        # reads the proposer's counters and the ranks' digests.
        "VLLM_SERVER_DEV_MODE": "1",
        # glibc's malloc (vLLM's CPU build preloads no tcmalloc here) keeps
        # freed blocks up to a threshold it raises as it goes, and the RSS
        # then depends on the last steps' batch shapes. A fixed threshold
        # hands every block over 128 KiB back at once: RSS follows what is
        # live, which is what a leak grows.
        "MALLOC_MMAP_THRESHOLD_": str(128 * 1024),
        "MALLOC_TRIM_THRESHOLD_": str(128 * 1024),
    }


# ---------------------------------------------------------------- requests

def completion(prompt, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, **extra}


def edge_prompt(length: int) -> list[int]:
    """Token ids of a prompt exactly ``length`` long (ids of plain words)."""
    rng = random.Random(length)
    return [rng.randrange(1000, 20000) for _ in range(length)]


def unusual_requests(stop: str) -> dict[str, dict]:
    """Greedy requests a server must answer as the plain server does."""
    return {
        "logprobs": completion(PROMPTS[2], logprobs=3),
        "penalties": completion(PROMPTS[3], presence_penalty=0.8,
                                frequency_penalty=0.6, repetition_penalty=1.3),
        "stop-string": completion(PROMPTS[4], stop=[stop]),
        "choice": completion(PROMPTS[5], structured_outputs={
            "choice": ["alpha beta", "gamma", "delta epsilon zeta"]}),
        "regex": completion(PROMPTS[6], structured_outputs={"regex": "[a-z]{3,12}"}),
        "context-edge": completion(edge_prompt(MAX_MODEL_LEN - 8), max_tokens=8),
    }


def sampled_requests() -> dict[str, dict]:
    """Requests whose tokens a speculating server draws differently from the
    plain one (vLLM refuses n > 1 under greedy decoding): each must be
    answered, in full, with its n choices."""
    return {"n=3-sampled": completion(PROMPTS[1], n=3, temperature=1.0, seed=3)}


def well_formed(body: dict, n: int) -> bool:
    choices = answer(body)
    return len(choices) == n and all(
        c["tokens"] and c["finish"] in ("length", "stop") for c in choices)


def bad_requests(edge_max_tokens_ok: bool) -> dict[str, dict]:
    """Requests a server must refuse with a 4xx, before they reach the engine."""
    bad_type = {"type": "frobnicate"}
    out = {
        "grammar-bad-schema": completion(PROMPTS[7], vllm_xargs={
            "grammar": json.dumps({"json_schema": bad_type})}),
        "grammar-not-json": completion(PROMPTS[7], vllm_xargs={"grammar": "{not json"}),
        "grammar-streamed": completion(PROMPTS[7], stream=True, vllm_xargs={
            "grammar": json.dumps({"regexp": "a"})}),
        "structured-bad-schema": completion(PROMPTS[8], structured_outputs={
            "json": bad_type}),
        "structured-schema-not-json": completion(PROMPTS[8], structured_outputs={
            "json": "{not json"}),
        "structured-streamed": completion(PROMPTS[8], stream=True, structured_outputs={
            "json": bad_type}),
        "structured-bad-regex": completion(PROMPTS[8], structured_outputs={
            "regex": "(unclosed"}),
        "over-context": completion(edge_prompt(MAX_MODEL_LEN + 1), max_tokens=1),
        "token-out-of-vocab": completion([10**7], max_tokens=1),
        "negative-max-tokens": completion(PROMPTS[9], max_tokens=-1),
        "n=0": completion(PROMPTS[9], n=0),
        "n=2-greedy": completion(PROMPTS[9], n=2),
        "negative-temperature": completion(PROMPTS[9], temperature=-1.0),
    }
    if not edge_max_tokens_ok:
        out["context-edge-too-long-answer"] = completion(
            edge_prompt(MAX_MODEL_LEN - 8), max_tokens=MAX_TOKENS)
    return out


async def post(client, base: str, body: dict) -> tuple[int, dict]:
    r = await client.post(base + "/v1/completions", json=body)
    if body.get("stream"):
        return r.status_code, {"events": [json.loads(line[len("data: "):])
                                          for line in r.text.splitlines()
                                          if line.startswith("data: {")]}
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"text": r.text}


def refusal_code(status: int, body: dict) -> int:
    """The HTTP status, or for a stream vLLM has opened before its input
    processor refused the request (vLLM's own structured outputs as well as
    our grammar), the code of the stream's one event, an error."""
    events = body.get("events")
    if status == 200 and events and len(events) == 1 and "error" in events[0]:
        return int(events[0]["error"].get("code") or 500)
    return status


def answer(body: dict) -> list[dict]:
    """What must match between servers: tokens, text, finish reason, logprobs."""
    return [{"tokens": c.get("token_ids"), "text": c["text"],
             "finish": c["finish_reason"],
             "logprobs": (c.get("logprobs") or {}).get("token_logprobs")}
            for c in sorted(body["choices"], key=lambda c: c["index"])]


async def stream(client, base: str, model: str, prompt: str, drop: bool) -> dict:
    """One streaming request; a dropped one leaves after DROP_AFTER_CHUNKS
    chunks, which closes its connection mid-stream."""
    body = completion(prompt, model=model, stream=True)
    tokens, finish, chunks = [], None, 0
    async with client.stream("POST", base + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread()).decode()}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return {"status": 200, "tokens": tokens, "finish": finish}
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                return {"status": 200, "error": chunk["error"]}
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
            chunks += 1
            if drop and chunks >= DROP_AFTER_CHUNKS and finish is None:
                return {"status": 200, "dropped": True}
    return {"status": 200, "error": "stream ended without [DONE]"}


async def load_round(base: str, model: str, round_no: int) -> list[dict]:
    limits = httpx.Limits(max_connections=2 * STREAMS)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT, limits=limits) as client:
        jobs = [stream(client, base, model, p, (i + round_no) % DROP_EVERY == 0)
                for i, p in enumerate(PROMPTS)]
        return await asyncio.wait_for(asyncio.gather(*jobs), 2 * REQUEST_TIMEOUT)


async def send_all(base: str, model: str, bodies: dict[str, dict]) -> dict:
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as client:
        names = list(bodies)
        got = await asyncio.gather(*(post(client, base, dict(bodies[n], model=model))
                                     for n in names))
    return dict(zip(names, got))


def run(coro):
    return asyncio.run(coro)


# ---------------------------------------------------------------- the server

def server_tree(base: str) -> list:
    """The server process (this process's child serving ``base``) and all of
    its descendants: front end, engine core, workers."""
    port = base.rsplit(":", 1)[1]
    for child in psutil.Process().children():
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "--port" in cmd and cmd[cmd.index("--port") + 1] == port:
            return [child, *child.children(recursive=True)]
    raise AssertionError(f"no server process on port {port}")


def tree_rss(base: str) -> dict[str, int]:
    """RSS in bytes of each process of the server, by process name."""
    out: dict[str, int] = {}
    for p in server_tree(base):
        try:
            name, rss = f"{p.name()}-{p.pid}", p.memory_info().rss
        except psutil.Error:
            continue
        out[name] = rss
    return out


def gauge(metrics: str, name: str) -> float:
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
    assert values, f"{name} not in /metrics"
    return sum(float(v) for v in values)


def wait_idle(base: str, timeout: float = 30.0) -> None:
    """Every request, dropped ones included, has left the engine."""
    deadline = time.time() + timeout
    while True:
        text = httpx.get(base + "/metrics", timeout=10).text
        busy = {n: gauge(text, n) for n in ("vllm:num_requests_running",
                                             "vllm:num_requests_waiting")}
        if not any(busy.values()):
            return
        assert time.time() < deadline, f"requests left in the engine: {busy}"
        time.sleep(0.5)


def live_state(base: str, model: str) -> list[dict]:
    """Each rank's counts of our state (bridge/live_state.py) on an idle
    engine: a short request first delivers the finish notices the last
    round's requests left held (its own stays held, the same every time)."""
    status, _ = run(send_all(base, model, {"probe": completion(PROMPTS[0], max_tokens=2)}))[
        "probe"]
    assert status == 200
    wait_idle(base)
    return rpc(base, "vllm_plugins_live_state")


def rpc(base: str, method: str) -> list:
    r = httpx.post(base + "/collective_rpc", json={"method": method}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["results"]


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_server_under_load(tp, tiny_model, tmp_path):
    timings = {}
    t0 = time.perf_counter()
    with running_server(tiny_model, server_args(tp, None), tmp_path / "plain.log",
                        env=server_env(tp)) as base:
        timings["plain start"] = time.perf_counter() - t0
        got = run(send_all(base, tiny_model,
                           {p: completion(p) for p in PROMPTS}))
        assert all(s == 200 for s, _ in got.values()), got
        reference = {p: answer(b)[0] for p, (_, b) in got.items()}
        text = reference[PROMPTS[4]]["text"]
        stop = text[len(text) // 2: len(text) // 2 + 2]
        unusual = unusual_requests(stop)
        got = run(send_all(base, tiny_model, unusual))
        assert all(s == 200 for s, _ in got.values()), got
        unusual_reference = {n: answer(b) for n, (_, b) in got.items()}
        # The stop string cuts the answer (the check below can fail).
        assert unusual_reference["stop-string"][0]["finish"] == "stop"
        # Whether vLLM takes a prompt at the edge with an answer too long for
        # the context (and shortens it) or refuses it; asked of the plain server.
        edge_long = completion(edge_prompt(MAX_MODEL_LEN - 8), max_tokens=MAX_TOKENS)
        status, body = run(send_all(base, tiny_model, {"e": edge_long}))["e"]
        edge_max_tokens_ok = status == 200
        if edge_max_tokens_ok:
            unusual["context-edge-long-answer"] = edge_long
            unusual_reference["context-edge-long-answer"] = answer(body)
    timings["plain total"] = time.perf_counter() - t0

    t1 = time.perf_counter()
    failures, rss, live = [], [], []
    with running_server(tiny_model, server_args(tp, SPEC), tmp_path / "spec.log",
                        env=server_env(tp)) as base:
        timings["speculating start"] = time.perf_counter() - t1
        if tp > 1:
            assert rpc(base, "vllm_plugins_rank_digest") == [[]] * tp
        bad, sampled = bad_requests(edge_max_tokens_ok), sampled_requests()
        for round_no in range(ROUNDS):
            t = time.perf_counter()
            results = run(load_round(base, tiny_model, round_no))
            timings[f"round {round_no + 1}"] = time.perf_counter() - t
            for prompt, res in zip(PROMPTS, results):
                if res.get("dropped"):
                    continue
                want = reference[prompt]
                if "error" in res or res["tokens"] != want["tokens"] \
                        or res["finish"] != want["finish"]:
                    failures.append(f"round {round_no + 1} {prompt!r}: {res} != {want}")
            assert sum(bool(r.get("dropped")) for r in results) == STREAMS // DROP_EVERY
            wait_idle(base)
            rss.append(tree_rss(base))
            live.append(live_state(base, tiny_model))
            if round_no == ROUNDS - 1:
                break
            t = time.perf_counter()
            for name, (status, body) in run(send_all(base, tiny_model, bad)).items():
                if not 400 <= refusal_code(status, body) < 500:
                    failures.append(f"bad request {name}: HTTP {status} {body}")
            for name, (status, body) in run(send_all(base, tiny_model, unusual)).items():
                if status != 200 or answer(body) != unusual_reference[name]:
                    failures.append(f"unusual request {name}: HTTP {status} "
                                    f"{body} != {unusual_reference[name]}")
            for name, (status, body) in run(send_all(base, tiny_model, sampled)).items():
                if status != 200 or not well_formed(body, sampled[name]["n"]):
                    failures.append(f"sampled request {name}: HTTP {status} {body}")
            timings[f"between {round_no + 1}"] = time.perf_counter() - t
            wait_idle(base)

        assert httpx.get(base + "/health", timeout=10).status_code == 200
        status, body = run(send_all(base, tiny_model, {"h": completion(PROMPTS[0])}))["h"]
        assert status == 200 and answer(body)[0] == reference[PROMPTS[0]], body
        stats = rpc(base, "vllm_plugins_stats")
        digests = rpc(base, "vllm_plugins_rank_digest") if tp > 1 else None
    timings["speculating total"] = time.perf_counter() - t1

    mib = [{k: round(v / 2**20, 1) for k, v in r.items()} for r in rss]
    print(f"\ntp={tp} seconds: { {k: round(v, 1) for k, v in timings.items()} }")
    print(f"tp={tp} server tree RSS after each round (MiB): {mib}")
    print(f"tp={tp} proposer stats: {stats[0]}")
    print(f"tp={tp} our state after each round, per rank: {live}")
    assert not failures, "\n".join(failures[:20])
    for rank_stats in stats:
        assert rank_stats["proposer"]["num_errors"] == 0, rank_stats
    assert stats[0]["drafted"] > 0 and stats[0]["accepted"] > 0, stats[0]
    if digests is not None:
        assert len(digests[0]) > MAX_TOKENS and digests[0] == digests[1]
    for rank, (after2, after3) in enumerate(zip(live[1], live[2])):
        for key in ("request_keyed", "objects"):
            assert after3[key] == after2[key], (
                f"rank {rank}: our state's {key} grew from {after2[key]} after round 2 "
                f"to {after3[key]} after round 3 (each round: {live})")
