"""Sample first, check after: the ``"sampling": "awrs"`` mode of the grammar
processor (adaptive weighted rejection sampling, Lipkin et al. 2025).

Why: the mask mode asks the grammar about every vocabulary entry at every
step and writes ``-inf`` over the refused logits, yet the token the model
would draw is usually allowed already. Here a step draws the token vLLM's
sampler would draw, asks the grammar (and the request's check, see
``vllm_plugins.grammar.checks``) about that one token, and on a refusal
removes it and draws again. Only after ``MAX_REFUSALS`` refusals is the
whole mask computed. The row handed back to vLLM lets through only the
chosen token, so vLLM's sampler and rejection sampler take it unchanged
(a greedy row whose argmax is allowed is left as it is: its argmax is the
chosen token already).

Why it is exact: vLLM draws a token as the winner of a race, the argmax of
the processed logits plus per-token noise that does not depend on the
logits (Gumbel noise from one seed per row in the CPU sampler's
``fused_gumbel_argmax``; exponential noise in ``random_sample`` elsewhere).
The mask mode's token is the race winner over the allowed tokens. Drawing
again without the refused token, with the same noise, is the next runner-up,
so the first allowed winner is exactly the mask mode's token for that noise:
the same distribution, and for a seeded request the same token (this module
keeps a copy of the request's generator and draws from it what vLLM's
sampler draws in a plain step, so vLLM's own draws stay as in the mask
mode). Greedy is the race without noise (vLLM's ``greedy_sample``). An
unseeded row needs the distribution only: it is drawn by inverse CDF from
one softmax over the step's unseeded rows (``awrs_draw.CdfDraw``), refused
tokens taken out the same way, at a fraction of a vocabulary-wide race.

Weights (``"weights": true``): each row also gives an unbiased estimate of
its allowed mass (``RowChoice._estimate``: one more check, of the next draw);
the logs of the committed rows' estimates add up to the request's weight,
which sequential Monte Carlo over samples uses (docs/grammar.md).

Truncation: ``top_k`` is kept exactly: a winner is in the mask mode's top-k
when fewer than ``k`` allowed tokens outrank it, and the tokens above it are
checked for that (none when fewer than ``k`` tokens outrank it at all).
``top_p`` and ``min_p`` depend on the whole allowed mass: such rows compute
the mask first (exact, no saving). Penalties run after logits processors in
vLLM's sampler and would change the race: refused at admission
(:func:`validate_awrs`).

Under speculation each verified row gets its own draw after the drafts
before it, one-hot like the plain rows; vLLM's rejection sampler then keeps
a draft exactly when it equals that row's token, which leaves each
position's token distributed as in the mask mode.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from vllm_plugins.grammar.checks import check_function
from vllm_plugins.grammar.spec import (GRAMMAR_KEY, CompiledGrammar, GrammarSpecError,
                                       RequestOptions)
from vllm_plugins.tree.sampling import is_greedy

from .awrs_choice import _NEG_INF, AwrsStats, RowChoice
from .awrs_draw import argmax_rows, row_weights, warm_up

if TYPE_CHECKING:
    from vllm import SamplingParams

    from vllm_plugins.grammar.runtime import GrammarRuntime

    from .grammar_state import GrammarRequest

def validate_awrs(params: "SamplingParams", compiled: CompiledGrammar,
                  options: RequestOptions | None = None) -> None:
    """Refuse what AWRS cannot draw exactly (a ValueError fails only the request)."""
    if compiled.sampling != "awrs":
        return
    where = f'extra_args["{GRAMMAR_KEY}"]["sampling"] "awrs"'
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
        if getattr(params, name, neutral) != neutral:
            raise GrammarSpecError(
                f"{where} cannot be combined with {name}={getattr(params, name)!r}: "
                f"vLLM applies penalties after logits processors")
    if options is not None and options.weights:
        where = f'extra_args["{GRAMMAR_KEY}"]["weights"]'
        if is_greedy(params):
            raise GrammarSpecError(f"{where} needs random sampling (temperature > 0), got "
                                   f"temperature={params.temperature}")
        if params.n > 1:
            raise GrammarSpecError(f"{where} needs n=1 (a weight belongs to one output; "
                                   f"send one request per sample), got n={params.n}")
        for name, neutral in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0)):
            value = getattr(params, name)
            if value != neutral and not (name == "top_k" and value == -1):
                raise GrammarSpecError(
                    f"{where} cannot be combined with {name}={value!r}: a truncated "
                    f"row's allowed mass is not the grammar's")


class AwrsRequest:
    """One request's sampling settings, generator copy and check."""

    __slots__ = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed", "gen",
                 "check", "text", "decode", "_skip", "weights", "logprobs")

    def __init__(self, params: "SamplingParams", check: Callable[[str, str], bool] | None,
                 vocab_size: int, n_output: int = 0,
                 decode: Callable[[list[int]], bytes] | None = None,
                 weights: bool = False) -> None:
        self.greedy = is_greedy(params)
        self.temperature = float(params.temperature)
        k = int(params.top_k or 0)
        self.top_k = k if 0 < k < vocab_size else 0  # as vLLM's input batch reads it
        self.top_p = float(params.top_p)
        self.min_p = float(params.min_p or 0.0)
        self.seed = params.seed
        self.gen: torch.Generator | None = None  # built on the row's device
        # A resumed request (preempted) has drawn once per output token.
        self._skip = n_output
        self.check = check
        self.decode = decode  # token ids -> bytes (the check's text)
        self.text = b""  # the committed output's bytes, for the check
        self.weights = weights  # estimate each step's allowed mass
        self.logprobs = params.logprobs is not None  # vLLM reports the drawn token's

    @property
    def after_sample(self) -> bool:
        """An unseeded row vLLM's own draw can serve: no truncation, no
        weights, no logprobs of the drawn token (:meth:`AwrsRows.awrs_after_sample`)."""
        return not (self.greedy or self.seed is not None or self.truncated or self.top_k
                    or self.weights or self.logprobs)

    def advance(self, tokens: list[int]) -> None:
        """The request committed ``tokens``."""
        if self.check is not None:
            self.text += self.decode(tokens)

    @property
    def truncated(self) -> bool:
        """top-p or min-p: the kept set depends on the whole allowed mass."""
        return self.top_p < 1.0 or self.min_p > 0.0

    def _generator(self, device: torch.device, width: int) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self.gen is None:  # as vLLM's model runner builds the request's own
            self.gen = torch.Generator(device=device)
            self.gen.manual_seed(self.seed)
            for _ in range(self._skip):
                self._draw(self.gen, width, device)
        return self.gen

    @staticmethod
    def _draw(gen, width: int, device: torch.device):
        if device.type == "cpu":  # vLLM's forward_cpu: one seed per row
            return torch.randint(0, 2**31, (1,), generator=gen, dtype=torch.long)
        q = torch.empty(width, dtype=torch.float32, device=device)  # random_sample
        return q.exponential_(generator=gen)

    def noise(self, width: int, device: torch.device):
        """A seeded row's draw, from the request's generator copy; None for
        an unseeded row (drawn by :class:`CdfDraw` instead)."""
        if self.seed is None:
            return None
        return self._draw(self._generator(device, width), width, device)


