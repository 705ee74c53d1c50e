"""Every registered method as the grammar proposer's ``inner``: it works, or
``registry.translate`` refuses it with one error that names the option.

"Works" here: the grammar proposer is built from a small fake config the way
the worker builds it (options carried on the speculative config), with that
method inside, and stepped over a synthetic sequence of steps (requests in
prefill, one and two tokens a step, a request finishing, another joining;
greedy and sampled). Neither proposer counts an error; a structured-output
request's drafts are accepted by its grammar; the other requests get exactly
the inner proposer's drafts. Self-drafting methods draft through a fake
``ctx.target``. tests/test_grammar_proposer_e2e.py checks one composition
inside vLLM."""

from types import SimpleNamespace

import llguidance
import numpy as np
import pytest
import torch

from tests.test_grammar_proposer import SCHEMA, TEXT, so_params
from tests.test_layer_skip import llama_like_model
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.grammar import GrammarProposer
from vllm_plugins.registry import BY_CLASS_PATH, METHODS, PLUGIN_OPTIONS_ATTR, Method, translate
from vllm_plugins.step_context import Drafts, RequestStep, StepContext

VOCAB = 49152  # the default model's (SmolLM2) tokenizer
# Methods that cannot run inside the grammar proposer; every other registered
# method must work there.
REFUSED = {"grammar_forced": "composition is one level deep"}
# Options that make a method draft on this short synthetic run.
INNER_OPTIONS = {
    "swift": {"draft_vocab": 0},
    "del": {"draft_vocab": 0, "min_value": 0.0},
}
PLAIN = "one two three four, one two three four, one two three four, one two three four"


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def fake_config(user: dict) -> SimpleNamespace:
    """What the worker's VllmConfig holds for our proposers, from the user's
    speculative config as translated at start-up."""
    fields, options = translate(user)
    spec = SimpleNamespace(num_speculative_tokens=fields["num_speculative_tokens"])
    setattr(spec, PLUGIN_OPTIONS_ATTR, options)
    return SimpleNamespace(model_config=SimpleNamespace(get_vocab_size=lambda: VOCAB),
                           speculative_config=spec, structured_outputs_config=None)


# ------------------------------------------------------------ a fake target
class FakeTargetLayers:
    """``ctx.target`` for self-drafting methods: drafts and scores with a
    bigram table of the texts the requests write (the shape of
    ``vllm_plugins.bridge.v1.target_layers.TargetLayers.draft`` / ``score``)."""

    num_layers = 12
    runner = SimpleNamespace(max_model_len=4096)

    def __init__(self, streams: list[list[int]]):
        self.next: dict[int, int] = {}
        for ids in streams:
            for a, b in zip(ids, ids[1:]):
                self.next.setdefault(a, b)

    def _walk(self, token: int, steps: int) -> list[int]:
        out = []
        for _ in range(steps):
            token = self.next.get(int(token), 0)
            out.append(token)
        return out

    def draft(self, rows, steps, plan, stop_below, head, max_lengths):
        tokens = np.array([self._walk(t, steps) for t in rows.last_tokens], dtype=np.int64)
        n = len(rows.last_tokens)
        return SimpleNamespace(tokens=tokens, lengths=np.full(n, steps),
                               top1_prob=np.full((n, steps), 0.9, np.float32))

    def score(self, rows, windows, starts, plan):
        pred = np.vectorize(lambda t: self.next.get(int(t), 0))(windows)
        return pred, None


