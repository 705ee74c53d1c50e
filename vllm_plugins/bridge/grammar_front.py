"""The front end's side of our grammar requests: validation off the event loop.

vLLM's ``AsyncLLM.add_request`` runs the input processor synchronously on
the API server's event loop, and the input processor calls every custom
logits processor's ``validate_params``: ours compiles the request's grammar
there (``vllm_plugins.grammar.spec.validate_grammar_request``), which for a
large JSON Schema takes long enough to pause every other stream the server
is sending. So, before vLLM's ``add_request`` runs, a request that carries
``extra_args["grammar"]`` has its grammar compiled on a worker thread while
the loop awaits it (llguidance releases the GIL while it compiles). The
result, a compiled grammar or the spec error, lands in the spec module's
cache, where ``validate_params`` then finds it at once: the request is
admitted or refused exactly as before, with the same message.
"""

from __future__ import annotations

import asyncio
import functools


def wrap_add_request(original):
    # vllm.v1.engine.async_llm.AsyncLLM.add_request(self, request_id, prompt,
    #     params, ...) (a coroutine) calls self.input_processor.process_inputs(...)
    # synchronously, which validates params (custom logits processors'
    # validate_params included) on the event loop.
    @functools.wraps(original)
    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        await compile_off_loop(params)
        return await original(self, request_id, prompt, params, *args, **kwargs)

    return add_request


async def compile_off_loop(params) -> None:
    """Compile ``params``' grammar, if it has one, on a thread (cached for
    ``validate_params``); errors are left for ``validate_params`` to raise."""
    from vllm_plugins.grammar.spec import GRAMMAR_KEY, validate_grammar_request

    extra_args = getattr(params, "extra_args", None)
    if not isinstance(extra_args, dict) or GRAMMAR_KEY not in extra_args:
        return
    try:
        await asyncio.to_thread(validate_grammar_request, extra_args)
    except Exception:  # noqa: BLE001 - validate_params raises it, per request
        pass
