"""The grammar processor's default JSON reading against vLLM's native backend.

Per JSONSchemaBench dev schema that vLLM's ``auto`` backend gives to xgrammar
(its choice for JSON schemas), the grammar ``extra_args["grammar"]`` compiles
to and vLLM's own ``XgrammarBackend`` grammar (built from the engine config
vLLM would build, so its whitespace and strict-mode settings are vLLM's) are
fed the same token sequences, EOS last, and must agree on acceptance:

* valid instances (``tests/json_instances.py``, checked by ``jsonschema``),
  each written compact, with spaces and indented;
* the same instances with one key the schema does not name, in the top
  object and in a nested one.

No engine starts. Two controls show the comparison can fail: the
JSON-Schema-faithful reading (objects open where the schema is silent) and
compact-only whitespace each disagree with native on many documents.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

pytest.importorskip("xgrammar")
llguidance = pytest.importorskip("llguidance")

from tests.json_instances import texts, valid_instances, with_extra_keys  # noqa: E402
from tests.processor_fixtures import processor_fixtures  # noqa: E402
from vllm_plugins.bench.data import shared_data  # noqa: E402
from vllm_plugins.grammar.spec import GrammarSpecError, compile_grammar_request  # noqa: E402

# Schema -> why native and our default read some document differently. A
# disagreement on a schema not listed here fails the test.
KNOWN_DIFFERENCES = {
    "o17545.json": "a const object: xgrammar matches the const's JSON text "
                   "with no whitespace inside it",
}


@pytest.fixture(scope="module")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=1024)


def dev_schemas() -> list[dict]:
    return [json.loads(line) for line in shared_data("json_schemas_dev.jsonl").read_text().splitlines()
            if line.strip()]


def auto_picks_xgrammar(schema) -> bool:
    """vLLM's own first choice under ``auto`` (``SamplingParams`` validation)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_xgrammar import validate_xgrammar_grammar

    try:
        validate_xgrammar_grammar(SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
    except (ValueError, VLLMValidationError):
        return False
    return True


@dataclass
class Case:
    name: str
    schema: dict
    docs: list[tuple[str, list[int]]]  # (kind, token ids ending in EOS)
    native: list[bool]  # vLLM's xgrammar grammar accepts docs[i]


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer, vllm_config):
    from vllm_plugins.grammar.runtime import build_ll_tokenizer

    return build_ll_tokenizer(tokenizer, vllm_config.model_config.get_vocab_size())


@pytest.fixture(scope="module")
def cases(vllm_config, tokenizer) -> list[Case]:
    from vllm.v1.structured_output.backend_types import StructuredOutputOptions
    from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

    backend = XgrammarBackend(vllm_config, tokenizer=tokenizer,
                              vocab_size=vllm_config.model_config.get_vocab_size())
    eos = tokenizer.eos_token_id
    out = []
    for row in dev_schemas():
        schema = row["schema"]
        if not auto_picks_xgrammar(schema):
            continue
        try:
            grammar = backend.compile_grammar(StructuredOutputOptions.JSON, json.dumps(schema))
        except Exception:  # noqa: BLE001 - native refuses it at compile time
            continue
        docs = []
        for doc in valid_instances(schema, 3):
            docs += [(k, t) for k, t in texts(doc).items()]
            docs += [("extra key", t) for t in with_extra_keys(doc)]
        docs = [(k, tokenizer.encode(t, add_special_tokens=False) + [eos]) for k, t in docs]
        # validate_tokens leaves the matcher where it was: one grammar serves all.
        native = [len(grammar.validate_tokens(ids)) == len(ids) for _, ids in docs]
        out.append(Case(row["name"], schema, docs, native))
    return out


def disagreements(cases: list[Case], ll_tokenizer, **options) -> list[tuple[str, str, bool, str]]:
    """(schema, document kind, native accepts, text) where our grammar,
    compiled with ``options``, decides otherwise (schemas it refuses are
    left out; coverage has its own test)."""
    out = []
    for case in cases:
        try:
            compiled = compile_grammar_request({"json_schema": case.schema, **options})
        except GrammarSpecError:
            continue
        template = llguidance.LLMatcher(ll_tokenizer, compiled.grammar, log_level=0)
        for (kind, ids), native in zip(case.docs, case.native):
            ours = template.deep_copy().validate_tokens(ids) == len(ids)
            if ours != native:
                out.append((case.name, kind, native, ll_tokenizer.decode_str(ids[:-1])))
    return out


