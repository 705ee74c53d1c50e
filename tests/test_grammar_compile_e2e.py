"""End to end: grammar compiles off the engine loop; a grammar error ends its request.

Slow (one engine start with the default model, about 40 s here):
``pytest -m slow tests/test_grammar_compile_e2e.py``. The grammar processor
comes from its entry point; a test-only processor listed after it forces a
token the grammar rejects, the way another component overriding the mask
would.
"""

from __future__ import annotations

import re

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import (  # noqa: E402
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)


class ForceTokenAt(LogitsProcessor):
    """Test only: a request with ``extra_args["force_token"] = [n, token]``
    samples ``token`` at output position ``n``, whatever ran before."""

    def __init__(self, vllm_config, device, is_pin_memory):
        self.reqs: dict[int, tuple[int, int, list[int]]] = {}

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        return None

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        for index in batch_update.removed:
            self.reqs.pop(index, None)
        for index, params, _prompt, output in batch_update.added:
            self.reqs.pop(index, None)
            force = (params.extra_args or {}).get("force_token")
            if force:
                self.reqs[index] = (int(force[0]), int(force[1]), output)
        for a, b, direction in batch_update.moved:
            ra, rb = self.reqs.pop(a, None), self.reqs.pop(b, None)
            if ra is not None:
                self.reqs[b] = ra
            if rb is not None and direction == MoveDirectionality.SWAP:
                self.reqs[a] = rb

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (n, token, output) in self.reqs.items():
            if index < logits.shape[0] and len(output) == n:
                logits[index] = float("-inf")
                logits[index, token] = 0.0
        return logits


@pytest.fixture(scope="module")
def llm():
    from importlib.metadata import entry_points

    from vllm import LLM

    from tests.conftest import shutdown
    from vllm_plugins.default_model import default_model_path

    if "grammar" not in {ep.name for ep in entry_points(group="vllm.logits_processors")}:
        pytest.skip("package not installed with its entry points (pip install -e .)")
    # The engine core in its own process, as under ``vllm serve``: in this
    # process it would find the front end's compile cached and hold nothing.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        engine = LLM(model=default_model_path(), dtype="float32", max_model_len=1024,
                     max_num_seqs=8, enforce_eager=True, seed=0,
                     kv_cache_memory_bytes=512 * 2**20, logits_processors=[ForceTokenAt])
    yield engine
    shutdown(engine)


def test_plain_request_is_not_stalled_by_a_compiling_schema(llm):
    """Time to first token of a plain request submitted right after a request
    whose large schema the engine has never compiled: the plain one is not
    queued behind the compile. (The running request's longest gap is
    printed, not checked: on vLLM's CPU build the worker process compiles
    the matcher once more when the grammar request enters the batch; see
    docs/grammar_design.md, "Where the worker runs".)"""
    from vllm_plugins.bench.grammar_compile_ttft import measure

    res = measure(llm, alternatives=600)
    print("grammar compile e2e:", {k: round(v, 3) for k, v in res.items()})
    assert res["ttft_grammar"] > 0.5, res  # the compile took long enough to see
    assert res["ttft_plain"] < 0.5 * res["ttft_grammar"], res


def test_a_matcher_error_ends_the_request_with_finish_reason_error(llm):
    from vllm import SamplingParams

    tok = llm.get_tokenizer()
    digit = tok("7", add_special_tokens=False)["input_ids"][-1]
    grammar = {"grammar": {"regex": "[a-z]{1,30}"}}
    params = [
        SamplingParams(max_tokens=12, temperature=0,
                       extra_args={**grammar, "force_token": [1, digit]}),
        SamplingParams(max_tokens=12, temperature=0, extra_args=dict(grammar)),
        SamplingParams(max_tokens=12, temperature=0),
    ]
    prompts = ["Write a word:", "Write a word:", "The capital of France is"]
    broken, control, plain = llm.generate(prompts, params, use_tqdm=False)
    out = broken.outputs[0]
    assert out.finish_reason == "error", (out.finish_reason, out.text)
    assert out.token_ids[1] == digit and len(out.token_ids) == 2  # nothing after it
    assert "[grammar error" not in out.text
    # The same request without the forced token follows its grammar, and the
    # plain request beside them is untouched.
    assert control.outputs[0].finish_reason in ("stop", "length")
    assert re.fullmatch("[a-z]{1,30}", control.outputs[0].text), control.outputs[0].text
    assert plain.outputs[0].finish_reason == "length"
    assert len(plain.outputs[0].token_ids) == 12
