"""Grammar-forced drafts without an engine: the forced-text walk, the grammar
check of inner drafts, request lifecycle, options and the spec translation.

The tokenizer is the default model's (SmolLM2, what the engine tests run)."""

import json

import numpy as np
import pytest

from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.grammar import GrammarProposer, parse_inner
from vllm_plugins.grammar.structured_outputs import close_objects, grammar_for
from vllm_plugins.step_context import Drafts, RequestStep, StepContext

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "address": {"type": "object",
                                     "properties": {"city": {"type": "string"}},
                                     "required": ["city"]}},
          "required": ["name", "age", "address"]}
TEXT = '{"name": "Ann Lee", "age": 41, "address": {"city": "Paris"}}'


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def so_params(**kw):
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    return SamplingParams(structured_outputs=StructuredOutputsParams(**kw))


class FixedInner(PluginProposer):
    """An inner proposer that drafts what the test tells it to."""

    def __init__(self):
        super().__init__(None, options={}, vocab_size=49152)
        self.next: list[list[int]] = []
        self.continued: list[tuple[list[int], int]] = []
        self.continuation: list[int] = []
        self.freed: list[str] = []

    def draft(self, ctx):
        return Drafts([list(t) for t in self.next] or [[] for _ in ctx.requests])

    def continue_draft(self, request, prefix, n):
        self.continued.append((list(prefix), n))
        return self.continuation[:n]

    def free(self, req_id):
        self.freed.append(req_id)


def make(tok, inner=None, max_draft=6):
    p = GrammarProposer(None, options={}, vocab_size=49152, tokenizer=tok)
    p.max_draft = max_draft
    p.inner = inner
    return p


class Req:
    """Builds the RequestStep a request would see after emitting `out`."""

    def __init__(self, tok, params, rid="r1", prompt="Write JSON:"):
        self.rid, self.params = rid, params
        self.prompt = tok.encode(prompt, add_special_tokens=False)

    def step(self, out: list[int], accepted: int = 1) -> RequestStep:
        ctx = np.asarray(self.prompt + list(out), dtype=np.int64)
        acc = np.asarray(out[len(out) - accepted:], np.int64)  # empty: prefill
        return RequestStep(self.rid, acc, ctx, len(self.prompt), 0, np.zeros(0, np.int64),
                           None, None, 0.0, self.params)


def run(p, *steps, finished=()):
    return p.step(StepContext(list(steps), finished=set(finished), max_draft=p.max_draft))


def dec(tok, ids):
    return [tok.decode([t]) for t in ids]


# ------------------------------------------------------------ forced-text walk
def test_forced_text_is_tokenized_unambiguously(tok):
    """After '{"' the schema forces 'name"': the draft is 'name' and leaves the
    quote out, because '":' is a token too (the text is forced, the tokens
    are not)."""
    p = make(tok)
    req = Req(tok, so_params(json=SCHEMA))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert dec(tok, ids[:2]) == ['{"', "name"]
    d = run(p, req.step(ids[:1]))
    assert dec(tok, d.tokens[0]) == ["name"]
    assert d.confidence is None  # fixed draft length: nobody reads confidences
    assert p.metrics()["forced_tokens"] == 1


def test_forced_text_compact_forces_across_tokens(tok):
    """Without whitespace more text is forced: '"address":{"city":"' after
    the age; the draft is its unambiguous tokenization and matches the
    tokenizer's own encoding of the whole text."""
    from vllm.config import StructuredOutputsConfig

    p = make(tok)
    p._so_config = StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True)
    req = Req(tok, so_params(json=SCHEMA))
    text = '{"name":"Ann Lee","age":41,"address":{"city":"Paris"}}'
    ids = tok.encode(text, add_special_tokens=False)
    i = next(i for i in range(len(ids)) if tok.decode(ids[:i]).endswith("41,\""))
    d = run(p, req.step(ids[:i]))
    assert d.tokens[0] == ids[i:i + len(d.tokens[0])]
    assert tok.decode(d.tokens[0]) == 'address":{"city'
    # the next byte after 'city' is '"', ambiguous ('":"' is a token): left out


def test_no_structured_outputs_gets_inner_draft_unchanged(tok):
    from vllm import SamplingParams

    inner = FixedInner()
    p = make(tok, inner)
    inner.next = [[5, 6, 7]]
    d = run(p, Req(tok, SamplingParams()).step([11, 12]))
    assert d.tokens == [[5, 6, 7]]
    p2 = make(tok, None)
    assert run(p2, Req(tok, SamplingParams()).step([11, 12])).tokens == [[]]


