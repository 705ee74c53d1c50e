"""Tensor parallel 2: every method exact, every rank drafting alike.

vLLM's CPU build runs tensor parallel across processes (one core per rank
here, VLLM_CPU_OMP_THREADS_BIND "0|1"). The target is a tiny random Llama
with even head counts (SmolLM2-135M's 9 heads do not split in two); greedy
equality with plain decoding at the same parallel size needs no trained
model. Each rank's per-step digest (drafts, draft probabilities, token
history, the seconds its decisions read: vllm_plugins.bridge.ranks) must
match the other rank's, step for step. The hybrid runs beside its built-in
sources one from another package that fails on the second rank only
(tests/rank_source.py): the requests whose drafts the ranks disagree on
draft nothing that step, on both ranks, and output stays plain decoding's.
"""

import pytest

from tests.conftest import engine_cores, shutdown

pytestmark = pytest.mark.slow

TP = 2
MAX_TOKENS = 32
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
]
CHOICES = ["alpha beta gamma", "delta epsilon", "zeta eta theta iota"]


def grammar_method() -> str:
    from vllm_plugins.registry import METHODS

    return "grammar_forced" if "grammar_forced" in METHODS else "grammar"


SPECS = {
    # The random model's distributions are flat (its argmax still decides),
    # so Token Recycling drafts below its default min_confidence: 0 here. The
    # controller may rest a whole run when drafting does not pay on this
    # CPU; resting off and warm-up steps all exploring, it drafts at every
    # step, at lengths it draws (seeded) and then chooses from the seconds.
    "token_recycling-goodput": {"method": "token_recycling",
                                "num_speculative_tokens": 4,
                                "min_confidence": 0.0,
                                "draft_length": "goodput",
                                "draft_length_options": {"rest": False,
                                                         "warmup_explore": 1.0}},
    "ngram_adaptive": {"method": "ngram_adaptive", "num_speculative_tokens": 4},
    # Fixed drafts: under its default goodput, whether it drafts at all on
    # a random model depends on the step times it measures.
    "stand": {"method": "stand", "num_speculative_tokens": 4, "draft_length": "fixed"},
    # stop_below 0: a random model is rarely sure; every forward drafts.
    "swift": {"method": "swift", "num_speculative_tokens": 3, "stop_below": 0.0},
    # min_value 0: DEL drafts at every step, choosing among three exits by
    # the seconds its draft forwards took.
    "del": {"method": "del", "num_speculative_tokens": 3, "stop_below": 0.0,
            "min_value": 0.0, "exit_layers": [1, 2, 3]},
    # Every source's trees merged (suffix's cache, the tables, the lookup)
    # and calibrated from outcomes: the same on every rank; and a source
    # that fails on the second rank only (its "sources" are filled in below).
    "hybrid": {"method": "hybrid", "num_speculative_tokens": 6, "draft_length": "fixed",
               "source_options": {"token_recycling": {"min_confidence": 0.0}}},
    "grammar-token_recycling": {"method": None,
                                "inner": {"method": "token_recycling",
                                          "min_confidence": 0.0},
                                "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module")
def tiny_tp_model(tmp_path_factory):
    from tests.tiny_model import tiny_llama

    # 4 query and 2 KV heads of size 32: two per rank, one KV head each.
    # Tied, small weights: runs of repeated tokens, so every method drafts.
    return tiny_llama(tmp_path_factory.mktemp("tp") / "tiny", num_layers=4,
                      hidden_size=128, num_heads=4, num_kv_heads=2,
                      intermediate_size=256, initializer_range=0.05,
                      tie_word_embeddings=True)


def tp_engine(model: str, spec: dict | None):
    from vllm import LLM

    with engine_cores("0|1"):
        return LLM(model=model, dtype="float32", tensor_parallel_size=TP,
                   distributed_executor_backend="mp", max_model_len=512,
                   max_num_seqs=4, enforce_eager=True, seed=0,
                   speculative_config=spec, kv_cache_memory_bytes=64 * 2**20,
                   use_tqdm_on_load=False)


def greedy(structured=False):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(choice=CHOICES) if structured else None
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          structured_outputs=so)


