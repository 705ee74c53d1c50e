"""Grammar-forced drafts for requests that use vLLM's own structured outputs.

``{"method": "grammar_forced"}`` alone, or around another of our proposers::

    {"method": "grammar_forced", "inner": "token_recycling", "num_speculative_tokens": 6}
    {"method": "grammar_forced", "num_speculative_tokens": 6,
     "inner": {"method": "token_recycling", "topk": 8, "context_order": 3}}

For a request with ``structured_outputs`` (``response_format`` on the server),
the draft is the text its grammar forces, tokenized, then the inner proposer's
draft, checked against the grammar (see ``grammar_drafts``). Requests without
structured outputs get the inner proposer's draft unchanged (none without an
inner). vLLM's scheduler checks every draft against its own grammar again, and
its rejection sampler verifies it against the target, so output is exactly
vLLM's structured output without speculation.

A request with our grammar logits processor (``extra_args["grammar"]``) is
drafted the same way from that grammar; the bridge then applies the
processor's mask at every verified row (``vllm_plugins.bridge
.v1.verify_processors``), so output is exactly the processor's without
speculation.

Each request's grammar is rebuilt here from its ``SamplingParams`` as the
request's vLLM backend builds it (``vllm_plugins.grammar.structured_outputs``),
with a matcher per request (a copy of a cached template), advanced by the
request's output tokens each step and dropped when the request finishes. A spec llguidance cannot
compile, or output our matcher cannot follow, costs that request its forced
drafts only. Under a reasoning parser the grammar starts somewhere in the
output that this proposer cannot see, so forced drafts are off there.

Memory: one ``LLMatcher`` per running structured-output request (a parser
state, tens of KiB) plus up to 256 compiled templates shared in the process;
the inner proposer's own.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any

import numpy as np

from vllm_plugins.options import Option
from vllm_plugins.proposers.base import PluginProposer, verification_depends_on_token
from vllm_plugins.proposers.grammar_drafts import RequestGrammar
from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.tree.draft import chain_length

logger = logging.getLogger("vllm_plugins")

_METHOD = "grammar_forced"
_TIMING_WINDOW = 20_000  # draft-time samples kept for p50 / p99


def processor_grammar(sampling_params) -> Any | None:
    """The grammar our logits processor enforces on this request
    (``extra_args["grammar"]``), or None."""
    from vllm_plugins.grammar.spec import grammar_request

    return grammar_request(getattr(sampling_params, "extra_args", None))


def parse_inner(value: Any) -> tuple[str | None, dict]:
    """(inner method name, its options) from the ``inner`` option; validates
    both against the inner method's declared options. Raises ValueError that
    names the bad option."""
    if value is None:
        return None, {}
    if isinstance(value, str):
        name, opts = value, {}
    elif isinstance(value, dict):
        opts = {k.replace("-", "_"): v for k, v in value.items()}
        name = opts.pop("method", None)
        if not isinstance(name, str):
            raise ValueError(
                f"speculative_config option 'inner' of method '{_METHOD}' must name "
                f"its method, e.g. {{\"method\": \"token_recycling\", ...}}; got {value!r}")
    else:
        raise ValueError(f"speculative_config option 'inner' of method '{_METHOD}' "
                         f"must be a method name or a dict, got {value!r}")
    from vllm_plugins.options import resolve
    from vllm_plugins.registry import METHODS

    if name not in METHODS:
        allowed = [m for m in sorted(METHODS) if why_not_inner(m) is None]
        raise ValueError(f"speculative_config option 'inner' of method '{_METHOD}' "
                         f"must be one of {allowed}, got {name!r}")
    reason = why_not_inner(name)
    if reason is not None:
        raise ValueError(f"speculative_config option 'inner' of method '{_METHOD}' "
                         f"cannot be {name!r}: {reason}")
    cls = METHODS[name].proposer_class()
    where = f"{name}' (inner of '{_METHOD}"  # reads: method 'x' (inner of 'grammar_forced')
    resolved = resolve(where, cls.OPTIONS, opts)
    cls.check_options(where, resolved)
    if resolved["draft_length"] != "fixed":
        from vllm_plugins.proposers.draft_length import policy_options

        policy_options(resolved["draft_length"], resolved["draft_length_options"])
    return name, opts


def why_not_inner(name: str) -> str | None:
    """Why registered method ``name`` cannot run inside the grammar proposer,
    or None when it can. The grammar proposer builds its inner as
    ``Class(vllm_config, options=..., vocab_size=...)`` and drives it through
    ``PluginProposer``'s interface only, so that is all an inner needs."""
    import inspect

    from vllm_plugins.registry import METHODS

    try:
        cls = METHODS[name].proposer_class()
    except Exception as e:  # noqa: BLE001 - a method that cannot load is refused
        return f"its class {METHODS[name].class_path} cannot be loaded ({type(e).__name__}: {e})"
    if not (isinstance(cls, type) and issubclass(cls, PluginProposer)):
        return f"{METHODS[name].class_path} is not a vllm_plugins PluginProposer"
    if any(o.name == "inner" for o in cls.OPTIONS):
        return "it wraps an inner proposer itself, and composition is one level deep"
    try:
        inspect.signature(cls).bind(None, options={}, vocab_size=None)
    except TypeError:
        return (f"{cls.__name__} does not take PluginProposer's constructor "
                "arguments (vllm_config, options, vocab_size)")
    return None