def test_inner_draft_cut_at_first_token_the_grammar_rejects(tok):
    inner = FixedInner()
    p = make(tok, inner)
    req = Req(tok, so_params(json=SCHEMA))
    ids = tok.encode(TEXT, add_special_tokens=False)
    i = dec(tok, ids).index("Ann")
    bad = tok.encode("}", add_special_tokens=False)[0]  # '}' inside a string is fine...
    # ... but after the closing quote of "Ann Lee" only ',' or whitespace may come
    inner.next = [ids[i:i + 3] + [bad] + ids[i + 3:i + 5]]
    assert dec(tok, ids[i:i + 3]) == ["Ann", " Lee", '",']
    d = run(p, req.step(ids[:i]))
    assert d.tokens[0] == ids[i:i + 3]
    assert p.metrics()["inner_tokens"] == 3


def test_forced_then_inner_then_forced(tok):
    """The walk alternates: forced 'name', then the inner's aligned tokens up
    to the grammar's next forced text, then asks the inner to continue."""
    inner = FixedInner()
    p = make(tok, inner, max_draft=10)
    req = Req(tok, so_params(json=SCHEMA))
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert dec(tok, ids[1:10]) == ["name", '":', ' "', "Ann", " Lee", '",', ' "', "age", '":']
    # inner agrees with the forced 'name' and runs to the next key, which the
    # grammar forces ('age'); then the inner is asked for a continuation
    inner.next = [ids[1:8]]
    inner.continuation = ids[9:12]
    d = run(p, req.step(ids[:1]))
    assert d.tokens[0] == ids[1:11]
    assert inner.continued == [(ids[1:9], 2)]
    # inner disagreeing with the forced text: forced wins, inner asked to continue
    inner.next = [ids[3:6]]
    inner.continuation = ids[2:5]
    d = run(p, req.step(ids[:1]))
    assert d.tokens[0] == ids[1:5]
    assert inner.continued[-1] == ([ids[1]], 9)
    # a continuation the grammar rejects is cut
    inner.continuation = [ids[0]]  # '{"' after 'name'
    d = run(p, req.step(ids[:1]))
    assert d.tokens[0] == ids[1:2]


def test_inner_that_cannot_continue_ends_the_draft(tok):
    """PluginProposer's default continue_draft gives nothing: the draft ends
    after the forced text that follows the inner's own tokens."""
    class NoContinuation(FixedInner):
        continue_draft = PluginProposer.continue_draft

    inner = NoContinuation()
    p = make(tok, inner, max_draft=10)
    ids = tok.encode(TEXT, add_special_tokens=False)
    inner.next = [ids[1:8]]
    d = run(p, Req(tok, so_params(json=SCHEMA)).step(ids[:1]))
    assert d.tokens[0] == ids[1:9]  # forced 'name', the inner's 6, forced 'age'


def test_draft_leaves_matcher_where_it_was(tok):
    inner = FixedInner()
    p = make(tok, inner)
    req = Req(tok, so_params(json=SCHEMA))
    ids = tok.encode(TEXT, add_special_tokens=False)
    for i in range(1, len(ids)):
        inner.next = [ids[i:i + 4]]
        d = run(p, req.step(ids[:i]))
        # drafts are the true continuation here, so they must all survive
        assert d.tokens[0] == ids[i:i + len(d.tokens[0])]
        assert len(d.tokens[0]) >= min(4, len(ids) - i)
    assert p.metrics()["grammar_lost"] == 0


def test_output_the_grammar_rejects_falls_back_to_inner(tok):
    inner = FixedInner()
    p = make(tok, inner)
    req = Req(tok, so_params(json=SCHEMA))
    ids = tok.encode("[1, 2]", add_special_tokens=False)  # not an object
    inner.next = [[7, 8]]
    d = run(p, req.step(ids))
    assert d.tokens == [[7, 8]]
    m = p.metrics()
    assert m["grammar_lost"] == 1 and m["num_errors"] == 0


