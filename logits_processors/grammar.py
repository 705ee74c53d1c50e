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
plainly, with a warning). Under speculation with our drafters each verified
row is reweighted at its own position (``_mask_positions``).

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
from .awrs import AwrsRows, AwrsStats, validate_awrs
from .grammar_engine import (  # noqa: F401  (the processor's public names)
    FQCN, engine_drops_processors, is_duplicate, refuse_grammar_requests)
from .grammar_state import FAILURE_TEXT, GrammarRequest, apply_masks
from .grammar_topk import MaskedTopk
from .grammar_verification import DraftedRows
from .log_once import LogOnce
from vllm_plugins.counted import Counted
from vllm_plugins.grammar.runtime import GrammarRuntime, runtime_for
from vllm_plugins.grammar.spec import (
    GRAMMAR_KEY,
    CompiledGrammar,
    GrammarSpecError,
    compile_grammar_request,
    grammar_request,
    request_options,
    validate_grammar_request,
)
from vllm_plugins.tree.sampling import is_greedy

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.config import VllmConfig

logger = init_logger(__name__)

__all__ = ["GrammarLogitsProcessor", "GrammarSpecError"]


class GrammarLogitsProcessor(AwrsRows, DraftedRows, _V1LogitsProcessor, _V2LogitsProcessor,
                             Counted):
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
        self._reqs: dict[int, GrammarRequest] = {}
        self._logged = LogOnce()  # bounded: keys may carry request text
        # ASAp tries of "aligned" requests, built at the first one; the cap is
        # read (and a bad value refused) at engine start.
        self._asap: AsapStore | None = None
        self._asap_max_nodes = max_nodes_from_env()
        self.awrs_stats = AwrsStats()  # "sampling": "awrs" requests' counts (:mod:`.awrs`)
        # Masked rows' top-k, for a drafter that learns it (:mod:`.grammar_topk`).
        self.masked_topk = MaskedTopk()
        # V1 under speculation: the step's drafts by batch index while vLLM's
        # rejection sampler runs (set by the bridge), else None.
        self._verifying: list[list[int]] | None = None
        # V1: batch index -> why its grammar failed, since the last
        # take_failures (the bridge ends those requests with an error).
        self._failures: dict[int, str] = {}
        self._idle = is_duplicate(vllm_config)
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
        validate_awrs(sampling_params, compiled,
                      request_options(grammar_request(sampling_params.extra_args)))
        if compiled.aligned and is_greedy(sampling_params):
            raise GrammarSpecError(
                f'extra_args["{GRAMMAR_KEY}"]["aligned"] needs random sampling '
                f"(temperature > 0); got temperature={sampling_params.temperature}"
            )

    def is_argmax_invariant(self) -> bool:
        return False

    def counters(self) -> dict[str, dict[str, int]]:
        """``Counted``: AWRS's work, for the server's ``/metrics``. An
        evaluation is a single-token grammar check, or a vocabulary entry of
        a whole mask a row fell back to (the mask mode's cost is the
        vocabulary size a token)."""
        s = self.awrs_stats
        return {"awrs_tokens": {"": s.rows}, "awrs_evaluations": {"": s.checks + s.mask_tokens},
                "awrs_masks": {"": s.masks}, "awrs_check_calls": {"": s.check_calls}}

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
        if self._logged.first(key):
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
    ) -> GrammarRequest | None:
        raw = grammar_request(params.extra_args)
        if raw is None:
            return None
        rt = self._get_runtime()
        eos = params.eos_token_id
        if eos is None:  # ignore_eos, or no tokenizer EOS: fall back to llguidance's
            eos = rt.eos_token if rt is not None else 0
        if rt is None:
            return GrammarRequest(None, output, eos)
        try:
            compiled: CompiledGrammar = compile_grammar_request(raw)
            matcher = rt.new_matcher(compiled)
        except Exception as e:  # noqa: BLE001 - validate_params should have caught it
            req = GrammarRequest(None, output, eos)
            req.failed = str(e)
            self._log_once(f"compile:{e}", "grammar request failed in the worker: %s", e)
            return req
        if matcher.is_error():
            req = GrammarRequest(None, output, eos)
            req.failed = matcher.get_error() or "the grammar's matcher failed"
            return req
        req = GrammarRequest(matcher, output, eos)
        options = request_options(raw)
        req.start_after(options.continue_tokens)
        if compiled.aligned:
            req.asap = self._asap_cursor(compiled, params, prompt, eos, rt.eos_token)
        if compiled.sampling == "awrs":
            self._awrs_request(req, compiled, params, output, options)
        return req

    def _asap_cursor(self, compiled: CompiledGrammar, params: "SamplingParams",
                     prompt: list[int] | None, eos: int, ll_eos: int) -> AsapCursor | None:
        """The request's cursor on the trie shared by its (grammar, prompt, setting)."""
        if self._v2:
            self._log_once("asap:v2", "grammar 'aligned' sampling runs on vLLM's V1 model "
                           "runner only; on V2 such requests are masked plainly")
            return None
        if is_greedy(params):  # validate_params refuses this
            return None
        if self._asap is None:
            self._asap = AsapStore(self._asap_max_nodes)
        # Everything that shapes the distribution the processor sees (vLLM's
        # builtin logit bias and min_tokens run before it) or samples from.
        setting = repr((params.temperature, sorted((params.logit_bias or {}).items()),
                        params.min_tokens, eos, params.allowed_token_ids,
                        params.bad_words))
        key = AsapStore.key(compiled.grammar, prompt, setting)
        terminal = {eos, ll_eos, *(params.stop_token_ids or ())}
        # A sample ends at max_tokens or where the context is full
        # (max_model_len), whichever comes first.
        max_len = params.max_tokens
        if prompt is not None:
            room = max(self._model_config.max_model_len - len(prompt), 0)
            max_len = room if max_len is None else min(max_len, room)
        return self._asap.cursor(key, terminal, params.temperature, max_len)

    def _align(self, logits: torch.Tensor, aligned: list[tuple[int, GrammarRequest]],
               raw: list[torch.Tensor]) -> None:
        """ASAp: reweight masked rows by the bounds of the children already sampled."""
        for (row, req), raw_row in zip(aligned, raw):
            self._reweight(logits, row, req, raw_row)

    def _reweight(self, logits: torch.Tensor, row: int, req: GrammarRequest,
                  raw_row: torch.Tensor, draft: list[int] = ()) -> None:
        """ASAp on one masked row: the one after the committed output + ``draft``."""
        cursor = req.asap
        if req.failed or self._runtime is None:
            cursor.done = True
            return
        res = cursor.observe(raw_row, logits[row], draft)
        if res is None:
            return
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

    def _mask_positions(self, logits: torch.Tensor,
                        plan: list[tuple[GrammarRequest, list[int], list[int | None]]]
                        ) -> torch.Tensor:
        """Drafted rows (V1 under speculation): the grammar's mask at each
        position (``DraftedRows``), then ASAp's weights at that position for
        aligned requests: the row after ``draft[:j]`` is reweighted at the trie
        node of the committed output + ``draft[:j]``, as plain decoding
        reweights it after committing them (``AsapCursor`` says why that is
        exact); the cursor keeps what each row teaches until the next step
        shows which drafts were accepted."""
        plan = self._awrs_positions(logits, plan)
        aligned = [(req, draft, rows, [None if r is None else logits[r].clone() for r in rows])
                   for req, draft, rows in plan if req.asap is not None and not req.asap.done]
        super()._mask_positions(logits, plan)
        for req, draft, rows, raw in aligned:
            for j, (row, raw_row) in enumerate(zip(rows, raw)):
                if row is not None:
                    self._reweight(logits, row, req, raw_row, draft[:j])
        return logits

    def _mask(self, logits: torch.Tensor, rows: list[int], reqs: list[GrammarRequest],
              drafts: list[list[int]] | None = None) -> torch.Tensor:
        """Mask ``logits[rows[i]]`` for ``reqs[i]``, whose matcher is at that row's position.

        With ``drafts`` (V2 speculative decoding), request i owns rows
        ``rows[i] .. rows[i] + len(drafts[i])``: row ``rows[i] + j`` is masked
        after tentatively consuming ``drafts[i][:j]`` (rolled back afterwards).
        """
        if not drafts:
            rows, reqs = self._awrs_plain(logits, rows, reqs)
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
        bitmask = rt.fill(fill_pairs, n_logits) if fill_pairs else None
        apply_masks(rt, logits, bitmask, mask_rows, mask_eos, force_rows, force_toks,
                    self.masked_topk)
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
                    self._finish_asap(rb)  # overwritten by the move: its sample is over

    def _drop(self, index: int) -> None:
        req = self._reqs.pop(index, None)
        if req is not None and req.asap is not None:
            self._finish_asap(req)

    @staticmethod
    def _finish_asap(req: GrammarRequest) -> None:
        """The sample is over: ASAp tightens its path's bounds, the path
        including the tokens of its last step (several under speculation;
        the cursor cuts them where the sample ended)."""
        tail: list[int] = []
        if req.output is not None and not req.failed:
            tail = req.output[req.n_consumed:]
            if -1 in tail:  # async scheduling's placeholders: not known
                tail = tail[:tail.index(-1)]
        req.asap.finish(tail)

    def _apply_v1(self, logits: torch.Tensor) -> torch.Tensor:
        rows, reqs = self._v1_requests(logits.shape[0])
        return self._mask(logits, rows, reqs)

    def _v1_requests(self, n_rows: int) -> tuple[list[int], list["GrammarRequest"]]:
        """The batch's grammar requests (rows below ``n_rows``), each advanced
        to its committed output."""
        rows: list[int] = []
        reqs: list[GrammarRequest] = []
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
        reqs: list[GrammarRequest] = []
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