def _check_inner(value: Any) -> bool:
    parse_inner(value)  # raises with the precise message
    return True


class GrammarProposer(PluginProposer):
    OPTIONS = (
        *PluginProposer.OPTIONS,
        Option("inner", None, (str, dict, type(None)), _check_inner,
               "a method name or a dict with 'method' and its options"),
    )
    DEFAULT_NUM_SPECULATIVE_TOKENS = 6

    @classmethod
    def runner_v2_refusal(cls, options: dict) -> str | None:
        name, inner_opts = parse_inner(options.get("inner"))
        if name is None:
            return None
        from vllm_plugins.options import resolve
        from vllm_plugins.registry import METHODS

        inner = METHODS[name].proposer_class()
        why = inner.runner_v2_refusal(resolve(name, inner.OPTIONS, inner_opts))
        return None if why is None else f"its inner '{name}' {why}"

    def __init__(self, vllm_config: Any = None, options: dict | None = None,
                 vocab_size: int | None = None, tokenizer: Any = None):
        super().__init__(vllm_config, options, vocab_size)
        name, inner_opts = parse_inner(self.options["inner"])
        self.inner: PluginProposer | None = None
        if name is not None:
            from vllm_plugins.registry import METHODS

            cls = METHODS[name].proposer_class()
            self.inner = cls(vllm_config, options=inner_opts, vocab_size=self.vocab_size)
            self.TOPK = self.inner.TOPK  # the bridge extracts top-k for the inner
            # A self-drafting inner (swift, del) needs the bridge's target
            # layers and KV lookahead: the bridge reads these from the outer.
            self.SELF_DRAFT = self.inner.SELF_DRAFT
        self._so_config = getattr(vllm_config, "structured_outputs_config", None)
        self._model_config = getattr(vllm_config, "model_config", None)
        self._tokenizer = tokenizer
        self._runtime = None
        self._states: dict[str, RequestGrammar | None] = {}
        self._logged: set[str] = set()
        self.enabled = True
        so = self._so_config
        if so is not None and getattr(so, "reasoning_parser", None) and not getattr(
                so, "enable_in_reasoning", False):
            self.enabled = False
            logger.warning("grammar-forced drafts are off: with reasoning_parser=%r "
                           "the grammar starts after the reasoning, which this "
                           "proposer cannot see; the inner proposer drafts alone",
                           so.reasoning_parser)
        self.counts = {"grammar_requests": 0, "grammar_unusable": 0, "grammar_lost": 0,
                       "forced_tokens": 0, "inner_tokens": 0, "inner_tokens_cut": 0,
                       "masked_topk_rows": 0}
        self._draft_seconds: deque[float] = deque(maxlen=_TIMING_WINDOW)

    # ------------------------------------------------------------ vLLM route
    def load_model(self, target_model: Any) -> None:
        super().load_model(target_model)
        if self.inner is not None:
            self.inner.load_model(target_model)
            self.aux_layers = self.inner.aux_layers

    # ------------------------------------------------------------ lifecycle
    def free(self, req_id: str) -> None:
        self._states.pop(req_id, None)

    def masked_topk_wanted(self) -> int:
        """The inner learns the target's top-k: our grammar processor's
        requests learn it after the processor's mask (``_masked_topk``)."""
        return self.inner.TOPK if self.inner is not None else 0

    def counters(self) -> dict[str, dict[str, int]]:
        out = self.inner.counters() if self.inner is not None else {}
        out["proposer_errors"] = {"": self.num_errors + out.get("proposer_errors", {}).get("", 0)}
        if self.controller is not None:
            out.update(self.controller.counters())
        out["grammar_forced_tokens"] = {"": self.counts["forced_tokens"]}
        out["grammar_lost_requests"] = {"": self.counts["grammar_lost"]}
        out["grammar_unusable_requests"] = {"": self.counts["grammar_unusable"]}
        return out

    def metrics(self) -> dict:
        out = super().metrics()
        out.update(self.counts)
        out["active_matchers"] = sum(s is not None for s in self._states.values())
        if self._draft_seconds:
            ms = np.asarray(self._draft_seconds) * 1e3
            out["draft_ms_p50"] = float(np.percentile(ms, 50))
            out["draft_ms_p99"] = float(np.percentile(ms, 99))
        if self.inner is not None:
            out["inner"] = self.inner.metrics()
        return out

    # ------------------------------------------------------------ drafting
    def draft(self, ctx: StepContext) -> Drafts:
        if self.inner is not None and self.inner.TOPK:
            self._masked_topk(ctx)
        inner = self.inner.step(ctx) if self.inner is not None else None
        n = len(ctx.requests)
        tokens: list[list[int]] = [list(t) for t in inner.tokens] if inner else [[] for _ in range(n)]
        probs = list(inner.probs) if inner is not None and inner.probs is not None else None
        conf = (list(inner.confidence) if inner is not None and inner.confidence is not None
                else None)
        # The inner's trees pass through as trees: a request without a
        # grammar is verified as the inner drafted it.
        parents = (list(inner.parents) if inner is not None and inner.parents is not None
                   else None)
        if not self.enabled:
            return Drafts(tokens, probs, conf, parents)
        for i, r in enumerate(ctx.requests):
            if r.in_prefill:
                continue
            if probs is not None and (verification_depends_on_token(r.sampling_params)
                                      or processor_grammar(r.sampling_params) is not None):
                # Our grammar processor's requests: the draft below is rewritten,
                # and one-hot rows keep verification exact whatever chose it.
                # vLLM cuts this draft at the first token its grammar rejects,
                # so an inner row would not be exact, matcher or not (one-hot
                # rows are: see proposers/stand.py, rule 3).
                probs[i] = None
            timed = r.req_id in self._states  # a new request's compile is not a step cost
            start = time.perf_counter()
            state = self._state(r)
            if state is None:
                continue
            if parents is not None and parents[i] is not None:
                # The grammar drafts a chain: it continues the inner tree's
                # chain prefix (its first path), and the siblings are dropped.
                m = chain_length(parents[i])
                parents[i] = None
                tokens[i] = tokens[i][:m]
                if probs is not None and probs[i] is not None:
                    probs[i] = probs[i][:m]
                if conf is not None and conf[i] is not None:
                    conf[i] = conf[i][:m]
            toks, forced = state.draft(
                self.draft_budget(ctx, r.req_id), tokens[i],
                recent=[int(t) for t in r.context[-8:]],
                continuation=self._continuation(r),
                eos=getattr(r.sampling_params, "eos_token_id", None))
            if timed:
                self._draft_seconds.append(time.perf_counter() - start)
            kept_inner = len(toks) - sum(forced)
            self.counts["forced_tokens"] += sum(forced)
            self.counts["inner_tokens"] += kept_inner
            if tokens[i] and not any(forced) and kept_inner < len(tokens[i]):
                self.counts["inner_tokens_cut"] += len(tokens[i]) - kept_inner
            if conf is not None or self.controller is not None:
                conf = conf if conf is not None else [None] * n
                conf[i] = self._confidence(toks, forced, tokens[i], conf[i])
            tokens[i] = toks
        return Drafts(tokens, probs, conf, parents)

    def _masked_topk(self, ctx: StepContext) -> None:
        """Our grammar processor's requests learn the target's top-k after
        the processor's mask, as vLLM's structured outputs do after vLLM's
        (``logits_processors.grammar_topk`` says why); a request whose rows
        were not all recorded keeps the raw top-k."""
        masked = ctx.masked_topk
        if masked is None or not masked.rows:
            return
        for i, r in enumerate(ctx.requests):
            if r.topk_ids is None or processor_grammar(r.sampling_params) is None:
                continue
            got = masked.for_request(i, r.verified_tokens, r.topk_ids.shape[1])
            if got is not None:
                r.topk_ids, r.topk_logprobs = got
                self.counts["masked_topk_rows"] += len(got[0])

    def _state(self, r: RequestStep) -> RequestGrammar | None:
        """The request's matcher, advanced to its current output; None when it
        has no grammar we can follow."""
        if r.req_id not in self._states:
            self._states[r.req_id] = self._new_state(r)
        state = self._states[r.req_id]
        if state is not None and not state.follow(r.context[r.num_prompt_tokens:]):
            self.counts["grammar_lost"] += 1
            self._log_once("lost", "grammar-forced drafts stopped for request %s: our "
                           "matcher cannot follow its output (%s); it drafts without "
                           "the grammar (logged once, counted in grammar_lost)",
                           r.req_id, state.error)
            self._states[r.req_id] = state = None
        return state

    def _new_state(self, r: RequestStep) -> RequestGrammar | None:
        so = getattr(r.sampling_params, "structured_outputs", None)
        ours = processor_grammar(r.sampling_params)
        if so is None and ours is None:
            return None
        from vllm_plugins.grammar.spec import compile_grammar_request
        from vllm_plugins.grammar.structured_outputs import grammar_for

        try:
            # Our grammar processor's extra_args grammar compiles as the
            # processor compiles it; vLLM's structured outputs as vLLM does.
            compiled = (grammar_for(so, self._so_config) if so is not None
                        else compile_grammar_request(ours))
            if compiled is None:
                return None
            runtime = self._get_runtime()
            matcher = runtime.new_matcher(compiled)
            error = matcher.get_error()
            if error:
                raise ValueError(error)
        except Exception as e:  # noqa: BLE001 - kept as None: never retried each step
            self.counts["grammar_unusable"] += 1
            self._log_once("unusable", "request %s: no grammar-forced drafts, its "
                           "structured_outputs spec does not build an llguidance "
                           "matcher here (%s); logged once, counted in "
                           "grammar_unusable", r.req_id, e)
            return None
        self.counts["grammar_requests"] += 1
        return RequestGrammar(matcher, runtime.ll_tokenizer)

    def _get_runtime(self):
        if self._runtime is None:
            from vllm_plugins.grammar.runtime import runtime_for

            tokenizer = self._tokenizer
            key: tuple = ("given", id(tokenizer))
            if tokenizer is None:
                from vllm.tokenizers import cached_tokenizer_from_config

                mc = self._model_config
                tokenizer = cached_tokenizer_from_config(model_config=mc)
                if tokenizer is None:
                    raise ValueError("the engine was started with skip_tokenizer_init")
                key = (mc.tokenizer, mc.tokenizer_revision, self.vocab_size)
            self._runtime = runtime_for(tokenizer, self.vocab_size, key)
        return self._runtime

    def _continuation(self, r: RequestStep):
        """More inner tokens after a draft prefix the inner draft did not start
        with, through ``PluginProposer.continue_draft``."""
        inner = self.inner
        if inner is None:
            return None

        def more(prefix: list[int], n: int) -> list[int]:
            return [int(t) for t in inner.continue_draft(
                r, np.asarray(prefix, dtype=np.int64), n)]
        return more

    @staticmethod
    def _confidence(toks, forced, inner_toks, inner_conf):
        out = np.empty(len(toks), dtype=np.float32)
        for j, (t, f) in enumerate(zip(toks, forced)):
            if f:
                out[j] = 1.0
            elif (inner_conf is not None and j < len(inner_conf)
                  and j < len(inner_toks) and inner_toks[j] == t):
                out[j] = inner_conf[j]
            else:
                out[j] = 0.5  # an inner continuation: no estimate of its own
        return out

    def _log_once(self, key: str, msg: str, *args) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)
