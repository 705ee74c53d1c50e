"""Grammar-forced drafts inside vllm.LLM give vLLM's own structured output.

The reference is an engine without speculation, same vLLM structured outputs
(``StructuredOutputsParams(json=...)``, backend ``auto``), on JSONSchemaBench
dev schemas; it is the session's engine without speculation
(tests/conftest.py)."""

import json

import pytest

from tests.conftest import shutdown

pytestmark = pytest.mark.slow

N_SCHEMAS = 6
MAX_TOKENS = 96
PLAIN = "List three colours, one per line."


def engine(model_path, spec):
    from vllm_plugins.bench.engines import build_engine

    return build_engine(model_path, spec, max_num_seqs=8, max_model_len=2048,
                        kv_cache_mib=256)


def params(schema=None):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=schema) if schema is not None else None
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=so)


@pytest.fixture(scope="module")
def schemas():
    from vllm_plugins.bench.data import shared_data
    from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request

    rows = [json.loads(x) for x in shared_data("json_schemas_dev.jsonl").read_text().splitlines()]
    out = []
    for row in rows[::7]:  # spread over the splits
        try:
            compile_grammar_request({"json_schema": row["schema"]})
        except GrammarSpecError:
            continue
        if len(json.dumps(row["schema"])) < 2500:
            out.append(row["schema"])
        if len(out) == N_SCHEMAS:
            return out
    raise AssertionError("not enough compiling dev schemas")


def prompts_for(tok, schemas):
    from vllm_plugins.bench.grammar_bench import prompt_ids

    plain = tok.apply_chat_template([{"role": "user", "content": PLAIN}],
                                    add_generation_prompt=True, tokenize=False)
    return ([prompt_ids(tok, s) for s in schemas],
            tok(plain, add_special_tokens=False)["input_ids"])


def together(llm, schemas):
    """All schemas + one plain request in one batch: each one's tokens."""
    from vllm.sampling_params import RequestOutputKind

    ids, plain = prompts_for(llm.get_tokenizer(), schemas)
    llm_engine = llm.llm_engine
    batch_ids = [f"batch-{i}" for i in range(len(ids) + 1)]
    outs = {r: [] for r in batch_ids}
    for rid, p, s in zip(batch_ids, ids + [plain], schemas + [None]):
        sp = params(s)
        sp.output_kind = RequestOutputKind.DELTA
        llm_engine.add_request(rid, {"prompt_token_ids": p}, sp)
    while llm_engine.has_unfinished_requests():
        for o in llm_engine.step():
            outs[o.request_id].extend(o.outputs[0].token_ids)
    return [outs[r] for r in batch_ids]


def generate(llm, schemas):
    """(each schema alone, all schemas + one plain request in one batch)."""
    from vllm_plugins.bench.engines import run_batch

    ids, _ = prompts_for(llm.get_tokenizer(), schemas)
    alone = [run_batch(llm, [p], params(s))[0][0].token_ids for p, s in zip(ids, schemas)]
    return alone, together(llm, schemas)


@pytest.fixture(scope="module")
def reference(base, schemas):
    """Without speculation a request's greedy tokens under its grammar do not
    depend on the batch it runs in: one batch gives the references alone
    too, several times faster than one request at a time."""
    batch = together(base, schemas)
    alone = batch[:len(schemas)]
    tok = base.get_tokenizer()
    texts = [tok.decode(t, skip_special_tokens=True) for t in alone]
    return alone, batch, texts


@pytest.fixture(scope="module", params=[
    {"method": "grammar_forced", "num_speculative_tokens": 6},
    {"method": "grammar_forced", "num_speculative_tokens": 6, "inner": "token_recycling"},
    # An inner built with the constructor arguments every proposer takes.
    {"method": "grammar_forced", "num_speculative_tokens": 6, "inner": "ngram_adaptive"},
], ids=["grammar", "grammar+token_recycling", "grammar+ngram_adaptive"])
def spec(request, model_path, reference):
    llm = engine(model_path, request.param)
    yield llm
    shutdown(llm)


def test_reference_is_valid_json(reference, schemas):
    import jsonschema

    alone, _, texts = reference
    finished = [(t, s) for t, s, ids in zip(texts, schemas, alone) if len(ids) < MAX_TOKENS]
    assert finished, "no reference output finished: the check below would be empty"
    for text, schema in finished:
        jsonschema.validate(json.loads(text), schema)


def test_greedy_identical_to_structured_output_without_speculation(spec, reference, schemas):
    from vllm_plugins.bench.engines import engine_stats

    ref_alone, ref_batch, _ = reference
    alone, batch = generate(spec, schemas)
    assert alone == ref_alone
    assert batch == ref_batch
    # One more short request: its steps carry the finish notices of the batch.
    from vllm import SamplingParams

    spec.generate([PLAIN], SamplingParams(max_tokens=4), use_tqdm=False)
    stats = engine_stats(spec)
    p = stats["proposer"]
    assert p["num_errors"] == 0
    assert p["grammar_requests"] == 2 * N_SCHEMAS  # the plain request has none
    assert p["grammar_lost"] == 0 and p["grammar_unusable"] == 0
    assert p["forced_tokens"] > 0
    assert stats["accepted"] > 0
    assert p["active_matchers"] == 0  # all freed when the requests finished
    if "inner" in p:
        assert p["inner_tokens"] > 0 and p["inner"]["num_errors"] == 0


def test_bad_inner_option_fails_at_start(model_path):
    from vllm import LLM

    with pytest.raises(ValueError, match=r"'topk'.*inner of 'grammar_forced'"):
        LLM(model=model_path, enforce_eager=True, dtype="float32",
            speculative_config={"method": "grammar_forced",
                                "inner": {"method": "token_recycling", "topk": 0}})