# ------------------------------------------------------------ synthetic steps
class Stream:
    """One request: a prompt, the output it will write, and how far it got."""

    def __init__(self, rid, prompt, output, params, temperature=0.0):
        self.rid, self.prompt, self.output = rid, prompt, output
        self.params, self.temperature = params, temperature
        self.done = 0  # output tokens emitted
        self.started = False

    def step(self, emit: int, topk: int) -> RequestStep:
        """This request's slice of a step that emitted ``emit`` tokens (the
        first step is its prefill: nothing emitted)."""
        if not self.started:
            self.started = True
            accepted = np.zeros(0, np.int64)
        else:
            accepted = np.asarray(self.output[self.done:self.done + emit], np.int64)
            self.done += len(accepted)
        context = np.asarray(self.prompt + self.output[:self.done], np.int64)
        n_draft = max(len(accepted) - 1, 0)
        verified = np.zeros(0, np.int64)
        ids = lps = None
        if len(accepted):
            base = len(context) - len(accepted)
            verified = np.concatenate([context[base - 1:base], accepted[:-1]])
            if topk:
                rng = np.random.default_rng(len(context))
                ids = rng.integers(0, VOCAB, (len(verified), topk))
                ids[:, 0] = accepted  # the target's argmax is what was sampled
                lps = np.sort(rng.uniform(-8, -0.1, (len(verified), topk)))[:, ::-1].copy()
        return RequestStep(self.rid, accepted, context, len(self.prompt), n_draft,
                           verified, ids, lps, self.temperature, self.params,
                           group_id=self.rid)

    @property
    def finished(self) -> bool:
        return self.done >= len(self.output)


def run_steps(proposer: GrammarProposer, tok, target=None):
    """Step ``proposer`` over the synthetic sequence; per step, the outer's
    drafts, the inner's drafts, and the requests."""
    from vllm import SamplingParams

    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    streams = [Stream("json", enc("Write Ann as JSON:"), enc(TEXT), so_params(json=SCHEMA)),
               Stream("plain", enc(PLAIN), enc(PLAIN), SamplingParams(temperature=0.0))]
    late = Stream("sampled", enc(PLAIN), enc(PLAIN)[:12],
                  SamplingParams(temperature=0.8, seed=1), temperature=0.8)
    seen: list[Drafts] = []
    inner = proposer.inner
    if inner is not None:
        inner_step = inner.step

        def spy(ctx):
            seen.append(inner_step(ctx))
            return seen[-1]
        inner.step = spy
    out = []
    finished: set[str] = set()
    for s in range(40):
        if s == 6:
            streams.append(late)
        live = [x for x in streams if not x.finished]
        if not live:  # the last finish notice comes with an empty step
            proposer.step(StepContext([], finished=finished, max_draft=proposer.max_draft))
            break
        reqs = [x.step(1 + s % 2, proposer.topk_wanted()) for x in live]
        ctx = StepContext(reqs, finished=finished, max_draft=proposer.max_draft,
                          target=target)
        drafts = proposer.step(ctx)
        out.append((drafts, seen[-1] if inner is not None else None, reqs))
        finished = {x.rid for x in live if x.finished}
    return out


@pytest.fixture(scope="module")
def json_matcher(tok):
    """A fresh matcher of SCHEMA's grammar, built as vLLM's backend would."""
    from vllm.sampling_params import StructuredOutputsParams

    from vllm_plugins.grammar.runtime import build_ll_tokenizer
    from vllm_plugins.grammar.structured_outputs import grammar_for

    template = llguidance.LLMatcher(build_ll_tokenizer(tok, VOCAB),
                                    grammar_for(StructuredOutputsParams(json=SCHEMA)).grammar)
    return template.deep_copy


def grammar_accepts(matcher, output: list[int], draft: list[int]) -> bool:
    assert matcher.consume_tokens(output)
    return matcher.validate_tokens(draft) == len(draft)


# ------------------------------------------------------------ every method
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_as_inner_works_or_is_refused_at_start(name, tok, json_matcher):
    user = {"method": "grammar_forced", "inner": {"method": name, **INNER_OPTIONS.get(name, {})}}
    if name in REFUSED:
        with pytest.raises(ValueError) as e:
            translate(user)
        msg = str(e.value)
        assert "'inner'" in msg and repr(name) in msg and REFUSED[name] in msg, msg
        return
    proposer = GrammarProposer(fake_config(user), tokenizer=tok)
    assert type(proposer.inner) is METHODS[name].proposer_class()
    proposer.load_model(llama_like_model())
    target = None
    if proposer.SELF_DRAFT:
        target = FakeTargetLayers([tok.encode(t, add_special_tokens=False)
                                   for t in (TEXT, PLAIN)])
    steps = run_steps(proposer, tok, target)
    inner_tokens = 0
    for drafts, inner, reqs in steps:
        for i, r in enumerate(reqs):
            if r.req_id == "json":
                if not r.in_prefill:
                    output = [int(t) for t in r.context[r.num_prompt_tokens:]]
                    assert grammar_accepts(json_matcher(), output, drafts.tokens[i])
                continue
            assert drafts.tokens[i] == list(inner.tokens[i])  # passed through
            inner_tokens += len(inner.tokens[i])
            if inner.probs is not None:
                assert drafts.probs[i] is inner.probs[i]
    m = proposer.metrics()
    assert m["num_errors"] == 0 and m["inner"]["num_errors"] == 0, m
    assert m["grammar_requests"] == 1 and m["grammar_lost"] == 0
    assert m["forced_tokens"] > 0
    assert inner_tokens > 0, f"{name} never drafted: the pass-through check is empty"
    assert m["active_matchers"] == 0  # the finished request's matcher is gone


