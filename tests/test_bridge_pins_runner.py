"""Pins which model runner vLLM gives our route: the V1 runner.

Our methods reach vLLM as ``custom_class`` speculative decoding, and the
bridge extends the V1 model runner (``GPUModelRunner`` and its CPU
subclass). vLLM's default is Model Runner V2, whose ``init_speculator`` has
no hook for a plugin's proposer; our engines run on V1 only because vLLM
falls back to it for ``custom_class``
(``VllmConfig._get_v2_model_runner_unsupported_features``). These pins fail
the day a vLLM release drops that fallback (docs/architecture.md, "Model
Runner V2").
"""

from __future__ import annotations

from unittest import mock

import pytest


@pytest.fixture(scope="module")
def our_config(model_path):
    """The VllmConfig an engine drafting with one of our methods gets."""
    from vllm.engine.arg_utils import EngineArgs

    import vllm_plugins

    vllm_plugins.register()
    return EngineArgs(model=model_path, max_model_len=256, enforce_eager=True,
                      dtype="float32",
                      speculative_config={"method": "token_recycling",
                                          "num_speculative_tokens": 3},
                      ).create_engine_config()


def test_custom_class_falls_back_to_the_v1_runner(our_config, monkeypatch):
    import vllm.config.vllm as vllm_config_module

    from vllm_plugins.bridge.patches import RELIED_ON

    assert "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features" \
        in RELIED_ON
    assert "vllm.config.vllm:VllmConfig.use_v2_model_runner" in RELIED_ON
    assert our_config.speculative_config.method == "custom_class"
    assert "speculative method 'custom_class'" in (
        our_config._get_v2_model_runner_unsupported_features())
    # With Triton (every GPU build): the CPU build without it falls back to
    # V1 for that reason alone, which would hide the loss of this fallback.
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    with mock.patch.object(vllm_config_module, "HAS_TRITON", True):
        assert our_config.use_v2_model_runner is False


def test_the_pin_fails_without_the_fallback(our_config, monkeypatch):
    # What the day the fallback goes looks like: V2 is chosen.
    import vllm.config.vllm as vllm_config_module
    from vllm.config import VllmConfig

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    original = VllmConfig._get_v2_model_runner_unsupported_features

    def without_custom_class(self):
        return [f for f in original(self) if "custom_class" not in f]

    with mock.patch.object(vllm_config_module, "HAS_TRITON", True), \
            mock.patch.object(VllmConfig, "_get_v2_model_runner_unsupported_features",
                              without_custom_class):
        assert our_config.use_v2_model_runner is True
        with pytest.raises(AssertionError):
            test_custom_class_falls_back_to_the_v1_runner(our_config, monkeypatch)

