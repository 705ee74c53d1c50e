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


def spec_decode_metadata(layout):
    """vLLM's SpecDecodeMetadata for requests with these drafts (one list of
    token ids each), its logits rows laid out as the runner lays them: each
    request's target rows, then its bonus row."""
    import torch
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    meta = SpecDecodeMetadata.make_dummy(layout, torch.device("cpu"))
    target, bonus, start = [], [], 0
    for d in layout:
        target.extend(range(start, start + len(d)))
        bonus.append(start + len(d))
        start += len(d) + 1
    meta.target_logits_indices = torch.tensor(target, dtype=torch.int32)
    meta.bonus_logits_indices = torch.tensor(bonus, dtype=torch.int32)
    meta.logits_indices = torch.arange(start, dtype=torch.int32)
    return meta
