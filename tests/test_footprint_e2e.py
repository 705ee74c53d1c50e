"""Engines that do not use our proposers carry nothing of ours.

The package is installed wherever vLLM runs, so its patches run in every
engine: plain decoding and vLLM's own drafters must keep no state of ours,
however many requests they serve.
"""

import pytest

from tests.conftest import shutdown

pytestmark = pytest.mark.slow


def runner_of(llm):
    # In-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0): LLMEngine ->
    # InprocClient -> EngineCore -> UniProcExecutor -> worker -> model runner.
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker \
        .worker.model_runner


def ours(runner) -> list[str]:
    """Runner attributes that belong to this package, by name or by type."""
    found = []
    for name, value in vars(runner).items():
        module = type(value).__module__ or ""
        if "vllm_plugins" in name or name.startswith("_vp") or module.startswith(
                "vllm_plugins"):
            found.append(name)
    return found


@pytest.mark.parametrize("spec", [
    None,
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
     "prompt_lookup_min": 2},
], ids=["plain", "vllm-ngram"])
def test_engines_without_our_proposers_keep_nothing_of_ours(
        model_path, spec, monkeypatch):
    from vllm import LLM, SamplingParams

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llm = LLM(model=model_path, dtype="float32", max_model_len=256,
              max_num_seqs=16, enforce_eager=True, speculative_config=spec,
              kv_cache_memory_bytes=128 * 2**20)
    try:
        runner = runner_of(llm)
        params = SamplingParams(temperature=0.0, max_tokens=3)
        prompts = [f"Count to {i}: 1, 2," for i in range(300)]
        sizes = []
        for start in range(0, 300, 100):
            outs = llm.generate(prompts[start:start + 100], params, use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
            assert ours(runner) == []
            sizes.append(len(vars(runner)))
        assert sizes[0] == sizes[-1]
        assert llm.llm_engine.collective_rpc("vllm_plugins_stats") == [{}]
    finally:
        shutdown(llm)
