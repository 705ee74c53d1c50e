"""Grammar / JSON-Schema constrained decoding as a vLLM logits processor.

Enable (any one):

* installed package: the ``vllm.logits_processors`` entry point ``grammar``
  loads it into every engine (vLLM loads entry-point processors by default);
* ``vllm serve ... --logits-processors vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor``;
* ``LLM(..., logits_processors=[GrammarLogitsProcessor])``.

Then per request::

    SamplingParams(extra_args={"grammar": {"json_schema": {...}}})

(see ``vllm_plugins.grammar.spec`` for the other kinds). Requests without
the key are never touched, and a batch without any such request costs one
dict-emptiness check per step.

Both of vLLM 0.32's logits-processor interfaces are implemented by this one
class, because the entry point names one class and vLLM picks the interface by
model runner: the V1 runner (``vllm.v1.sample.logits_processor.LogitsProcessor``,
``update_state(BatchUpdate)`` + ``apply(logits)``; CPU builds, and GPU when the
V2 runner is off) and the V2 runner (``vllm.v1.worker.gpu.sample.logits_processor
.LogitsProcessor``, ``add_request`` + ``apply(logits, ctx)``; the GPU default).
The V2 loader rejects plugins that are not V2 subclasses, so a V1-only class
behind the entry point would stop every V2 engine from starting.

Grammar-aligned sampling: ``{"grammar": {..., "aligned": true}}`` reweights the
allowed tokens by ASAp's bounds on expected future grammaticality (:mod:`.asap`)
so that repeated samples of one prompt converge to the model's distribution
conditioned on the grammar; V1 runner only (on V2 such requests are masked
plainly, with a warning).

Termination: when the grammar is complete and admits nothing more (llguidance
matcher stopped), the request's EOS token is forced; while the grammar could
end or go on, EOS is allowed along with the continuations.

Failure: when a request's grammar cannot go on (its matcher errs, the worker
cannot build it, or the last sampled token is not visible), the processor
logs the reason and reports the request's batch row (``take_failures``): it
sees rows, not request ids, and only the scheduler sets a finish reason. The
bridge (``vllm_plugins.bridge.grammar_hold``) maps the rows to request ids
after sampling and the scheduler finishes them with ``FINISHED_ERROR``
(finish reason ``error``). Meanwhile, and where no bridge reads the report
(V2 model runner), the row is forced to ``FAILURE_TEXT`` and then EOS, so an
answer is never a silent, truncated ``stop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import llguidance
import torch

from vllm.logger import init_logger
from vllm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor as _V1LogitsProcessor,
    MoveDirectionality,
)
from vllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsProcessor as _V2LogitsProcessor,
)

from .asap import AsapCursor, AsapStore, max_nodes_from_env
from vllm_plugins.grammar.runtime import GrammarRuntime, runtime_for
from vllm_plugins.grammar.spec import (
    GRAMMAR_KEY,
    CompiledGrammar,
    GrammarSpecError,
    compile_grammar_request,
    grammar_request,
    validate_grammar_request,
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = init_logger(__name__)

__all__ = ["GrammarLogitsProcessor", "GrammarSpecError"]

_PLACEHOLDER = -1  # vLLM's async-scheduling placeholder for a not-yet-known token
#: What a request whose grammar failed says at the end of its output.
FAILURE_TEXT = " [grammar error: output stopped]"
_SAMPLING_EPS = 1e-5  # vLLM samples greedily below this temperature


class _GrammarRequest:
    """One request's matcher and how far it has read the request's output."""

    __slots__ = ("matcher", "output", "n_consumed", "eos", "failed", "asap",
                 "after_failure", "reported")

    def __init__(self, matcher: llguidance.LLMatcher | None, output: list[int] | None, eos: int):
        self.matcher = matcher
        # V1: a reference to the runner's running output-token list. V2: None
        # (tokens are read from the runner's token buffer instead).
        self.output = output
        self.n_consumed = 0
        self.eos = eos
        # Set once; a failed request is forced to FAILURE_TEXT, then EOS
        # (fail closed, logged). after_failure: its output tokens since then.
        self.failed: str | None = None if matcher is not None else "grammar unavailable"
        self.after_failure = 0
        self.reported = False  # failure handed to the scheduler (take_failures)
        # ``"aligned": true`` (V1): this request's walk down its prompt's ASAp trie.
        self.asap: AsapCursor | None = None

    def consume(self, tokens: list[int]) -> None:
        if not tokens:
            return
        if self.failed:
            self.after_failure += len(tokens)
            self.n_consumed += len(tokens)
            return
        m = self.matcher
        if m.is_stopped():
            # Only EOS was allowed; anything after it (ignore_eos) is not grammar text.
            self.n_consumed += len(tokens)
        else:
            self.n_consumed += len(tokens)
            if not m.consume_tokens(tokens):
                self.fail(m.get_error() or "token rejected by the grammar")
        if self.asap is not None and not self.failed:
            self.asap.advance(tokens)  # stops by itself at EOS

    def advance_v1(self) -> bool:
        """Consume output tokens not yet seen; False if some are still placeholders."""
        out = self.output
        n = len(out)
        if n <= self.n_consumed:
            return True
        new = out[self.n_consumed : n]
        if _PLACEHOLDER in new:
            k = new.index(_PLACEHOLDER)
            self.consume(new[:k])
            return False
        self.consume(new)
        return True

    def fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            self.after_failure = 0

    def forced(self, n_rows: int, failure_tokens: list[int]) -> list[int]:
        """The tokens forced on this request's next ``n_rows`` rows: the rest
        of the failure text, if it failed, then EOS."""
        if not self.failed:
            return [self.eos] * n_rows
        rest = failure_tokens[self.after_failure:self.after_failure + n_rows]
        return rest + [self.eos] * (n_rows - len(rest))

    @property
    def must_stop(self) -> bool:
        return self.failed is not None or self.matcher.is_stopped()


class GrammarLogitsProcessor(_V1LogitsProcessor, _V2LogitsProcessor):
    """Constrain a request's output to a JSON Schema, regex or Lark grammar."""

    # ------------------------------------------------------------------ setup
    def __init__(self, vllm_config: "VllmConfig", *args: Any) -> None:
        # V1: (vllm_config, device, is_pin_memory); V2: (vllm_config, req_states).
        if len(args) == 2:
            self._v2 = False
            self.device = torch.device(args[0])
            self._req_states = None
        elif len(args) == 1:
            self._v2 = True
            self._req_states = args[0]
            self.device = torch.device(self._req_states.device)
        else:
            raise TypeError(
                "GrammarLogitsProcessor(vllm_config, device, is_pin_memory) [V1] or "
                "(vllm_config, req_states) [V2]"
            )
        self._model_config = vllm_config.model_config
        self._vocab_size = self._model_config.get_vocab_size()
        self._runtime: GrammarRuntime | None = None
        self._runtime_error: str | None = None
        self._failure_tokens: list[int] | None = None  # FAILURE_TEXT, tokenized
        # V1: batch index -> request. V2: persistent slot -> request.
        self._reqs: dict[int, _GrammarRequest] = {}
        self._logged: set[str] = set()
        # ASAp tries of "aligned" requests, built at the first one; the cap is
        # read (and a bad value refused) at engine start.
        self._asap: AsapStore | None = None
        self._asap_max_nodes = max_nodes_from_env()
        # V1 under speculation: the step's drafts by batch index while vLLM's
        # rejection sampler runs (set by the bridge), else None.
        self._verifying: list[list[int]] | None = None
        # V1: batch index -> why its grammar failed, since the last
        # take_failures (the bridge ends those requests with an error).
        self._failures: dict[int, str] = {}
        self._idle = _is_duplicate(vllm_config)
        if self._idle:
            logger.info(
                "GrammarLogitsProcessor is both installed as an entry point and listed "
                "in logits_processors; this instance stays idle so grammars run once."
            )

        if not self._v2:
            sched = vllm_config.scheduler_config
            explicit = tuple(self._model_config.logits_processors or ())
            if getattr(sched, "async_scheduling", False) and not explicit:
                # vLLM only fills in async placeholder tokens before sampling when
                # *explicit* custom processors are configured
                # (gpu_model_runner: logitsprocs_need_output_token_ids=bool(custom_logitsprocs)).
                logger.warning(
                    "GrammarLogitsProcessor was loaded through its entry point only, "
                    "with async scheduling on: vLLM will not show it the last sampled "
                    "tokens, so grammar requests would be stopped. Pass it with "
                    "--logits-processors vllm_plugins.logits_processors.grammar:"
                    "GrammarLogitsProcessor, or use --no-async-scheduling."
                )

    @classmethod
    def validate_params(cls, sampling_params: "SamplingParams") -> None:
        """Called by vLLM's frontend for every request; a ValueError fails only that request."""
        compiled = validate_grammar_request(sampling_params.extra_args)
        if compiled is None:
            return
        if sampling_params.structured_outputs is not None:
            raise GrammarSpecError(
                f'give either extra_args["{GRAMMAR_KEY}"] or structured_outputs, not both'
            )
        if compiled.aligned and sampling_params.temperature < _SAMPLING_EPS:
            raise GrammarSpecError(
                f'extra_args["{GRAMMAR_KEY}"]["aligned"] needs random sampling '
                f"(temperature > 0); got temperature={sampling_params.temperature}"
            )

    def is_argmax_invariant(self) -> bool:
        return False

    def take_failures(self) -> dict[int, str]:
        """Batch index -> reason, for each V1 request whose grammar failed in
        this step (each reported once). The bridge reads them after sampling
        (``vllm_plugins.bridge.grammar_hold``) and the scheduler finishes
        those requests with an error; where it does not, they end with
        ``FAILURE_TEXT`` and EOS as before."""
        failures, self._failures = self._failures, {}
        return failures

    # --------------------------------------------------------------- helpers
    def _log_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(msg, *args)

    def _get_runtime(self) -> GrammarRuntime | None:
        # Built at the first grammar request: engines that never see one pay nothing.
        if self._runtime is None and self._runtime_error is None:
            try:
                from vllm.tokenizers import cached_tokenizer_from_config

                tokenizer = cached_tokenizer_from_config(self._model_config)
                if tokenizer is None:
                    raise RuntimeError("the engine was started with skip_tokenizer_init")
                key = (self._model_config.tokenizer, self._model_config.tokenizer_revision,
                       self._vocab_size)
                self._runtime = runtime_for(tokenizer, self._vocab_size, key)
            except Exception as e:  # noqa: BLE001 - any failure disables grammars, loudly
                self._runtime_error = f"{type(e).__name__}: {e}"
                logger.error(
                    "GrammarLogitsProcessor cannot build an llguidance tokenizer (%s); "
                    "grammar requests will be stopped at their first token.",
                    self._runtime_error,
                )
        return self._runtime

    def _failure_text_tokens(self) -> list[int]:
        """FAILURE_TEXT as this tokenizer spells it; none without a tokenizer."""
        if self._failure_tokens is None:
            rt = self._runtime
            self._failure_tokens = ([] if rt is None else
                                    [int(t) for t in rt.ll_tokenizer.tokenize_str(FAILURE_TEXT)
                                     if int(t) < self._vocab_size])
        return self._failure_tokens

    def _new_request(
        self, params: "SamplingParams", output: list[int] | None,
        prompt: list[int] | None = None,
    ) -> _GrammarRequest | None:
        raw = grammar_request(params.extra_args)
        if raw is None:
            return None
        rt = self._get_runtime()
        eos = params.eos_token_id
        if eos is None:  # ignore_eos, or no tokenizer EOS: fall back to llguidance's
            eos = rt.eos_token if rt is not None else 0
        if rt is None:
            return _GrammarRequest(None, output, eos)
        try:
            compiled: CompiledGrammar = compile_grammar_request(raw)
            matcher = rt.new_matcher(compiled)
        except Exception as e:  # noqa: BLE001 - validate_params should have caught it
            req = _GrammarRequest(None, output, eos)
            req.failed = str(e)
            self._log_once(f"compile:{e}", "grammar request failed in the worker: %s", e)
            return req
        if matcher.is_error():
            req = _GrammarRequest(None, output, eos)
            req.failed = matcher.get_error() or "the grammar's matcher failed"
            return req
        req = _GrammarRequest(matcher, output, eos)
        if compiled.aligned:
            req.asap = self._asap_cursor(compiled, params, prompt, eos, rt.eos_token)
        return req

    def _asap_cursor(self, compiled: CompiledGrammar, params: "SamplingParams",
                     prompt: list[int] | None, eos: int, ll_eos: int) -> AsapCursor | None:
        """The request's cursor on the trie shared by its (grammar, prompt, setting)."""
        if self._v2:
            self._log_once("asap:v2", "grammar 'aligned' sampling runs on vLLM's V1 model "
                           "runner only; on V2 such requests are masked plainly")
            return None
        if params.temperature < _SAMPLING_EPS:  # validate_params refuses this
            return None
        if self._asap is None:
            self._asap = AsapStore(self._asap_max_nodes)
        # Everything that shapes the distribution the processor sees (vLLM's
        # builtin logit bias and min_tokens run before it) or samples from.
        setting = repr((params.temperature, sorted((params.logit_bias or {}).items()),
                        params.min_tokens, eos, params.allowed_token_ids,
                        params.bad_words))
        key = AsapStore.key(compiled.grammar, prompt, setting)
        return self._asap.cursor(key, (eos, ll_eos), params.temperature)

    def _align(self, logits: torch.Tensor, aligned: list[tuple[int, _GrammarRequest]],
               raw: list[torch.Tensor]) -> None:
        """ASAp: reweight masked rows by the bounds of the children already sampled."""
        for (row, req), raw_row in zip(aligned, raw):
            cursor = req.asap
            if req.failed or self._runtime is None:
                cursor.done = True
                continue
            res = cursor.observe(raw_row, logits[row])
            if res is None:
                continue
            toks, offsets = res
            index = torch.tensor(toks, device=logits.device)
            before = logits[row, index]
            logits[row, index] = before + torch.tensor(offsets, dtype=logits.dtype,
                                                       device=logits.device)
            if all(o == float("-inf") for o in offsets) and not torch.isfinite(logits[row]).any():
                # Every allowed token is a known dead end (bounds of 0, e.g. all
                # grammatical paths have probability 0): sample as plain masking.
                logits[row, index] = before
                self._log_once("asap:dead", "grammar 'aligned': every allowed token "
                               "has a future-grammaticality bound of 0; masking plainly")

    def _mask(self, logits: torch.Tensor, rows: list[int], reqs: list[_GrammarRequest],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Mask ``logits[rows[i]]`` for ``reqs[i]``, whose matcher is at that row's position.

        With ``drafts`` (V2 speculative decoding), request i owns rows
        ``rows[i] .. rows[i] + len(drafts[i])``: row ``rows[i] + j`` is masked
        after tentatively consuming ``drafts[i][:j]`` (rolled back afterwards).
        """
        rt = self._runtime
        fill_pairs: list[tuple[llguidance.LLMatcher, int]] = []
        mask_rows: list[int] = []
        mask_eos: list[int] = []
        force_rows: list[int] = []
        force_toks: list[int] = []
        n_logits = logits.shape[0]
        failure_tokens = self._failure_text_tokens()
        aligned = [(row, req) for row, req in zip(rows, reqs)
                   if req.asap is not None and not req.asap.done and not drafts]
        raw = [logits[row].clone() for row, _ in aligned]  # before the mask
        for i, (row, req) in enumerate(zip(rows, reqs)):
            if req.failed:
                self._log_once(f"failed:{req.failed}",
                               "grammar request ended with %r, then EOS: %s",
                               FAILURE_TEXT, req.failed)
            draft = drafts[i] if drafts else ()
            n_rows = 1 + len(draft)
            if rt is None and not req.failed:
                req.fail(self._runtime_error or "grammar unavailable")
            if req.must_stop:
                # Row row+j follows draft[:j]: forcing the text's next tokens
                # there keeps it whole whichever drafts are accepted.
                force_rows.extend(range(row, row + n_rows))
                force_toks.extend(req.forced(n_rows, failure_tokens))
                continue
            fill_pairs.append((req.matcher, row))
            mask_rows.append(row)
            mask_eos.append(req.eos)
            if draft:
                m = req.matcher
                n_ok = 0
                for j, tok in enumerate(draft):
                    if m.is_stopped() or m.try_consume_tokens([tok]) != 1:
                        # The grammar rejects this draft token (or has ended): its
                        # own row forbids it, so the rejection sampler never uses the
                        # rows after it; make them EOS-only.
                        rest = list(range(row + 1 + j, row + n_rows))
                        force_rows.extend(rest)
                        force_toks.extend([req.eos] * len(rest))
                        break
                    n_ok += 1
                    # Row row+1+j is sampled after draft[:j+1]: fill it while the
                    # matcher sits there, then roll back below.
                    rt.fill([(m, row + 1 + j)], n_logits)
                    mask_rows.append(row + 1 + j)
                    mask_eos.append(req.eos)
                if n_ok:
                    m.rollback(n_ok)
        if fill_pairs:
            bitmask = rt.fill(fill_pairs, n_logits)
            for row, eos in zip(mask_rows, mask_eos):
                if eos != rt.eos_token:
                    _copy_bit(bitmask, row, rt.eos_token, eos)
            rt.apply(logits, mask_rows, mask_rows)
        if force_rows:
            GrammarRuntime.force_token(logits, force_rows, force_toks)
        if aligned:
            self._align(logits, aligned, raw)
        return logits

    # -------------------------------------------------------------- V1 API
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update or self._idle:
            return
        reqs = self._reqs
        for index in batch_update.removed:
            self._drop(index)
        for index, params, prompt, output in batch_update.added:
            self._drop(index)
            extra = params.extra_args
            if extra and GRAMMAR_KEY in extra:
                req = self._new_request(params, output, prompt)
                if req is not None:
                    reqs[index] = req
        if reqs:
            for a, b, direction in batch_update.moved:
                ra = reqs.pop(a, None)
                rb = reqs.pop(b, None)
                if ra is not None:
                    reqs[b] = ra
                if rb is not None and direction == MoveDirectionality.SWAP:
                    reqs[a] = rb
                elif rb is not None and rb.asap is not None:
                    rb.asap.finish()  # overwritten by the move: its sample is over

    def _drop(self, index: int) -> None:
        req = self._reqs.pop(index, None)
        if req is not None and req.asap is not None:
            req.asap.finish()  # the sample is over: ASAp tightens its path's bounds

    def _apply_v1(self, logits: torch.Tensor) -> torch.Tensor:
        rows, reqs = self._v1_requests(logits.shape[0])
        return self._mask(logits, rows, reqs)

    def _v1_requests(self, n_rows: int) -> tuple[list[int], list["_GrammarRequest"]]:
        """The batch's grammar requests (rows below ``n_rows``), each advanced
        to its committed output."""
        rows: list[int] = []
        reqs: list[_GrammarRequest] = []
        for index, req in self._reqs.items():
            if index >= n_rows:
                continue
            if not req.advance_v1() and not req.failed:
                # vLLM patches placeholders before sampling only for explicitly
                # configured processors; with the entry point alone under async
                # scheduling the tokens stay unknown: stop rather than guess.
                req.fail("the last sampled token is not visible to logits "
                         "processors (async scheduling; pass --logits-processors)")
                # Nor would the failure text's tokens be: EOS at once.
                req.after_failure = 1 << 30
            if req.failed and not req.reported:
                req.reported = True
                self._failures[index] = req.failed
            rows.append(index)
            reqs.append(req)
        return rows, reqs

    # ------------------------------------------ V1 under speculative decoding
    # vLLM's rejection sampler samples the bonus rows (one per request, after
    # all its drafts) through the plain sampler, which calls ``apply``, then
    # processes the target rows (row j of a request: after its drafts[:j]).
    # The bridge (vllm_plugins.bridge.verify_processors) hands the step's
    # drafts over with ``begin_verification`` so that ``apply`` masks bonus
    # rows after the drafts, and calls ``apply_drafted`` on the target rows.
    # Matchers only move tentatively here and are rolled back: the next step
    # advances them by the tokens actually accepted (``advance_v1``).
    def begin_verification(self, drafts: list[list[int]]) -> None:
        """This step's drafts, by batch index, until ``end_verification``."""
        self._verifying = drafts

    def end_verification(self) -> None:
        self._verifying = None

    def _apply_bonus(self, logits: torch.Tensor) -> torch.Tensor:
        drafts = self._verifying
        rows, reqs = self._v1_requests(logits.shape[0])
        plain_rows: list[int] = []
        plain_reqs: list[_GrammarRequest] = []
        plan: list[tuple[_GrammarRequest, list[int], list[int | None]]] = []
        for row, req in zip(rows, reqs):
            draft = drafts[row] if row < len(drafts) else []
            if not draft:
                plain_rows.append(row)
                plain_reqs.append(req)
            else:
                plan.append((req, draft, [None] * len(draft) + [row]))
        if plain_rows:
            self._mask(logits, plain_rows, plain_reqs)
        if plan:
            self._mask_positions(logits, plan)
        return logits

    def apply_drafted(self, logits: torch.Tensor, num_draft: list[int]) -> torch.Tensor:
        """Mask the target rows: request i owns ``num_draft[i]`` consecutive
        rows in batch order; its row j follows its drafts[:j]."""
        drafts = self._verifying
        if not self._reqs or drafts is None:
            return logits
        rows, reqs = self._v1_requests(len(num_draft))
        by_row = dict(zip(rows, reqs))
        plan: list[tuple[_GrammarRequest, list[int], list[int | None]]] = []
        start = 0
        for index, n in enumerate(num_draft):
            req = by_row.get(index)
            if req is not None and n:
                plan.append((req, drafts[index], list(range(start, start + n))))
            start += n
        if plan:
            self._mask_positions(logits, plan)
        return logits

    def _mask_positions(self, logits: torch.Tensor,
                        plan: list[tuple["_GrammarRequest", list[int], list[int | None]]]
                        ) -> torch.Tensor:
        """Mask, for each (request, draft, rows), ``logits[rows[j]]`` with the
        request's grammar after it tentatively consumed ``draft[:j]`` (None:
        no row for that position), exactly as plain decoding would mask the
        row at that position; rows after a draft token the grammar rejects
        are never used by the rejection sampler and take EOS."""
        rt = self._runtime
        n_logits = logits.shape[0]
        failure_tokens = self._failure_text_tokens()
        mask_rows: list[int] = []
        mask_eos: list[int] = []
        force_rows: list[int] = []
        force_toks: list[int] = []
        for req, draft, rows in plan:
            if rt is None and not req.failed:
                req.fail(self._runtime_error or "grammar unavailable")
            if req.asap is not None and not req.asap.done:
                # Drafted aligned requests are not served (the bridge drops
                # their drafts): should one come, it is masked plainly on.
                req.asap.done = True
                self._log_once("asap:spec", "grammar 'aligned' request got drafts: "
                               "ASAp stops for it, its rows are masked plainly")
            if req.must_stop:
                for row, tok in zip(rows, req.forced(len(rows), failure_tokens)):
                    if row is not None:
                        force_rows.append(row)
                        force_toks.append(tok)
                continue
            m = req.matcher
            n_ok = 0
            for j, row in enumerate(rows):
                if j and m.try_consume_tokens([int(draft[j - 1])]) != 1:
                    rest = [r for r in rows[j:] if r is not None]
                    force_rows.extend(rest)
                    force_toks.extend([req.eos] * len(rest))
                    break
                n_ok += 1 if j else 0
                if row is None:
                    continue
                if m.is_stopped():  # as plain decoding: EOS forced
                    force_rows.append(row)
                    force_toks.append(req.eos)
                    continue
                rt.fill([(m, row)], n_logits)
                mask_rows.append(row)
                mask_eos.append(req.eos)
            if n_ok:
                m.rollback(n_ok)
        if mask_rows:
            bitmask = rt.bitmask(n_logits)
            for row, eos in zip(mask_rows, mask_eos):
                if eos != rt.eos_token:
                    _copy_bit(bitmask, row, rt.eos_token, eos)
            rt.apply(logits, mask_rows, mask_rows)
        if force_rows:
            GrammarRuntime.force_token(logits, force_rows, force_toks)
        return logits

    # -------------------------------------------------------------- V2 API
    def add_request(self, req_idx: int, sampling_params: "SamplingParams") -> bool:
        extra = sampling_params.extra_args
        req = None
        if extra and GRAMMAR_KEY in extra and not self._idle:
            req = self._new_request(sampling_params, None)
        if req is None:
            self._reqs.pop(req_idx, None)
            return False
        self._reqs[req_idx] = req
        return True

    def _apply_v2(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        slots = ctx.idx_mapping_np
        batch = [(i, int(s)) for i, s in enumerate(slots.tolist()) if int(s) in self._reqs]
        if not batch:
            return logits
        rs = self._req_states
        num_reqs = len(slots)
        spec = logits.shape[0] != num_reqs
        if spec:
            # Rows of batch position i: first_row[i] .. first_row[i+1]-1.
            row_slot = ctx.expanded_idx_mapping.cpu().tolist()
            first_row: list[int] = []
            for r, s in enumerate(row_slot):
                if r == 0 or s != row_slot[r - 1]:
                    first_row.append(r)
            first_row.append(len(row_slot))
        else:
            first_row = list(range(num_reqs + 1))
        rows0 = [first_row[i] for i, _ in batch]
        pos = ctx.pos.cpu().tolist()
        input_ids = ctx.input_ids.cpu().tolist() if spec else None
        rows: list[int] = []
        reqs: list[_GrammarRequest] = []
        drafts: list[list[int]] = []
        prompt_len = rs.prompt_len.np
        for (i, slot), row in zip(batch, rows0):
            req = self._reqs[slot]
            # Row `row` feeds the last committed token at position pos[row]; the
            # request's committed output is all_token_ids[slot, prompt_len:pos+1].
            start = int(prompt_len[slot]) + req.n_consumed
            end = pos[row] + 1
            if end > start:
                toks = rs.all_token_ids.gpu[slot, start:end].tolist()
                req.consume(toks)
            rows.append(row)
            reqs.append(req)
            drafts.append(input_ids[row + 1 : first_row[i + 1]] if spec else [])
        return self._mask(logits, rows, reqs, drafts if spec else None)

    # --------------------------------------------------------------- apply
    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:
        if not self._reqs:
            return logits
        if ctx is None:
            if self._verifying is not None:
                return self._apply_bonus(logits)
            return self._apply_v1(logits)
        return self._apply_v2(logits, ctx)


def engine_drops_processors(vllm_config: "VllmConfig") -> str | None:
    """Why this engine will run no custom logits processors, or None.

    vLLM 0.32's V1 model runner silently drops every custom logits processor,
    entry-point ones included, when speculative decoding is on
    (``build_logitsprocs``; only ``--logits-processors`` given explicitly raises
    ``STR_SPEC_DEC_REJECTS_LOGITSPROCS``), yet the frontend still runs
    ``validate_params``: a grammar request would be admitted and decoded
    unconstrained. The bridge wraps each engine's params validator with
    ``refuse_grammar_requests`` when this returns a reason.
    """
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None or vllm_config.use_v2_model_runner:
        return None
    from vllm_plugins.bridge.verify_processors import applies_processors

    if applies_processors(vllm_config):
        return None
    method = getattr(spec, "method", None)
    return (
        f"speculative decoding ({method}) is on and vLLM's V1 model runner then "
        "runs no custom logits processors; use SamplingParams.structured_outputs "
        "or an engine without speculative decoding"
    )


def verifies_per_position(sampling_params: "SamplingParams") -> bool:
    """Whether this processor can mask a request's drafted rows exactly as
    plain decoding masks each position. Not for ``"aligned"`` requests:
    ASAp's trie learns from the rows of the prefixes a request actually
    samples, one per step; such a request is served without drafts."""
    raw = grammar_request(getattr(sampling_params, "extra_args", None))
    return not (isinstance(raw, dict) and raw.get("aligned"))


def refuse_grammar_requests(sampling_params: "SamplingParams", reason: str) -> None:
    """Fail only a request that asks for a grammar this engine cannot honour."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    if GRAMMAR_KEY in extra:
        raise GrammarSpecError(
            f'extra_args["{GRAMMAR_KEY}"] cannot be honoured by this engine: {reason}'
        )


FQCN = "vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor"
_instances_per_config: dict[int, int] = {}


def _times_configured(vllm_config: "VllmConfig") -> int:
    """How many instances vLLM builds per engine: entry point + explicit mentions."""
    from importlib.metadata import entry_points

    n = sum(ep.value.replace(" ", "") == FQCN
            for ep in entry_points(group="vllm.logits_processors"))
    for item in vllm_config.model_config.logits_processors or ():
        if item is GrammarLogitsProcessor or (
            isinstance(item, type) and issubclass(item, GrammarLogitsProcessor)
        ):
            n += 1
        elif isinstance(item, str) and item.replace(" ", "") == FQCN:
            n += 1
    return max(n, 1)


def _is_duplicate(vllm_config: "VllmConfig") -> bool:
    """True for all but the last of the instances one engine builds.

    vLLM builds entry-point processors and then the ``logits_processors`` list,
    with no de-duplication (``_load_custom_logitsprocs``, V1; ``_load_v2_logitsprocs``,
    V2), one after another for the same config object. Counting construction
    per config modulo the expected number keeps exactly one instance working.
    """
    times = _times_configured(vllm_config)
    if times == 1:
        return False
    key = id(vllm_config)
    ordinal = _instances_per_config.get(key, 0)
    _instances_per_config[key] = ordinal + 1
    return ordinal % times != times - 1


def _copy_bit(bitmask: torch.Tensor, row: int, src: int, dst: int) -> None:
    """If token ``src`` is allowed in ``bitmask[row]``, allow ``dst`` too."""
    words = bitmask[row].numpy().view("uint32")
    if (words[src >> 5] >> (src & 31)) & 1 and (dst >> 5) < len(words):
        words[dst >> 5] |= 1 << (dst & 31)