def test_finished_requests_are_freed(tok):
    inner = FixedInner()
    p = make(tok, inner)
    a, b = Req(tok, so_params(json=SCHEMA), "a"), Req(tok, so_params(regex="[0-9]+"), "b")
    run(p, a.step([]), b.step([]))  # prefill: nothing built yet
    assert p.metrics()["active_matchers"] == 0
    ids = tok.encode(TEXT, add_special_tokens=False)
    run(p, a.step(ids[:2]), b.step(tok.encode("12", add_special_tokens=False)))
    assert p.metrics()["active_matchers"] == 2
    run(p, b.step(tok.encode("123", add_special_tokens=False)), finished={"a"})
    assert p.metrics()["active_matchers"] == 1 and "a" in inner.freed


def test_uncompilable_spec_costs_only_forced_drafts(tok):
    inner = FixedInner()
    p = make(tok, inner)
    inner.next = [[3, 4]]
    d = run(p, Req(tok, so_params(json={"type": "object", "not": {}})).step([5]))
    assert d.tokens == [[3, 4]]
    assert p.metrics()["grammar_unusable"] == 1


def test_too_deep_schema_costs_its_forced_drafts_once(tok):
    """A schema nested deeper than Python can copy or read raised
    RecursionError, which was not taken as a bad grammar: retried every step,
    and the whole batch lost its drafts (a proposer error). Now it is one
    unusable grammar, compiled once."""
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    inner = FixedInner()
    p = make(tok, inner)
    inner.next = [[3, 4]]
    deep = Req(tok, so_params(json=schema))
    for out in ([5], [5, 6], [5, 6, 7]):
        assert run(p, deep.step(out)).tokens == [[3, 4]]
    m = p.metrics()
    assert m["grammar_unusable"] == 1 and m["num_errors"] == 0


def test_structured_requests_lose_inner_rows_even_without_a_matcher(tok):
    """vLLM cuts a structured-output request's draft at the first token its
    grammar rejects, so an inner's probability rows are not exact there
    (proposers/stand.py, rule 3): none go out, whether our matcher could
    follow the grammar or not. Other requests keep theirs."""
    from vllm import SamplingParams

    class RowInner(FixedInner):
        def draft(self, ctx):
            rows = [np.full((len(t), 49152), 1 / 49152, np.float32) for t in self.next]
            return Drafts([list(t) for t in self.next], rows)

    inner = RowInner()
    p = make(tok, inner)
    inner.next = [[3, 4], [3, 4]]
    unusable = Req(tok, so_params(json={"type": "object", "not": {}}), rid="s")
    plain = Req(tok, SamplingParams(temperature=1.0), rid="p")
    d = run(p, unusable.step([5]), plain.step([5]))
    assert d.tokens == [[3, 4], [3, 4]] and p.metrics()["grammar_unusable"] == 1
    assert d.probs[0] is None and d.probs[1].shape == (2, 49152)


def test_with_token_recycling_inner(tok):
    """Composed for real: the inner Token Recycling continues after forced
    text from its tables; top-k extraction follows the inner's setting."""
    p = GrammarProposer(None, options={"inner": {"method": "token_recycling", "topk": 4}},
                        vocab_size=49152, tokenizer=tok)
    assert p.TOPK == 4
    ids = tok.encode(TEXT, add_special_tokens=False)
    # teach the bigram matrix the rest of the text
    p.inner.tables.seed_matrix(np.asarray(ids))
    req = Req(tok, so_params(json=SCHEMA))
    d = run(p, req.step(ids[:1]))
    # forced 'name', then the recycled '":' and ' "' (later ones depend on
    # which duplicate bigram the matrix kept)
    assert d.tokens[0][:3] == ids[1:4]


# ------------------------------------------------------------ options
def test_inner_option_shapes():
    assert parse_inner(None) == (None, {})
    assert parse_inner("token_recycling") == ("token_recycling", {})
    assert parse_inner({"method": "token_recycling", "topk": 4}) == (
        "token_recycling", {"topk": 4})


@pytest.mark.parametrize("inner, words", [
    ("grammar_forced", ["'inner'", "'grammar_forced'"]),
    ("nope", ["'inner'", "token_recycling"]),
    ({"topk": 4}, ["'inner'", "method"]),
    ({"method": "token_recycling", "topk": 0}, ["'topk'", "token_recycling",
                                                 "inner of 'grammar_forced'"]),
    ({"method": "token_recycling", "topkk": 3}, ["topkk", "inner of 'grammar_forced'"]),
    (3, ["'inner'"]),
])
def test_bad_inner_option_is_refused_at_translation(inner, words):
    from vllm_plugins.registry import translate

    with pytest.raises(ValueError) as e:
        translate({"method": "grammar_forced", "inner": inner})
    for w in words:
        assert w in str(e.value), str(e.value)


