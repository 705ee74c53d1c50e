"""Engines that do not use our proposers carry nothing of ours.

The package is installed wherever vLLM runs, so its patches run in every
engine: plain decoding and vLLM's own drafters must keep no state of ours,
however many requests they serve.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def ours(runner) -> list[str]:
    """Runner attributes that belong to this package, by name or by type."""
    found = []
    for name, value in vars(runner).items():
        module = type(value).__module__ or ""
        if "vllm_plugins" in name or name.startswith("_vp") or module.startswith(
                "vllm_plugins"):
            found.append(name)
    return found


def probe(model_path: str, spec_json: str) -> None:
    """Runs in a fresh process, so that nothing the test session imported
    or built is there, with an in-process engine core, so that the runner is
    reachable: serves 300 requests and prints what it found on the runner
    after each hundred, as one JSON line."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_path, dtype="float32", max_model_len=256,
              max_num_seqs=16, enforce_eager=True,
              speculative_config=json.loads(spec_json),
              kv_cache_memory_bytes=128 * 2**20)
    # LLMEngine -> InprocClient -> EngineCore -> UniProcExecutor -> worker -> runner
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker \
        .worker.model_runner
    params = SamplingParams(temperature=0.0, max_tokens=3)
    prompts = [f"Count to {i}: 1, 2," for i in range(300)]
    rounds = []
    for start in range(0, 300, 100):
        outs = llm.generate(prompts[start:start + 100], params, use_tqdm=False)
        rounds.append({"ours": ours(runner), "attrs": len(vars(runner)),
                       "complete": all(len(o.outputs[0].token_ids) == 3 for o in outs)})
    stats = llm.llm_engine.collective_rpc("vllm_plugins_stats")
    print(json.dumps({"rounds": rounds, "stats": stats}))


@pytest.mark.parametrize("spec", [
    None,
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
     "prompt_lookup_min": 2},
], ids=["plain", "vllm-ngram"])
def test_engines_without_our_proposers_keep_nothing_of_ours(model_path, spec):
    code = (f"from tests.test_footprint_e2e import probe; "
            f"probe({model_path!r}, {json.dumps(json.dumps(spec))})")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True,
                          capture_output=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    rounds = found["rounds"]
    assert all(r["complete"] for r in rounds)
    assert all(r["ours"] == [] for r in rounds), rounds
    assert rounds[0]["attrs"] == rounds[-1]["attrs"]
    assert found["stats"] == [{}]