def sampled():
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7)


def tokens(llm, params):
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_tp_model):
    """Plain decoding at the same tensor-parallel size, then shut down: one
    engine at a time on two cores."""
    llm = tp_engine(tiny_tp_model, None)
    try:
        out = {"greedy": tokens(llm, greedy()),
               "structured": tokens(llm, greedy(structured=True))}
    finally:
        shutdown(llm)
    return out


@pytest.mark.parametrize("name", list(SPECS))
def test_tensor_parallel_exact_and_rank_identical(name, tiny_tp_model, reference, tmp_path,
                                                  monkeypatch):
    spec = dict(SPECS[name])
    if spec["method"] is None:
        spec["method"] = grammar_method()
    if name == "hybrid":
        from tests.test_hybrid import install_example_source
        from vllm_plugins.proposers.sources import default_sources

        install_example_source(tmp_path, monkeypatch, "rank_one_fails",
                               "tests.rank_source:RankOneFailsSource")
        spec["sources"] = [*default_sources(), "rank_one_fails"]
    llm = tp_engine(tiny_tp_model, spec)
    try:
        assert llm.collective_rpc("vllm_plugins_rank_digest") == [[]] * TP
        assert tokens(llm, greedy()) == reference["greedy"]
        if name.startswith("grammar"):
            got = tokens(llm, greedy(structured=True))
            assert got == reference["structured"]
        if name == "stand":
            tokens(llm, sampled())  # sampled drafts carry probabilities
        digests = llm.collective_rpc("vllm_plugins_rank_digest")
        stats = llm.collective_rpc("vllm_plugins_stats")
    finally:
        shutdown(llm)
    assert len(digests) == TP and len(digests[0]) > MAX_TOKENS // 4
    first_differing = next((i for i, (a, b) in enumerate(zip(*digests)) if a != b),
                           None)
    assert first_differing is None, f"ranks differ from step {first_differing}"
    assert digests[0] == digests[1]
    # The counters agree too; the proposers' metrics hold rank-local seconds.
    assert stats[0]["drafted"] > 0, stats[0]
    assert stats[0]["accepted"] > 0, stats[0]
    assert stats[0] == stats[1] | {"proposer": stats[0]["proposer"]}
    if name == "hybrid":  # the second rank's failures were met, and contained
        assert stats[0]["rank_disagreements"] > 0, stats[0]
        assert stats[1]["proposer"]["sources"]["rank_one_fails"]["errors"] > 0, stats[1]
        assert stats[0]["proposer"]["sources"]["rank_one_fails"]["errors"] == 0, stats[0]


# Under vLLM's external_launcher executor, DEL: every broadcast the bridge
# makes (the step's seconds, its draft timings through the first rank's
# clock) and draft forwards with their collectives. (Token Recycling passed
# too; one method keeps the suite's time down: each run starts two vLLMs.)
LAUNCHED = ("del",)


@pytest.mark.parametrize("name", LAUNCHED)
def test_external_launcher_ranks_exact_and_identical(name, tiny_tp_model, reference,
                                                     tmp_path):
    """Each rank a process of its own, started by torchrun, with its own
    engine: what a multi-node launcher does. Nothing of the bridge's rank
    logic may assume vLLM's multiprocessing executor."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.serving import free_port

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0|1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(TP),
         "--master-port", str(free_port()), "-m", "tests.external_launcher_ranks",
         str(tmp_path), tiny_tp_model, json.dumps(SPECS[name])],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(TP)]
    for rank in ranks:
        assert rank["tokens"] == reference["greedy"]
    assert len(ranks[0]["digests"]) > MAX_TOKENS // 4
    assert ranks[0]["digests"] == ranks[1]["digests"]
    assert ranks[0]["stats"]["drafted"] > 0, ranks[0]["stats"]
    assert ranks[0]["stats"] == ranks[1]["stats"]
