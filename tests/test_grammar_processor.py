"""Unit tests of GrammarLogitsProcessor with the default model's real tokenizer.

No engine is started: the processor is driven the way vLLM's V1 input batch
drives it (BatchUpdate + apply), and the way the V2 sampler does (add_request +
apply(logits, ctx)) with stand-in request-state tensors.
"""

from __future__ import annotations

import json
import re
from importlib.metadata import entry_points
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.processor_fixtures import processor_fixtures

pytest.importorskip("vllm")
pytest.importorskip("llguidance")

from vllm import SamplingParams  # noqa: E402
from vllm.v1.sample.logits_processor import (  # noqa: E402
    BatchUpdate,
    MoveDirectionality,
    build_logitsprocs,
    validate_logits_processors_parameters,
)

from vllm_plugins.logits_processors.grammar import GrammarLogitsProcessor  # noqa: E402
from vllm_plugins.grammar.spec import (  # noqa: E402
    GrammarSpecError,
    validate_grammar_request,
)

FQCN = "vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


vllm_config, tokenizer = processor_fixtures("model_path", max_model_len=1024)


@pytest.fixture()
def proc(vllm_config):
    return GrammarLogitsProcessor(vllm_config, torch.device("cpu"), False)


@pytest.fixture(scope="module")
def vocab(vllm_config):
    return vllm_config.model_config.get_vocab_size()


def params(grammar=None, **kw) -> SamplingParams:
    sp = SamplingParams(
        extra_args=None if grammar is None else {"grammar": grammar}, **kw
    )
    sp.update_from_generation_config({}, 2)  # what the engine does: EOS = 2
    return sp


def add(proc, *items, batch_size=None, removed=(), moved=()):
    added = [(i, sp, [1, 2], out) for i, sp, out in items]
    proc.update_state(
        BatchUpdate(
            batch_size=batch_size or (max([i for i, _, _ in items] or [0]) + 1),
            removed=list(removed),
            added=added,
            moved=list(moved),
        )
    )


def toks(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def allowed(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "grammar, needle",
    [
        ("x", "not the JSON text of a dict"),
        (7, "must be a dict"),
        ('["regex"]', "must be a dict"),
        ({}, "exactly one of the keys"),
        ({"json_schema": {}, "regex": "a"}, "got 2 (json_schema, regex)"),
        ({"jsonschema": {}}, "unknown key(s) 'jsonschema'"),
        ({"json_schema": {"type": "foo"}}, "Invalid type: foo"),
        ({"json_schema": "{not json"}, "not valid JSON"),
        ({"json_schema": [1]}, "must be a JSON Schema"),
        ({"json_object": "yes"}, '["json_object"] must be true'),
        ({"regex": "a(b"}, "is not a valid regex"),
        ({"regex": ""}, "non-empty string"),
        ({"lark": "start: foo"}, 'unknown name: "foo"'),
        ({"regex": "a", "whitespace_flexible": False}, "applies only to json_schema"),
        ({"json_object": True, "whitespace_flexible": 1}, "must be true or false"),
    ],
)
def test_bad_grammar_is_a_clear_value_error(grammar, needle):
    with pytest.raises(GrammarSpecError) as info:
        validate_grammar_request({"grammar": grammar})
    assert needle in str(info.value)
    assert 'extra_args["grammar"]' in str(info.value) or "extra_args" in str(info.value)
    # Through vLLM's own admission check (what the frontend calls per request):
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=re.escape(needle)):
        validate_logits_processors_parameters([FQCN], params(grammar))


