"""The OpenAI-compatible server with the grammar processor from its entry point only.

Slow (one server start, ~1 min here on an idle machine; on a 2-core box
shared with other engines, whose workers vLLM pins to core 0 by default,
``VLLM_CPU_OMP_THREADS_BIND=1`` in the environment avoids a stalled start). Checks what a deployment sees: no
``--logits-processors`` flag, grammar given as JSON text in ``vllm_xargs``,
a bad grammar answered with HTTP 400 naming the problem, and the server still
serving afterwards.
"""

from __future__ import annotations

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

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from importlib.metadata import entry_points

    from vllm_plugins.default_model import default_model_path

    if "grammar" not in {ep.name for ep in entry_points(group="vllm.logits_processors")}:
        pytest.skip("package not installed with its entry points (pip install -e .)")
    model = default_model_path()
    port = _free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
             "--port", str(port), "--enforce-eager", "--dtype", "float32",
             "--max-model-len", "1024"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,  # its own process group: teardown ends engine + worker
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
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
        yield base, model
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


def test_server_grammar_via_vllm_xargs(server):
    base, model = server
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    status, body = _post(base + "/v1/chat/completions", {
        "model": model, "max_tokens": 80, "temperature": 0,
        "messages": [{"role": "user", "content": "Give a person as JSON"}],
        "vllm_xargs": {"grammar": json.dumps({"json_schema": schema})},
    })
    assert status == 200, body
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    value = json.loads(choice["message"]["content"])
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)

    status, body = _post(base + "/v1/completions", {
        "model": model, "prompt": "Is the sky blue? Answer:", "max_tokens": 5, "temperature": 0,
        "vllm_xargs": {"grammar": json.dumps({"lark": 'start: " yes" | " no"'})},
    })
    assert status == 200, body
    assert body["choices"][0]["text"] in (" yes", " no")


@pytest.mark.parametrize("grammar, needle", [
    ({"json_schema": {"type": "frobnicate"}}, "Invalid type: frobnicate"),
    ({"regex": "a", "lark": "start: 'a'"}, "exactly one of the keys"),
    ({"regexp": "a"}, "unknown key(s) 'regexp'"),
])
def test_server_bad_grammar_is_400_and_server_keeps_serving(server, grammar, needle):
    base, model = server
    status, body = _post(base + "/v1/completions", {
        "model": model, "prompt": "x", "max_tokens": 5,
        "vllm_xargs": {"grammar": json.dumps(grammar)},
    })
    assert status == 400, body
    assert needle in body["error"]["message"]
    status, body = _post(base + "/v1/completions", {
        "model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
    })
    assert status == 200 and body["choices"][0]["text"], body