def test_default_reading_accepts_what_native_accepts(cases, ll_tokenizer):
    docs = [kind for c in cases for kind, _ in c.docs]
    assert len(cases) >= 300, f"only {len(cases)} dev schemas compared"
    assert docs.count("extra key") >= 500 and docs.count("indented") >= 800
    # The extra-key documents are mostly refused by native: the comparison
    # exercises the key policy, not only documents everyone accepts.
    refused = sum(not n for c in cases for (kind, _), n in zip(c.docs, c.native) if kind == "extra key")
    assert refused >= 0.9 * docs.count("extra key")
    found = disagreements(cases, ll_tokenizer)
    new = [d for d in found if d[0] not in KNOWN_DIFFERENCES]
    assert not new, "our default grammar and vLLM's xgrammar disagree:\n" + "\n".join(
        f"{name} [{kind}] native {'accepts' if n else 'rejects'}: {text[:160]!r}"
        for name, kind, n, text in new[:20])


def test_faithful_reading_is_caught_as_different(cases, ll_tokenizer):
    """Control: JSON Schema's reading lets objects take keys the schema does
    not name where it says nothing, which native refuses."""
    found = disagreements(cases, ll_tokenizer, json_schema_faithful=True)
    extra = [d for d in found if d[1] == "extra key" and not d[2]]
    assert len(extra) >= 300, len(extra)


def test_compact_whitespace_is_caught_as_different(cases, ll_tokenizer):
    """Control: native allows any JSON whitespace; compact-only grammars
    refuse the spaced and indented documents native accepts."""
    found = disagreements(cases, ll_tokenizer, whitespace_flexible=False)
    assert sum(d[1] in ("spaced", "indented") and d[2] for d in found) >= 500


def test_every_dev_schema_native_compiles_compiles(tokenizer):
    """Coverage at least native's: vLLM's ``auto`` choice (xgrammar, else
    guidance) accepting a schema means ours compiles it too."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.structured_output.backend_guidance import validate_guidance_grammar

    native = ours = 0
    missing = []
    for row in dev_schemas():
        schema = row["schema"]
        try:
            if not auto_picks_xgrammar(schema):
                validate_guidance_grammar(SamplingParams(
                    structured_outputs=StructuredOutputsParams(json=schema)))
            native_ok = True
        except (ValueError, VLLMValidationError):
            native_ok = False
        try:
            compile_grammar_request({"json_schema": schema})
            ours_ok = True
        except GrammarSpecError:
            ours_ok = False
        native += native_ok
        ours += ours_ok
        if native_ok and not ours_ok:
            missing.append(row["name"])
    assert not missing, missing
    assert ours >= native >= 300


@pytest.mark.parametrize("schema", [
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "not": {"required": ["b"]}},
    {"type": "string", "format": "big-integer"},
])
def test_native_constructs_compile_by_default_and_faithful_refuses_them(schema):
    compiled = compile_grammar_request({"json_schema": schema})
    assert compiled.warnings, "what was approximated or ignored is reported"
    with pytest.raises(GrammarSpecError):
        compile_grammar_request({"json_schema": schema, "json_schema_faithful": True})


@pytest.mark.parametrize("grammar, needle", [
    ({"json_schema": False}, "no JSON value satisfies it"),
    ({"json_schema": {}, "json_schema_faithful": "yes"}, '["json_schema_faithful"] must be true or false'),
    ({"json_object": True, "json_schema_faithful": True}, "applies only to json_schema"),
])
def test_bad_faithful_option_is_refused(grammar, needle):
    with pytest.raises(GrammarSpecError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        compile_grammar_request(grammar)


def test_bench_replays_each_modes_mask(vllm_config, tokenizer):
    """The grammar benchmark's per-mode parts, without an engine: compile
    checks and the mask replay over an output, native and ours."""
    from vllm_plugins.bench.grammar_modes import mask_times, native_compiles, ours_compiles

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    assert native_compiles(schema) and ours_compiles(schema)
    assert not native_compiles({"type": "string", "format": "big-integer"})
    ids = tokenizer.encode('{"n": 12}', add_special_tokens=False) + [tokenizer.eos_token_id]
    for kind in ("native", "ours"):
        times = mask_times(kind, vllm_config, tokenizer, [(schema, ids)])
        assert len(times) >= len(ids) - 1 and all(t > 0 for t in times)
