"""One rank of a tensor-parallel engine under vLLM's ``external_launcher``.

Run by ``torchrun --nproc-per-node 2 -m tests.external_launcher_ranks OUT
MODEL SPEC_JSON`` (tests/test_tensor_parallel_e2e.py): every process builds
the same ``LLM`` with ``distributed_executor_backend="external_launcher"``,
so each runs its own engine and one worker, the ranks joined by torchrun's
process group instead of vLLM's multiprocessing executor (the way a
multi-node launcher such as Slurm or Kubernetes starts them). Each rank
writes its greedy tokens, its per-step digests and its counters to
``OUT/rank<RANK>.json``.
"""

from __future__ import annotations

import json
import os
import sys

from tests.test_tensor_parallel_e2e import MAX_TOKENS, PROMPTS


def main(out_dir: str, model: str, spec_json: str) -> None:
    from vllm import LLM, SamplingParams

    rank = int(os.environ["RANK"])
    llm = LLM(model=model, dtype="float32", tensor_parallel_size=2,
              distributed_executor_backend="external_launcher", max_model_len=512,
              max_num_seqs=4, enforce_eager=True, seed=0,
              speculative_config=json.loads(spec_json), kv_cache_memory_bytes=64 * 2**20,
              use_tqdm_on_load=False)
    # The executor's collective_rpc reaches this process's worker only.
    assert llm.collective_rpc("vllm_plugins_rank_digest") == [[]]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "digests": llm.collective_rpc("vllm_plugins_rank_digest")[0],
              "stats": {k: v for k, v in llm.collective_rpc("vllm_plugins_stats")[0].items()
                        if k != "proposer"}}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
