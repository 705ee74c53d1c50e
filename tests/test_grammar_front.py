"""Grammar validation off the API server's event loop, without a server.

vLLM's ``AsyncLLM.add_request`` validates a request (our processor's
``validate_params`` compiles its grammar) synchronously on the event loop.
``vllm_plugins.bridge.grammar_front`` compiles the grammar on a thread first,
so the loop keeps serving while a large schema compiles, and
``validate_params`` then finds the result cached: admission and refusals
are unchanged. Here the compile is made slow on purpose and the loop's
longest pause is measured; tests/test_grammar_server.py measures a plain
request's time to first token on a server.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

pytest.importorskip("vllm")

SLOW = 1.0  # seconds the marked grammar's compile takes here


@pytest.fixture()
def slow_compiles(monkeypatch):
    from vllm_plugins.grammar import spec

    original = spec._compile_uncached
    compiles = []

    def slow(raw):
        compiles.append(raw)
        time.sleep(SLOW)  # holds no GIL, as llguidance's compile
        return original(raw)

    monkeypatch.setattr(spec, "_compile_uncached", slow)
    return compiles


def vllm_like_add_request():
    """What vLLM's AsyncLLM.add_request does with params before it awaits
    anything: the input processor's validation, on the loop."""
    from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        GrammarLogitsProcessor.validate_params(params)
        return request_id

    return add_request


async def longest_pause(work) -> tuple[float, object]:
    """(longest gap between ticks of a 10 ms ticker while ``work`` runs, its result)."""
    gaps, done = [0.0], asyncio.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    await asyncio.sleep(0.05)
    try:
        result = await work
    finally:
        done.set()
        await tick
    return max(gaps), result


def grammar_params(grammar):
    from vllm import SamplingParams

    return SamplingParams(extra_args={"grammar": grammar})


def test_the_patch_is_installed_on_asyncllm():
    from vllm.v1.engine.async_llm import AsyncLLM

    import vllm_plugins
    from vllm_plugins.bridge.patching import MARK

    vllm_plugins.register()
    assert getattr(AsyncLLM.add_request, MARK) == "grammar.validate_off_loop"


def test_a_slow_grammar_compiles_while_the_loop_keeps_running(slow_compiles):
    from vllm_plugins.bridge.grammar_front import wrap_add_request

    params = grammar_params({"regex": f"{uuid.uuid4().hex}[a-z]+"})
    on_loop = vllm_like_add_request()
    off_loop = wrap_add_request(on_loop)
    pause, got = asyncio.run(longest_pause(off_loop(None, "r1", "p", params)))
    assert got == "r1" and len(slow_compiles) == 1  # compiled once, then cached
    assert pause < SLOW / 4, pause
    # vLLM's own call alone pauses the loop for the whole compile.
    params = grammar_params({"regex": f"{uuid.uuid4().hex}[a-z]+"})
    pause, _ = asyncio.run(longest_pause(on_loop(None, "r2", "p", params)))
    assert pause >= SLOW * 0.9, pause


def test_admission_and_refusals_are_unchanged(slow_compiles):
    from vllm_plugins.bridge.grammar_front import wrap_add_request
    from vllm_plugins.grammar.spec import GrammarSpecError

    off_loop = wrap_add_request(vllm_like_add_request())
    bad = grammar_params({"regex": f"{uuid.uuid4().hex}(unclosed"})
    with pytest.raises(GrammarSpecError, match="regex"):
        asyncio.run(off_loop(None, "bad", "p", bad))
    assert len(slow_compiles) == 1  # the refusal came from the cached compile
    with pytest.raises(GrammarSpecError, match="exactly one"):
        asyncio.run(off_loop(None, "two", "p", grammar_params({"regex": "a", "lark": "b"})))
    assert len(slow_compiles) == 2
    from vllm import SamplingParams

    assert asyncio.run(off_loop(None, "plain", "p", SamplingParams())) == "plain"
    assert len(slow_compiles) == 2  # no grammar, no compile
