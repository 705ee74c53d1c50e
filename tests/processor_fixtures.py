"""Fixtures for tests that drive a logits processor by hand, with no engine."""

from __future__ import annotations

import pytest


def processor_fixtures(model_fixture: str, max_model_len: int):
    """Module-scoped ``vllm_config`` and ``tokenizer`` fixtures for the model
    that the fixture named ``model_fixture`` gives.

    The config is the one an engine would build (eager, float32) and hand its
    logits processors; building it starts no engine, so a test constructs a
    processor the way vLLM does, against the model's real vocabulary. Assign
    the pair to module names of the same spelling so pytest collects them::

        vllm_config, tokenizer = processor_fixtures("model_path", 1024)
    """

    @pytest.fixture(scope="module")
    def vllm_config(request):
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs(
            model=request.getfixturevalue(model_fixture), max_model_len=max_model_len,
            enforce_eager=True, dtype="float32",
        ).create_engine_config()

    @pytest.fixture(scope="module")
    def tokenizer(request):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(request.getfixturevalue(model_fixture))

    return vllm_config, tokenizer
