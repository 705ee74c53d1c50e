"""End to end: ``"sampling": "awrs"`` through vLLM (the session's ``base``
engine, default model, CPU) gives the mask mode's tokens: greedy, and
seeded at temperature 1 (the AWRS generator copy stays in step with the
request's own generator when the prompt is prefilled in one step)."""

from __future__ import annotations

import json

import pytest

from vllm_plugins.bench.data import shared_data

pytestmark = pytest.mark.slow

SCHEMAS = ["calculate_area_eda9f9ab.json", "o58909.json", "o50970.json",
           "book_flight_e9f45f3c.json"]
MAX_TOKENS = 96


def _prompts(llm):
    from tests.test_grammar_e2e import _chat_prompt

    rows = {r["name"]: r for r in map(json.loads, open(shared_data("json_schemas_dev.jsonl")))}
    schemas = [rows[n]["schema"] for n in SCHEMAS]
    return schemas, [_chat_prompt(llm.get_tokenizer(), s) for s in schemas]


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 11)], ids=["greedy", "seeded"])
def test_awrs_outputs_equal_mask_mode(base, temperature, seed):
    from vllm import SamplingParams

    schemas, prompts = _prompts(base)
    before = _awrs_rows(base)
    out = {}
    for mode in ("mask", "awrs"):
        params = [SamplingParams(temperature=temperature, seed=None if seed is None else seed + i,
                                 max_tokens=MAX_TOKENS,
                                 extra_args={"grammar": {"json_schema": s, "sampling": mode}})
                  for i, s in enumerate(schemas)]
        res = base.generate(prompts, params, use_tqdm=False)
        out[mode] = [list(r.outputs[0].token_ids) for r in res]
        assert all(r.outputs[0].finish_reason in ("stop", "length") for r in res)
    for name, a, m in zip(SCHEMAS, out["awrs"], out["mask"]):
        assert a == m, name
    # AWRS chose them all but an EOS the finished grammar forces at the end.
    assert _awrs_rows(base) - before >= sum(len(o) - 1 for o in out["awrs"])


def _awrs_rows(llm) -> int:
    """Rows the engine's grammar processor decided by AWRS so far."""
    (rows,) = llm.collective_rpc(lambda w: sum(
        p.awrs_stats.rows for p in w.model_runner.input_batch.logitsprocs.all
        if type(p).__name__ == "GrammarLogitsProcessor"))
    return rows
