"""Per-request speculation through the OpenAI-compatible server.

A server runs the hybrid method; requests say, in ``vllm_xargs``, how much
to draft and from which sources (JSON text: vLLM's ``vllm_xargs`` carry
strings and numbers only). Greedy output is the same whatever they say; an
unknown key, a cap above the engine's or a source it does not run is a 400
that names it, and the server keeps serving. Slow: one server start.
"""

from __future__ import annotations

import json

import pytest

from tests.serving import post, running_server

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

MAX_DRAFT = 8
PROMPT = ("Monday: eggs. Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. "
          "Tuesday: toast. Monday: eggs. Wednesday: rice. Monday: eggs. Tuesday:")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from importlib.metadata import entry_points

    from vllm_plugins.default_model import default_model_path

    if "grammar" not in {ep.name for ep in entry_points(group="vllm.logits_processors")}:
        pytest.skip("package not installed with its entry points (pip install -e .)")
    model = default_model_path()
    log = tmp_path_factory.mktemp("server") / "server.log"
    spec = {"method": "hybrid", "num_speculative_tokens": MAX_DRAFT,
            "sources": ["token_recycling", "ngram"]}
    with running_server(model, ["--speculative-config", json.dumps(spec)], log) as base:
        yield base, model


def complete(server, speculation=None):
    base, model = server
    body = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    if speculation is not None:  # text as it is, anything else as JSON text
        body["vllm_xargs"] = {"speculation": speculation if isinstance(speculation, str)
                              else json.dumps(speculation)}
    return post(base + "/v1/completions", body)


def test_narrowed_requests_decode_as_the_engine_does(server):
    status, body = complete(server)
    assert status == 200, body
    want = body["choices"][0]["text"]
    for spec in ({"max_draft": 0}, {"max_draft": 2}, {"max_draft": MAX_DRAFT},
                 {"sources": ["ngram"]}, {"sources": ["token_recycling"], "max_draft": 3}):
        status, body = complete(server, spec)
        assert status == 200, (spec, body)
        assert body["choices"][0]["text"] == want, spec


@pytest.mark.parametrize("spec, needle", [
    ({"max_drafts": 2}, "unknown key(s) ['max_drafts']"),
    ({"max_draft": MAX_DRAFT + 1}, f"must be an integer in [0, {MAX_DRAFT}]"),
    ({"max_draft": -1}, "max_draft"),
    ({"sources": ["suffix"]}, "names ['suffix']"),
    ({"sources": []}, "non-empty list"),
    ("[" * 5000, "nested too deeply"),
], ids=["unknown-key", "above-engine", "negative", "source-not-run", "no-sources",
        "deeply-nested-text"])
def test_bad_speculation_is_400_naming_it_and_server_keeps_serving(server, spec, needle):
    status, body = complete(server, spec)
    assert status == 400, body
    assert needle in json.dumps(body).replace('\\"', '"'), body
    status, body = complete(server)
    assert status == 200, body
