"""Preemption: a KV cache too small for the batch makes vLLM preempt requests
and re-prefill them later; greedy output with each method stays plain
decoding's, and the engine's preemption counter shows it happened.

The tiny random Llama (tests/tiny_model.py) keeps every engine cheap: 1 KiB
of KV per token (4 layers, one KV head of 32 float32 values, K and V), so
``KV_BYTES`` holds 16 blocks of 32 tokens, 512 tokens (twice max_model_len,
the least vLLM accepts being one max_model_len), while four requests of
``MAX_TOKENS`` need more than 900. Methods run one engine each, in turn.
"""

import os

import pytest

from tests.conftest import shutdown

pytestmark = pytest.mark.slow

KV_BYTES = 512 * 2**10
BLOCK = 32
MAX_TOKENS = 200
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "red blue green red blue green red blue green red blue",
]
# name -> (model, spec). Each method runs on a tiny model whose output it
# drafts for: with untied weights ngram_adaptive and del drafted nothing
# here; with tied small ones (the model repeats its last token in runs)
# token_recycling drafted nothing. Token Recycling and STAND draft a fixed
# length (Token Recycling with no confidence floor): whether their default
# goodput length drafts on a random model depends on the step times it measures. The test asserts that every
# engine drafts, so none can pass without showing anything.
SPECS = {
    "token_recycling": ("untied", {"method": "token_recycling",
                                   "num_speculative_tokens": 4,
                                   "draft_length": "fixed", "min_confidence": 0.0}),
    "ngram_adaptive": ("tied", {"method": "ngram_adaptive", "num_speculative_tokens": 4}),
    "stand": ("tied", {"method": "stand", "num_speculative_tokens": 4,
                       "draft_length": "fixed"}),
    # stop_below 0: a random model is rarely sure; every forward drafts.
    "swift": ("tied", {"method": "swift", "num_speculative_tokens": 3, "stop_below": 0.0}),
    "del": ("tied", {"method": "del", "num_speculative_tokens": 3, "stop_below": 0.0}),
    # Every source's trees merged, all nodes verified (no policy to cut them).
    "hybrid": ("untied", {"method": "hybrid", "num_speculative_tokens": 6,
                          "draft_length": "fixed",
                          "source_options": {"token_recycling": {"min_confidence": 0.0}}}),
}
MODELS = {"untied": {}, "tied": {"initializer_range": 0.05, "tie_word_embeddings": True}}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    root = tmp_path_factory.mktemp("preempt")
    return {kind: tiny_llama(root / kind, **kw) for kind, kw in MODELS.items()}


def engine(model: str, spec: dict | None):
    from vllm import LLM

    # vLLM's CPU platform lets VLLM_CPU_KVCACHE_SPACE (GiB; tests/conftest.py
    # sets 1) replace kv_cache_memory_bytes: unset while the engine starts.
    saved = os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    try:
        return LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
                   block_size=BLOCK, kv_cache_memory_bytes=KV_BYTES,
                   enforce_eager=True, seed=0, speculative_config=spec,
                   disable_log_stats=False, use_tqdm_on_load=False)
    finally:
        if saved is not None:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = saved


def preemptions(llm) -> int:
    """vLLM's own counter (vllm:num_preemptions, from the scheduler's stats)."""
    return int(sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:num_preemptions"))


def run(llm) -> tuple[list[list[int]], int]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], preemptions(llm)


@pytest.fixture(scope="module")
def reference(tiny_models):
    """Plain decoding on each model, computed when first asked for."""
    cache = {}

    def get(kind):
        if kind not in cache:
            llm = engine(tiny_models[kind], None)
            try:
                cache[kind] = run(llm)
            finally:
                shutdown(llm)
        return cache[kind]
    return get


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_output_survives_preemption(name, tiny_models, reference):
    from vllm_plugins.bench.engines import engine_stats

    kind, spec = SPECS[name]
    want, base_preempted = reference(kind)
    assert base_preempted > 0  # the setting preempts even without drafts
    llm = engine(tiny_models[kind], spec)
    try:
        got, preempted = run(llm)
        stats = engine_stats(llm)
    finally:
        shutdown(llm)
    assert preempted > 0, "the KV setting no longer preempts: the test lost its teeth"
    assert stats["drafted"] > 0 and stats["proposer"]["num_errors"] == 0, stats
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, (name, i)