def test_translation_routes_to_custom_class():
    from vllm_plugins.registry import translate

    rest, opts = translate({"method": "grammar_forced", "inner": "token_recycling",
                            "num_speculative_tokens": 5})
    assert rest["method"] == "custom_class"
    assert rest["model"] == "vllm_plugins.proposers.grammar.GrammarProposer"
    assert opts["inner"] == "token_recycling" and rest["num_speculative_tokens"] == 5


# ------------------------------------------------------------ spec translation
def test_close_objects_as_xgrammar_strict_mode():
    s = {"type": "object", "properties": {"a": {"type": "object", "properties": {}},
                                          "b": {"type": "array", "items": {
                                              "type": "object", "properties": {"c": {}}}}},
         "$defs": {"d": {"properties": {"e": {}}, "additionalProperties": True}}}
    out = close_objects(s)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["additionalProperties"] is False
    assert out["properties"]["b"]["items"]["additionalProperties"] is False
    assert out["$defs"]["d"]["additionalProperties"] is True
    assert "additionalProperties" not in s  # the request's schema is not touched


def _accepts(tok, compiled, text) -> bool:
    import llguidance

    from vllm_plugins.grammar.runtime import build_ll_tokenizer

    m = llguidance.LLMatcher(build_ll_tokenizer(tok), compiled.grammar)
    ids = tok.encode(text, add_special_tokens=False)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_grammar_follows_the_backend(tok):
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    extra = '{"a": 1, "b": 2}'
    for backend, closed in (("xgrammar", True), ("guidance", False)):
        so = StructuredOutputsParams(json=json.dumps(schema))
        so._backend = backend
        g = grammar_for(so, StructuredOutputsConfig())
        assert _accepts(tok, g, '{"a": 1}')
        assert _accepts(tok, g, extra) is not closed
    so = StructuredOutputsParams(json=schema)
    so._backend = "guidance"
    g = grammar_for(so, StructuredOutputsConfig(backend="guidance", disable_additional_properties=True))
    assert not _accepts(tok, g, extra)
    g = grammar_for(StructuredOutputsParams(json=schema),
                    StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True))
    assert _accepts(tok, g, '{"a":1}') and not _accepts(tok, g, '{"a": 1}')


def test_other_kinds(tok):
    from vllm.sampling_params import StructuredOutputsParams as P

    assert _accepts(tok, grammar_for(P(regex="[0-9]{3}")), "123")
    assert _accepts(tok, grammar_for(P(choice=["yes", "no"])), "no")
    assert not _accepts(tok, grammar_for(P(choice=["yes", "no"])), "maybe")
    assert _accepts(tok, grammar_for(P(grammar='root ::= "a" [0-9]+')), "a12")
    assert _accepts(tok, grammar_for(P(grammar='start: "x" | "y"')), "y")
    assert _accepts(tok, grammar_for(P(json_object=True)), '{"k": [1]}')
    assert grammar_for(None) is None


def test_complete_grammar_drafts_the_requests_eos(tok):
    """Once the closing text is drafted and nothing may follow, the draft
    ends with the request's EOS (forced there by vLLM's structured output
    and by our processor alike); no EOS is drafted while the grammar can
    go on, nor for a request without an EOS token."""
    inner = FixedInner()
    p = make(tok, inner)
    params = so_params(json=SCHEMA)
    params.update_from_generation_config({}, 2)  # what the engine does: EOS = 2
    req = Req(tok, params)
    ids = tok.encode(TEXT, add_special_tokens=False)
    inner.next = [ids[-2:]]
    assert run(p, req.step(ids[:-2])).tokens[0] == ids[-2:] + [2]
    inner.next = [[]]
    assert run(p, req.step(ids)).tokens[0] == [2]
    # The grammar can still go on after '"Paris"': no EOS among the drafts.
    inner.next = [ids[-2:-1]]
    assert 2 not in run(p, req.step(ids[:-3])).tokens[0]
    # No EOS known (ignore_eos or no tokenizer EOS): the draft stops as before.
    q = Req(tok, so_params(json=SCHEMA), rid="r2")
    inner.next = [ids[-2:]]
    assert run(make(tok, inner), q.step(ids[:-2])).tokens[0] == ids[-2:]