def test_grammar_alone_steps_without_an_inner(tok):
    proposer = GrammarProposer(fake_config({"method": "grammar_forced"}), tokenizer=tok)
    assert proposer.inner is None
    for drafts, _, reqs in run_steps(proposer, tok):
        for i, r in enumerate(reqs):
            if r.req_id != "json":
                assert drafts.tokens[i] == []
    m = proposer.metrics()
    assert m["num_errors"] == 0 and m["forced_tokens"] > 0


# ------------------------------------------------------------ custom names
class NotAProposer:
    def __init__(self, vllm_config=None, options=None, vocab_size=None):
        pass


class NarrowConstructor(PluginProposer):
    def __init__(self, vllm_config=None):
        super().__init__(vllm_config)


class Wrapping(GrammarProposer):
    """Composes an inner itself."""


class LastTokenEcho(PluginProposer):
    """A custom method that drafts its request's last token again and
    continues any prefix with that prefix's last token."""

    def draft(self, ctx):
        return Drafts([[int(r.context[-1])] * 2 if not r.in_prefill else []
                       for r in ctx.requests])

    def continue_draft(self, request, prefix, n):
        last = prefix[-1] if len(prefix) else request.context[-1]
        return np.full(min(n, 1), last, dtype=np.int64)


@pytest.fixture
def custom(monkeypatch):
    def register(name: str, cls_name: str, path: str | None = None):
        method = Method(name, path or f"{__name__}.{cls_name}")
        monkeypatch.setitem(METHODS, name, method)
        monkeypatch.setitem(BY_CLASS_PATH, method.class_path, method)
    return register


@pytest.mark.parametrize("cls_name, path, reason", [
    ("NotAProposer", None, "is not a vllm_plugins PluginProposer"),
    ("NarrowConstructor", None, "does not take PluginProposer's constructor arguments"),
    ("Wrapping", None, "composition is one level deep"),
    ("Missing", "tests.no_such_module.Missing", "cannot be loaded"),
])
def test_custom_method_that_cannot_be_inner_is_refused_at_start(custom, cls_name, path,
                                                                reason):
    custom("mine", cls_name, path)
    for inner in ("mine", {"method": "mine"}):
        with pytest.raises(ValueError) as e:
            translate({"method": "grammar_forced", "inner": inner})
        msg = str(e.value)
        assert "'inner'" in msg and "'mine'" in msg and reason in msg, msg
    # and the list of what may be inner leaves it out
    with pytest.raises(ValueError) as e:
        translate({"method": "grammar_forced", "inner": "nope"})
    assert "'mine'" not in str(e.value) and "token_recycling" in str(e.value)


def test_custom_method_as_inner_drafts_and_continues(custom, tok):
    custom("echo", "LastTokenEcho")
    proposer = GrammarProposer(fake_config({"method": "grammar_forced", "inner": "echo"}),
                               tokenizer=tok)
    assert isinstance(proposer.inner, LastTokenEcho)
    steps = run_steps(proposer, tok)
    for drafts, inner, reqs in steps:
        for i, r in enumerate(reqs):
            if r.req_id != "json":
                assert drafts.tokens[i] == inner.tokens[i]
    assert proposer.metrics()["num_errors"] == 0