def nested_schema(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize(
    "grammar, needle",
    [
        # Deeper than Python's json can read or write: was a RecursionError,
        # which nothing caught as a bad grammar.
        ({"json_schema": nested_schema(5000)}, "nested too deeply to compile"),
        ('{"json_schema": ' + '{"items": ' * 5000 + "{}" + "}" * 5001,
         "nested too deeply to compile"),
        # Deep enough for llguidance's own limit, or too large for it.
        ({"json_schema": nested_schema(200)}, "recursion limit exceeded"),
        ({"json_schema": {"type": "object", "properties": {
            f"p{i}": {"enum": [f"v{j}" for j in range(50)]} for i in range(20000)}}},
         "too (large|big)"),
    ],
    ids=["python-depth", "python-depth-text", "llguidance-depth", "too-large"],
)
def test_schema_that_cannot_compile_is_refused_naming_why(grammar, needle):
    with pytest.raises(GrammarSpecError, match=needle):
        validate_grammar_request({"grammar": grammar})
    from vllm.exceptions import VLLMValidationError

    with pytest.raises(VLLMValidationError, match=needle):
        validate_logits_processors_parameters([FQCN], params(grammar))


def test_good_grammars_validate():
    for g in (
        {"json_schema": SCHEMA},
        {"json_schema": json.dumps(SCHEMA), "whitespace_flexible": False},
        {"json_schema": True},
        {"json_object": True},
        {"regex": r"\d{3}-[a-z]+"},
        {"lark": 'start: "yes" | "no"'},
        json.dumps({"json_schema": SCHEMA}),  # as the OpenAI server's vllm_xargs carries it
    ):
        GrammarLogitsProcessor.validate_params(params(g))
    GrammarLogitsProcessor.validate_params(params(None))
    GrammarLogitsProcessor.validate_params(SamplingParams(extra_args={"other": 1}))


def test_grammar_and_structured_outputs_conflict():
    from vllm.sampling_params import StructuredOutputsParams

    sp = params({"regex": "a"})
    sp.structured_outputs = StructuredOutputsParams(regex="a")
    with pytest.raises(ValueError, match="not both"):
        GrammarLogitsProcessor.validate_params(sp)


def test_entry_point_and_fqcn_load_the_class(vllm_config):
    eps = {ep.name: ep for ep in entry_points(group="vllm.logits_processors")}
    assert "grammar" in eps, "pip install -e . to register the entry point"
    assert eps["grammar"].load() is GrammarLogitsProcessor
    # vLLM's V1 loader builds it from the FQCN string (as --logits-processors
    # does) *and* from the entry point: two instances, one of them idle.
    mc = vllm_config.model_config
    saved = mc.logits_processors
    mc.logits_processors = [FQCN]
    try:
        for _ in range(2):  # a second engine on the same config: same outcome
            procs = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, [FQCN])
            ours = [p for p in procs.all if isinstance(p, GrammarLogitsProcessor)]
            assert len(ours) == 2
            assert [p._idle for p in ours] == [True, False]
    finally:
        mc.logits_processors = saved
    procs = build_logitsprocs(vllm_config, torch.device("cpu"), False, False, [])
    assert [p._idle for p in procs.all if isinstance(p, GrammarLogitsProcessor)] == [False]


def test_class_implements_both_vllm_interfaces():
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2
    from vllm.v1.worker.gpu.sample.logits_processor.loader import (
        _load_v2_logitsprocs_by_fqcns,
    )

    assert issubclass(GrammarLogitsProcessor, V1)
    assert issubclass(GrammarLogitsProcessor, V2)
    assert _load_v2_logitsprocs_by_fqcns([FQCN]) == [GrammarLogitsProcessor]


# ------------------------------------------------------------------- V1 path
def test_no_grammar_requests_cost_nothing(proc, vocab):
    out: list[int] = []
    add(proc, (0, params(None), out), (1, params(None, temperature=0.5), []))
    logits = torch.randn(2, vocab)
    before = logits.clone()
    assert proc.apply(logits) is logits
    assert torch.equal(logits, before)
    assert proc._runtime is None  # no llguidance tokenizer was even built
    proc.update_state(None)
    assert proc.apply(logits) is logits


def test_teacher_forced_json_is_allowed_and_ends_in_forced_eos(proc, tokenizer, vocab):
    text = json.dumps({"name": "Ann", "age": 41, "tags": ["a", "b"]})
    target = toks(tokenizer, text)
    out: list[int] = []
    add(proc, (0, params({"json_schema": SCHEMA}), out))
    for tok in target:
        logits = torch.zeros(1, vocab)
        proc.apply(logits)
        ok = allowed(logits[0])
        assert tok in ok, (tokenizer.decode(out), tokenizer.decode([tok]))
        assert 2 not in ok  # EOS is never allowed before the object is complete
        out.append(tok)
    logits = torch.zeros(1, vocab)
    proc.apply(logits)
    # The object is closed and nothing may follow (additionalProperties false,
    # whitespace aside): EOS is allowed; once stopped it is the only choice.
    assert 2 in allowed(logits[0])


def test_completed_grammar_forces_eos_even_against_min_tokens(proc, tokenizer, vocab):
    out: list[int] = []
    add(proc, (0, params({"regex": "abc"}), out))
    out.extend(toks(tokenizer, "abc"))
    logits = torch.zeros(1, vocab)
    logits[0, 2] = float("-inf")  # what MinTokensLogitsProcessor does to EOS
    proc.apply(logits)
    assert allowed(logits[0]) == {2}
    assert int(torch.argmax(logits[0])) == 2


