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

import pytest

from tests.serving import post as _post, running_server

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from importlib.metadata import entry_points

    from vllm_plugins.default_model import default_model_path

    if "grammar" not in {ep.name for ep in entry_points(group="vllm.logits_processors")}:
        pytest.skip("package not installed with its entry points (pip install -e .)")
    model = default_model_path()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(model, [], log) as base:
        yield base, model


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


# Nested deeper than Python's json reads (as text: json.dumps would refuse it
# here already), deep enough for llguidance's own limit, and too large for it.
TOO_DEEP_FOR_PYTHON = '{"json_schema": ' + '{"items": ' * 5000 + "{}" + "}" * 5001
TOO_DEEP = {"json_schema": json.loads('{"items": ' * 200 + "{}" + "}" * 200)}
TOO_LARGE = {"json_schema": {"type": "object", "properties": {
    f"p{i}": {"enum": [f"v{j}" for j in range(50)]} for i in range(3000)}}}


@pytest.mark.parametrize("grammar, needle", [
    ({"json_schema": {"type": "frobnicate"}}, "Invalid type: frobnicate"),
    ({"regex": "a", "lark": "start: 'a'"}, "exactly one of the keys"),
    ({"regexp": "a"}, "unknown key(s) 'regexp'"),
    (TOO_DEEP_FOR_PYTHON, "nested too deeply to compile"),
    (TOO_DEEP, "recursion limit exceeded"),
    (TOO_LARGE, "too big"),
], ids=["bad-type", "two-kinds", "unknown-key", "too-deep-python", "too-deep",
        "too-large"])
def test_server_bad_grammar_is_400_and_server_keeps_serving(server, grammar, needle):
    base, model = server
    status, body = _post(base + "/v1/completions", {
        "model": model, "prompt": "x", "max_tokens": 5,
        "vllm_xargs": {"grammar": grammar if isinstance(grammar, str)
                       else json.dumps(grammar)},
    })
    assert status == 400, body
    assert needle in body["error"]["message"]
    status, body = _post(base + "/v1/completions", {
        "model": model, "prompt": "Hello", "max_tokens": 3, "temperature": 0,
    })
    assert status == 200 and body["choices"][0]["text"], body