def new_awrs(params: "SamplingParams", compiled: CompiledGrammar, rt: "GrammarRuntime",
             vocab_size: int, output: list[int] | None,
             options: RequestOptions | None = None) -> AwrsRequest:
    """A request's AWRS state; ``output``: what it has generated already
    (a request resumed after preemption), consumed by its matcher later."""
    check = check_function(compiled.check) if compiled.check else None
    options = options or RequestOptions()
    warm_up()
    areq = AwrsRequest(params, check, vocab_size, len(output or ()),
                       rt.ll_tokenizer.decode_bytes, options.weights)
    if check is not None and options.continue_tokens:
        areq.text = rt.ll_tokenizer.decode_bytes(list(options.continue_tokens))
    return areq


def one_hot(logits: torch.Tensor, rows: list[int], toks: list[int]) -> None:
    """Rows that let only their chosen token through (on the CPU through
    numpy: a row's fill there is a memset, torch's index_fill_ several times it)."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        table = logits.detach().numpy()
        for row, tok in zip(rows, toks):
            table[row].fill(_NEG_INF)
            table[row, tok] = 0.0
        return
    from vllm_plugins.grammar.runtime import GrammarRuntime

    GrammarRuntime.force_token(logits, rows, toks)


class AwrsRows:
    """Mixed into GrammarLogitsProcessor: the rows of its AWRS requests,
    plain (:meth:`_awrs_plain`) and drafted (:meth:`_awrs_positions`)."""

    awrs_stats: AwrsStats
    #: Set by the model runner's ``_sample`` wrapper (the bridge), which then
    #: calls :meth:`awrs_after_sample` with vLLM's draw: plain unseeded rows
    #: are left to that draw and checked after it, so the processor never
    #: draws them itself (vLLM's draw is the first draw of the loop).
    awrs_defer: bool = False
    _awrs_deferred: list = []

    def _awrs_request(self, req: "GrammarRequest", compiled: CompiledGrammar,
                      params: "SamplingParams", output: list[int] | None,
                      options: RequestOptions | None = None) -> None:
        """Give ``req`` its AWRS state (V1 runner); on V2 it is masked
        plainly, and a request with a check (which no mask applies) fails."""
        if self._v2:
            self._log_once("awrs:v2", "grammar 'sampling': 'awrs' runs on vLLM's V1 "
                           "model runner only; on V2 such requests are masked plainly")
            if compiled.check is not None:
                req.fail("a token check needs vLLM's V1 model runner")
            return
        try:
            req.awrs = new_awrs(params, compiled, self._runtime, self._vocab_size, output,
                                options)
        except ValueError as e:  # the check is no longer installed here
            req.fail(str(e))

    def _awrs_ready(self, req: "GrammarRequest") -> bool:
        return (req.awrs is not None and self._runtime is not None
                and not req.must_stop)

    def take_awrs_weights(self) -> dict[int, list[float]]:
        """Batch index -> the log weights of this step's rows of each request
        with ``"weights": true``, by position (row j: after j drafts), up to
        the first position without one. The bridge adds those of the tokens
        the step commits to the request's total (``bridge.grammar_weights``)."""
        taken, self._awrs_weights = getattr(self, "_awrs_weights", {}), {}
        out = {}
        for index, by_pos in taken.items():
            ws = []
            while len(ws) in by_pos:
                ws.append(by_pos[len(ws)])
            out[index] = ws
        return out

    def _awrs_weigh(self, index: int, pos: int, log_weight: float | None) -> None:
        if log_weight is not None:
            weights = self.__dict__.setdefault("_awrs_weights", {})
            weights.setdefault(index, {})[pos] = log_weight

    def _awrs_stop_weight(self, req: "GrammarRequest", row_logits: torch.Tensor) -> float | None:
        """A weighted request whose grammar has ended: EOS is forced, and the
        row's allowed mass is EOS's, exactly."""
        areq = req.awrs
        if areq is None or not areq.weights or req.failed or not req.matcher.is_stopped():
            return None
        return float(torch.log_softmax(row_logits / areq.temperature, -1)[req.eos])

    def _awrs_fail(self, req: "GrammarRequest", why: str) -> None:
        req.fail(why)
        self._log_once(f"awrs:{why}", "grammar request failed: %s", why)

    def _awrs_decide(self, choice: RowChoice, row_logits: torch.Tensor,
                     first: int | None = None, draw=None) -> int | None:
        req = choice.req
        try:
            noise = None if choice.areq.greedy else choice.areq.noise(
                row_logits.shape[0], row_logits.device)
            tok = choice.choose(row_logits, noise, first, draw)
        except Exception as e:  # noqa: BLE001 - a failing check fails its request only
            self._awrs_fail(req, f"token check {choice.areq.check!r} raised "
                                 f"{type(e).__name__}: {e}")
            return None
        if tok is None:
            self._awrs_fail(req, "the grammar and check allow no token here")
        return tok

    def _awrs_plain(self, logits: torch.Tensor, rows: list[int],
                    reqs: list["GrammarRequest"]) -> tuple[list[int], list["GrammarRequest"]]:
        """Decide the AWRS requests' plain rows; return the other rows."""
        rest_rows, rest_reqs, hot_rows, hot_toks = [], [], [], []
        # The greedy rows' argmax, and the unseeded rows' softmax, in one call
        # each (a call per row costs several times more).
        self._awrs_deferred, self._awrs_logits = [], logits
        ready = [(row, req) for row, req in zip(rows, reqs) if self._awrs_ready(req)
                 and not req.awrs.truncated]
        if self.awrs_defer:
            self._awrs_deferred = [(row, req) for row, req in ready if req.awrs.after_sample]
            deferred = {row for row, _ in self._awrs_deferred}
            ready = [(row, req) for row, req in ready if row not in deferred]
        greedy = [row for row, req in ready if req.awrs.greedy]
        firsts = dict(zip(greedy, argmax_rows(logits, greedy)))
        unseeded = [(row, req.awrs.temperature) for row, req in ready
                    if not req.awrs.greedy and req.awrs.seed is None]
        draws = {}
        if unseeded:
            draws = dict(zip([r for r, _ in unseeded], row_weights(
                logits, [r for r, _ in unseeded], [t for _, t in unseeded])))
        deferred = {row for row, _ in self._awrs_deferred}
        for row, req in zip(rows, reqs):
            if not self._awrs_ready(req):
                self._awrs_weigh(row, 0, self._awrs_stop_weight(req, logits[row]))
                rest_rows.append(row)
                rest_reqs.append(req)
                continue
            if row in deferred:
                continue
            choice = RowChoice(self._runtime, req, req.awrs.text, self.awrs_stats)
            tok = self._awrs_decide(choice, logits[row], firsts.get(row), draws.get(row))
            if tok is None:  # failed: the mask path forces its failure text
                rest_rows.append(row)
                rest_reqs.append(req)
                continue
            self._awrs_weigh(row, 0, choice.log_weight)
            if not choice.untouched:
                hot_rows.append(row)
                hot_toks.append(tok)
        one_hot(logits, hot_rows, hot_toks)
        return rest_rows, rest_reqs

    @property
    def awrs_deferred_rows(self) -> list[int]:
        """The rows of this step left to vLLM's draw (benchmarks read it)."""
        return [row for row, _ in self._awrs_deferred]

    def awrs_after_sample(self, sampled: torch.Tensor) -> None:
        """vLLM's sampler drew the deferred rows' tokens (``sampled``, [rows,
        1], changed in place) from the rows as this processor left them,
        after dividing them by their temperature in place (pinned in
        tests/test_bridge_pins_processors.py). An allowed token stands; a
        refused one is taken out and the row drawn on as :meth:`_awrs_plain`
        draws: the first draw of the loop was vLLM's own."""
        deferred, self._awrs_deferred = self._awrs_deferred, []
        logits, self._awrs_logits = getattr(self, "_awrs_logits", None), None
        if not deferred:
            return
        toks = sampled[[row for row, _ in deferred], 0].tolist()
        refused = []
        for (row, req), tok in zip(deferred, toks):
            choice = RowChoice(self._runtime, req, req.awrs.text, self.awrs_stats)
            try:
                if choice.drawn_ok(int(tok)):
                    continue
            except Exception as e:  # noqa: BLE001 - a failing check fails its request only
                self._awrs_after_sample_failed(row, req, e)
                continue
            refused.append((row, req, choice, int(tok)))
        if not refused:
            return
        # The refused rows' weights in one pass (rows at temperature already).
        draws = row_weights(logits, [row for row, *_ in refused], [1.0] * len(refused),
                            use="refused")
        for (row, req, choice, tok), draw in zip(refused, draws):
            try:
                new = choice.redraw(tok, logits[row], draw)
            except Exception as e:  # noqa: BLE001 - a failing check fails its request only
                self._awrs_after_sample_failed(row, req, e)
                continue
            if new is None:
                self._awrs_after_sample_failed(row, req, None)
            else:
                sampled[row, 0] = new

    def _awrs_after_sample_failed(self, row: int, req: "GrammarRequest",
                                  error: Exception | None) -> None:
        """The step's token is not the grammar's: the scheduler drops it and
        ends the request with an error (take_failures, now)."""
        why = "the grammar and check allow no token here" if error is None else (
            f"token check {req.awrs.check!r} raised {type(error).__name__}: {error}")
        self._awrs_fail(req, why)
        req.reported = True
        self._failures[row] = req.failed

    def _awrs_positions(self, logits: torch.Tensor,
                        plan: list[tuple["GrammarRequest", list[int], list[int | None]]]
                        ) -> list[tuple["GrammarRequest", list[int], list[int | None]]]:
        """Drafted rows of AWRS requests: row j decided after the matcher
        tentatively consumed ``draft[:j]`` (rolled back after); rows after a
        draft the grammar refuses take EOS (never used). Returns the rest."""
        rest, hot_rows, hot_toks = [], [], []
        rt = self._runtime
        index_of = {id(r): i for i, r in self._reqs.items()}
        for req, draft, rows in plan:
            if not self._awrs_ready(req):
                rest.append((req, draft, rows))
                continue
            index = index_of.get(id(req), -1)
            m = req.matcher
            n_ok = 0
            text = req.awrs.text
            for j, row in enumerate(rows):
                if j:
                    tok = int(draft[j - 1])
                    if m.is_stopped() or m.try_consume_tokens([tok]) != 1:
                        after = [r for r in rows[j:] if r is not None]
                        hot_rows.extend(after)
                        hot_toks.extend([req.eos] * len(after))
                        break
                    n_ok += 1
                    text += rt.ll_tokenizer.decode_bytes([tok])
                if row is None:
                    continue
                if m.is_stopped():
                    self._awrs_weigh(index, j, self._awrs_stop_weight(req, logits[row]))
                    hot_rows.append(row)
                    hot_toks.append(req.eos)
                    continue
                choice = RowChoice(rt, req, text, self.awrs_stats)
                tok = self._awrs_decide(choice, logits[row])
                if tok is not None:
                    self._awrs_weigh(index, j, choice.log_weight)
                if tok is None or not choice.untouched:
                    hot_rows.append(row)
                    hot_toks.append(req.eos if tok is None else tok)
            if n_ok:
                m.rollback(n_ok)
        one_hot(logits, hot_rows, hot_toks)
        return rest