def test_invalid_tokens_are_masked(proc, tokenizer, vocab):
    out: list[int] = []
    add(proc, (0, params({"json_schema": SCHEMA}), out))
    out.extend(toks(tokenizer, '{"name": "x", "age": '))
    logits = torch.zeros(1, vocab)
    proc.apply(logits)
    ok = allowed(logits[0])
    decoded = {tokenizer.decode([t]) for t in ok}
    assert any(d.strip().isdigit() for d in decoded)
    # minimum 0: no "-"; an integer: no quote, letter or bracket
    for t in ok:
        s = tokenizer.decode([t]).lstrip()
        assert s == "" or s[0].isdigit(), repr(s)
    assert 2 not in ok


def test_random_walk_matches_regex(proc, tokenizer, vocab):
    pattern = r"[0-9]{3}-[a-z]{2,4}"
    g = torch.Generator().manual_seed(1)
    for trial in range(5):
        out: list[int] = []
        add(proc, (0, params({"regex": pattern}), out))
        for _ in range(40):
            logits = torch.randn(1, vocab, generator=g) * 3
            proc.apply(logits)
            tok = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
            out.append(tok)
            if tok == 2:
                break
        assert out[-1] == 2, tokenizer.decode(out)
        assert re.fullmatch(pattern, tokenizer.decode(out[:-1])), tokenizer.decode(out)


