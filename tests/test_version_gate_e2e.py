"""An upgrade of vLLM past the releases the bridge was checked against must
not stop vLLM: vLLM runs general plugins without a guard, in every process.

A fresh process fakes the next vLLM minor: our plugin warns once, installs
none of its patches, a plain engine starts and serves, and a config naming
one of our methods is refused with the reason and the supported versions.
Slow: one engine start (the tiny model) in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

NEXT_VLLM = "0.34.0"

SCRIPT = r"""
import json, sys

import vllm

vllm.__version__ = sys.argv[2]  # before vLLM loads its plugins (at the first engine)
from vllm import LLM, SamplingParams

from vllm_plugins.bridge.patches import PATCHES, UNSUPPORTED_VLLM_PATCHES


def engine(spec=None):
    return LLM(model=sys.argv[1], dtype="float32", max_model_len=256, max_num_seqs=2,
               enforce_eager=True, seed=0, speculative_config=spec,
               use_tqdm_on_load=False)


llm = engine()
out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                   SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
try:
    engine({"method": "token_recycling", "num_speculative_tokens": 4})
    refusal = None
except Exception as e:
    refusal = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps({
    "tokens": list(out[0].outputs[0].token_ids),
    "applied": [p.name for p in PATCHES if p.is_applied()],
    "refusal_patch": [p.name for p in UNSUPPORTED_VLLM_PATCHES if p.is_applied()],
    "refusal": refusal}))
"""


def test_on_the_next_vllm_our_plugin_steps_aside(tmp_path):
    from tests.tiny_model import tiny_llama

    model = tiny_llama(tmp_path / "tiny", num_layers=2)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    run = subprocess.run([sys.executable, "-c", SCRIPT, model, NEXT_VLLM], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [x for x in run.stdout.splitlines() if x.startswith("RESULT ")]
    assert run.returncode == 0 and lines, run.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert len(got["tokens"]) == 8, got          # plain vLLM started and served
    assert got["applied"] == [], got             # nothing of ours installed
    assert got["refusal_patch"] == ["config.unsupported_vllm"], got
    refusal = got["refusal"] or ""
    assert "ValueError" in refusal and "'token_recycling'" in refusal, refusal
    assert f"vLLM {NEXT_VLLM} is installed" in refusal and ">=0.32,<0.34" in refusal, refusal
    warned = [x for x in run.stderr.splitlines() if "vllm-plugins is off" in x]
    assert len(warned) == 1, run.stderr[-4000:]  # once per process