def test_batch_add_move_swap_remove(proc, tokenizer, vocab):
    """Two grammar requests and one plain one move around; each keeps its own matcher."""
    a_out: list[int] = []
    b_out: list[int] = []
    pa = params({"regex": "a+c"})
    pb = params({"regex": "b+c"})
    add(proc, (0, pa, a_out), (1, params(None), []), (2, pb, b_out))
    ta, tb, tc = (toks(tokenizer, x)[0] for x in "abc")

    def step(layout: dict[int, str]):
        logits = torch.zeros(len(layout), vocab)
        raw = logits.clone()
        proc.apply(logits)
        for row, who in layout.items():
            if who == "plain":
                assert torch.equal(logits[row], raw[row]), "plain request touched"
                continue
            ok = allowed(logits[row])
            assert ok and all(
                re.fullmatch(f"{who}*c?", tokenizer.decode([t])) for t in ok
            ), (who, [tokenizer.decode([t]) for t in ok])

    step({0: "a", 1: "plain", 2: "b"})
    a_out.append(ta)
    b_out.append(tb)
    # swap 0 <-> 2
    proc.update_state(BatchUpdate(3, [], [], [(0, 2, MoveDirectionality.SWAP)]))
    step({0: "b", 1: "plain", 2: "a"})
    a_out.append(ta)
    b_out.append(tb)
    # remove the plain request at 1, move a (2) into the hole (vLLM's condense)
    proc.update_state(BatchUpdate(2, [1], [], [(2, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    step({0: "b", 1: "a"})
    # replace b at index 0 by a new plain request; a keeps its state ("aa")
    add(proc, (0, params(None), []), batch_size=2, removed=[0])
    a_out.append(tc)
    logits = torch.zeros(2, vocab)
    proc.apply(logits)
    assert torch.isfinite(logits[0]).all()
    assert allowed(logits[1]) == {2}  # "aac" is complete: EOS forced
    assert tokenizer.decode(a_out) == "aac"
    proc.update_state(BatchUpdate(1, [1], [], []))
    assert not proc._reqs


def forced_until_eos(proc, out: list[int], vocab: int, limit: int = 64) -> list[int]:
    """Apply step after step, each time emitting the one token left allowed,
    until that is EOS (2); returns the tokens before it."""
    start = len(out)
    for _ in range(limit):
        logits = torch.zeros(1, vocab)
        proc.apply(logits)
        ok = allowed(logits[0])
        assert len(ok) == 1, len(ok)
        (tok,) = ok
        if tok == 2:
            return out[start:]
        out.append(tok)
    raise AssertionError("EOS never forced")


def test_rejected_token_ends_with_the_failure_text(proc, tokenizer, vocab):
    """A matcher error mid-request is not a silent stop: the answer ends
    with FAILURE_TEXT, then EOS."""
    from vllm_plugins.logits_processors.grammar import FAILURE_TEXT

    out: list[int] = []
    add(proc, (0, params({"regex": "abc"}), out))
    out.extend(toks(tokenizer, "xyz"))  # e.g. another processor overrode the mask
    said = forced_until_eos(proc, out, vocab)
    assert tokenizer.decode(said) == FAILURE_TEXT


def test_async_placeholder_is_waited_for_then_fails_closed(proc, tokenizer, vocab):
    out: list[int] = []
    add(proc, (0, params({"regex": "ab+"}), out))
    out.append(toks(tokenizer, "a")[0])
    out.append(-1)  # async scheduling placeholder, not patched before sampling
    logits = torch.zeros(1, vocab)
    proc.apply(logits)
    assert allowed(logits[0]) == {2}


def test_placeholders_patched_before_apply_are_fine(proc, tokenizer, vocab):
    out: list[int] = []
    add(proc, (0, params({"regex": "ab+"}), out))
    out.append(-1)
    proc.update_state(None)  # update_state may see the placeholder ...
    out[-1] = toks(tokenizer, "a")[0]  # ... vLLM patches it before sampling
    logits = torch.zeros(1, vocab)
    proc.apply(logits)
    assert toks(tokenizer, "b")[0] in allowed(logits[0])


def test_logits_wider_than_tokenizer_are_masked(proc, tokenizer, vocab):
    out: list[int] = []
    add(proc, (0, params({"json_object": True}), out))
    logits = torch.zeros(1, vocab + 64)
    proc.apply(logits)
    assert not torch.isfinite(logits[0, vocab:]).any()


def test_bad_request_reaching_worker_is_stopped_not_crashing(proc, tokenizer, vocab):
    from vllm_plugins.logits_processors.grammar import FAILURE_TEXT

    out: list[int] = []
    add(proc, (0, params({"regex": "a(b"}), out))  # validate_params would have refused it
    said = forced_until_eos(proc, out, vocab)
    assert said == out and tokenizer.decode(said) == FAILURE_TEXT  # from its first token


# ------------------------------------------------------------------- V2 path
class _Buf:
    def __init__(self, t):
        self.gpu = t
        self.np = t.numpy()


def _v2(vllm_config, max_reqs=4, max_len=64):
    rs = SimpleNamespace(
        device=torch.device("cpu"),
        max_num_reqs=max_reqs,
        vocab_size=vllm_config.model_config.get_vocab_size(),
        all_token_ids=_Buf(torch.zeros(max_reqs, max_len, dtype=torch.int32)),
        prompt_len=_Buf(torch.zeros(max_reqs, dtype=torch.int32)),
        prefill_len=_Buf(torch.zeros(max_reqs, dtype=torch.int32)),
        total_len=_Buf(torch.zeros(max_reqs, dtype=torch.int32)),
    )
    return GrammarLogitsProcessor(vllm_config, rs), rs


def _ctx(slots, rows_per_req, pos, input_ids):
    expanded = [s for s, n in zip(slots, rows_per_req) for _ in range(n)]
    return SimpleNamespace(
        idx_mapping_np=np.array(slots, dtype=np.int32),
        expanded_idx_mapping=torch.tensor(expanded, dtype=torch.int32),
        idx_mapping=torch.tensor(slots, dtype=torch.int32),
        pos=torch.tensor(pos, dtype=torch.int64),
        input_ids=torch.tensor(input_ids, dtype=torch.int32),
        expanded_local_pos=None,
        seq_lens_upper_bound_np=None,
    )


def test_v2_tracks_committed_tokens_per_slot(vllm_config, tokenizer, vocab):
    proc, rs = _v2(vllm_config)
    assert proc.add_request(3, params({"regex": "ab+c"})) is True
    assert proc.add_request(1, params(None)) is False
    prompt = [7, 8, 9]
    rs.prompt_len.np[3] = len(prompt)
    rs.all_token_ids.gpu[3, :3] = torch.tensor(prompt)
    ta, tb, tc = (toks(tokenizer, x)[0] for x in "abc")
    seq = list(prompt)
    for tok, expect_in, expect_out in [(None, ta, tb), (ta, tb, ta), (tb, tc, ta)]:
        if tok is not None:
            rs.all_token_ids.gpu[3, len(seq)] = tok
            seq.append(tok)
        # batch: slot 1 (plain) at row 0, slot 3 (grammar) at row 1
        ctx = _ctx([1, 3], [1, 1], [5, len(seq) - 1], [0, seq[-1]])
        logits = torch.zeros(2, vocab)
        proc.apply(logits, ctx)
        assert torch.isfinite(logits[0]).all()
        assert expect_in in allowed(logits[1]) and expect_out not in allowed(logits[1])
    # slot recycled by a plain request: state is dropped
    assert proc.add_request(3, params(None)) is False
    assert not proc._reqs


def test_v2_spec_decode_rows_follow_drafts(vllm_config, tokenizer, vocab):
    proc, rs = _v2(vllm_config)
    proc.add_request(0, params({"regex": "a[bc]+"}))
    ta, tb, tc, tx = (toks(tokenizer, x)[0] for x in "abcx")
    rs.prompt_len.np[0] = 1
    rs.all_token_ids.gpu[0, :2] = torch.tensor([5, ta])  # prompt [5], committed "a"
    # rows: [a (committed, pos 1), draft b, draft x (bad), draft c]
    ctx = _ctx([0], [4], [1, 2, 3, 4], [ta, tb, tx, tc])
    logits = torch.zeros(4, vocab)
    proc.apply(logits, ctx)
    assert tb in allowed(logits[0])  # after "a"
    assert tc in allowed(logits[1])  # after "ab"
    assert tx not in allowed(logits[1])  # so draft x is rejected here ...
    assert allowed(logits[2]) == {2} and allowed(logits[3]) == {2}  # ... rows after unused
    # the matcher was rolled back: still right after "a"
    assert proc._reqs[0].matcher.validate_tokens([tb, tc]) == 2


def test_v2_failure_text_runs_across_draft_rows(vllm_config, tokenizer, vocab):
    """Row j of a failed request follows draft[:j]: it is forced to the
    failure text's next token but j, so the text stays whole whichever
    drafts the rejection sampler accepts."""
    from vllm_plugins.logits_processors.grammar import FAILURE_TEXT

    proc, rs = _v2(vllm_config)
    proc.add_request(0, params({"regex": "ab"}))
    tx = toks(tokenizer, "x")[0]
    rs.prompt_len.np[0] = 1
    rs.all_token_ids.gpu[0, :2] = torch.tensor([5, tx])  # committed "x": rejected
    ctx = _ctx([0], [3], [1, 2, 3], [tx, 7, 8])
    logits = torch.zeros(3, vocab)
    proc.apply(logits, ctx)
    text = tokenizer(FAILURE_TEXT, add_special_tokens=False)["input_ids"]
    assert [allowed(logits[j]) for j in range(3)] == [{t} for t in text[:3]]


def test_bench_script_smoke(capsys):
    from vllm_plugins.bench.grammar_bench import main

    assert main(["--processor", "--schemas", "6", "--tokens", "4", "--batch", "1", "2",
                 "--threads", "0"]) == 0
    out = capsys.readouterr().out
    assert "| **all** | **6** |" in out and "| 2 |" in out


def test_engine_that_drops_processors_refuses_grammar_requests(vllm_config):
    from vllm_plugins.logits_processors import grammar

    fake = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"),
                           use_v2_model_runner=False)
    reason = grammar.engine_drops_processors(fake)
    with pytest.raises(GrammarSpecError, match="speculative decoding"):
        grammar.refuse_grammar_requests(params({"regex": "a"}), reason)
    grammar.refuse_grammar_requests(params(None), reason)  # others unaffected
    assert grammar.engine_drops_processors(vllm_config) is None


@pytest.mark.parametrize("width", [32 * 5, 32 * 5 - 7, 32 * 5 + 9])
def test_bitmask_unpacking_numpy_and_torch_paths_agree(width):
    """The CPU (numpy) and device (torch bit ops) paths of the mask; checked here on CPU."""
    from vllm_plugins.grammar.runtime import GrammarRuntime

    g = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 5), dtype=torch.int32, generator=g)
    stub = SimpleNamespace(_shifts={})
    cpu = torch.device("cpu")
    a = GrammarRuntime.banned_tokens(stub, words, width, cpu, use_numpy=True)
    b = GrammarRuntime.banned_tokens(stub, words, width, cpu, use_numpy=False)
    assert a.shape == b.shape == (3, width) and a.dtype == b.dtype == torch.bool
    assert torch.equal(a, b)
    w = words.numpy().astype(np.int64) & 0xFFFFFFFF
    for r in range(3):
        for t in range(width):
            allowed = t < 160 and (int(w[r, t // 32]) >> (t % 32)) & 1
            assert bool(a[r, t]) == (not allowed)
