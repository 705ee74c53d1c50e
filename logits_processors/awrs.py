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
mode). Greedy is the race without noise (vLLM's ``greedy_sample``).

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from vllm_plugins.grammar.checks import check_function
from vllm_plugins.grammar.spec import GRAMMAR_KEY, CompiledGrammar, GrammarSpecError
from vllm_plugins.tree.sampling import is_greedy

if TYPE_CHECKING:
    from vllm import SamplingParams

    from vllm_plugins.grammar.runtime import GrammarRuntime

    from .grammar_state import GrammarRequest

#: Refusals in one row before the whole mask is computed.
MAX_REFUSALS = 8
#: With top-k: the most tokens ranked above a drawn token that are checked
#: to place it in the allowed top-k; beyond that the mask is computed.
MAX_TOPK_SCAN = 256
_NEG_INF = float("-inf")


@dataclass
class AwrsStats:
    """Counts over a processor's lifetime (benchmarks read them)."""

    rows: int = 0          # rows decided by AWRS
    checks: int = 0        # single-token grammar checks (validate_tokens)
    check_calls: int = 0   # calls of requests' token checks
    masks: int = 0         # rows that computed the whole mask
    mask_tokens: int = 0   # vocabulary entries those masks covered


def validate_awrs(params: "SamplingParams", compiled: CompiledGrammar) -> None:
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


class AwrsRequest:
    """One request's sampling settings, generator copy and check."""

    __slots__ = ("greedy", "temperature", "top_k", "top_p", "min_p", "seed", "gen",
                 "check", "text", "decode", "_skip")

    def __init__(self, params: "SamplingParams", check: Callable[[str, str], bool] | None,
                 vocab_size: int, n_output: int = 0,
                 decode: Callable[[list[int]], bytes] | None = None) -> None:
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
        return q.exponential_(generator=gen) if gen is not None else q.exponential_()

    def noise(self, width: int, device: torch.device):
        """This row's draw: from the request's generator copy when seeded."""
        return self._draw(self._generator(device, width), width, device)


def race(work: torch.Tensor, noise: torch.Tensor | None) -> int:
    """vLLM's draw from the (processed, masked) row ``work``: its greedy
    argmax without noise, else the race winner for ``noise``."""
    from vllm.v1.sample.sampler import Sampler

    if noise is None:
        return int(Sampler.greedy_sample(work[None])[0])
    if noise.dtype == torch.long:  # CPU: Gumbel noise from a seed
        return int(torch.ops._C.fused_gumbel_argmax(work[None], noise)[0])
    probs = work.softmax(-1, dtype=torch.float32)
    return int(probs.div_(noise).argmax())


def race_rows(logits: torch.Tensor, rows: list[int]) -> list[int]:
    """The greedy argmax of ``logits[rows]``, as vLLM's sampler takes it."""
    if not rows:
        return []
    from vllm.v1.sample.sampler import Sampler

    if rows == list(range(len(rows))):  # the leading rows: a view, no copy
        return Sampler.greedy_sample(logits[:len(rows)]).tolist()
    return Sampler.greedy_sample(logits[rows]).tolist()


def truncate(row: torch.Tensor, areq: AwrsRequest) -> torch.Tensor:
    """What vLLM's sampler does to a (masked, temperature-scaled) row after
    the logits processors: min-p, then top-k and top-p with its own code."""
    if areq.min_p > 0.0:  # vllm.v1.sample.logits_processor.builtin.MinPLogitsProcessor
        probs = torch.nn.functional.softmax(row, dim=-1)
        row = row.masked_fill(probs < probs.max() * areq.min_p, _NEG_INF)
    if areq.top_k or areq.top_p < 1.0:
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        k = torch.tensor([areq.top_k], dtype=torch.int32) if areq.top_k else None
        p = torch.tensor([areq.top_p], dtype=torch.float32) if areq.top_p < 1.0 else None
        row = apply_top_k_top_p(row[None].clone(), k, p)[0]
    return row


class RowChoice:
    """One row's decision: its matcher at the row's position, the text before it."""

    def __init__(self, rt: "GrammarRuntime", req: "GrammarRequest", text: bytes,
                 stats: AwrsStats) -> None:
        self.rt, self.req, self.stats = rt, req, stats
        self.areq: AwrsRequest = req.awrs
        self.text = text
        self.known: dict[int, bool] = {}
        self._eos = {req.eos, rt.eos_token}
        self.untouched = False  # the decision needs no write to the row
        self._ff: bytes | None = None  # the bytes the grammar forces next
        self._fft: list[int] | None = None  # their canonical tokens

    def allowed(self, tok: int) -> bool:
        ok = self.known.get(tok)
        if ok is not None:
            return ok
        rt = self.rt
        if tok >= rt.vocab_size:
            ok = False
        else:
            self.stats.checks += 1
            # The request's EOS is allowed wherever the tokenizer's is (apply_masks).
            ok = self.req.matcher.validate_tokens(
                [rt.eos_token if tok == self.req.eos else tok]) == 1
            if ok and self._forced_prefix(tok):
                ok = self._forced_tokens()[:1] == [tok]
            if ok and self.areq.check is not None and tok not in self._eos:
                ok = self._check(tok)
        self.known[tok] = ok
        return ok

    def _forced_prefix(self, tok: int) -> bool:
        """Whether ``tok`` spells a proper prefix of the bytes the grammar
        forces next. llguidance's mask then allows only the first token of
        the forced bytes' canonical tokenization, while ``validate_tokens``
        accepts any prefix (e.g. "la" of a forced property name "latitude"):
        the mask mode's rule, kept here (pinned in tests/test_awrs.py)."""
        if self._ff is None:
            self._ff = self.req.matcher.compute_ff_bytes()
        if not self._ff:
            return False
        piece = self.rt.ll_tokenizer.decode_bytes([tok])
        return len(piece) < len(self._ff) and self._ff.startswith(piece)

    def _forced_tokens(self) -> list[int]:
        if self._fft is None:
            self._fft = self.req.matcher.compute_ff_tokens()
        return self._fft

    def _check(self, tok: int) -> bool:
        self.stats.check_calls += 1
        piece = self.rt.ll_tokenizer.decode_bytes([tok])
        return bool(self.areq.check(self.text.decode("utf-8", "replace"),
                                    piece.decode("utf-8", "replace")))

    def in_top_k(self, tok: int, scaled: torch.Tensor) -> bool | None:
        """Whether ``tok`` is in the allowed top-k; None: too costly to tell."""
        k = self.areq.top_k
        above = (scaled > scaled[tok]).nonzero().flatten()
        if len(above) < k:
            return True
        if len(above) > MAX_TOPK_SCAN:
            return None
        order = above[scaled[above].argsort(descending=True)].tolist()
        n = 0
        for t in order:
            if self.allowed(t):
                n += 1
                if n >= k:
                    return False
        return True

    def choose(self, row: torch.Tensor, noise, first: int | None = None) -> int | None:
        """The mask mode's token for this row and noise; None: nothing is
        allowed. ``first``: the greedy argmax of ``row`` when the caller
        took it for several rows in one call."""
        areq = self.areq
        self.stats.rows += 1
        if areq.greedy:
            scaled = row
        else:  # vLLM's Sampler.apply_temperature
            scaled = row / torch.tensor(areq.temperature, dtype=torch.float32,
                                        device=row.device)
        self.untouched = False
        if not areq.truncated:
            work = scaled  # copied at the first refusal (never the caller's row)
            for n in range(MAX_REFUSALS + 1):
                tok = first if n == 0 and first is not None else race(work, noise)
                if float(work[tok]) == _NEG_INF:
                    return None  # every token removed
                ok = self.allowed(tok)
                if ok and areq.top_k and not areq.greedy:
                    ok = self.in_top_k(tok, scaled)
                    if ok is None:
                        break
                if ok:
                    # Greedy's first draw is the row's own argmax: vLLM
                    # draws it again from the row as it is.
                    self.untouched = areq.greedy and n == 0
                    return tok
                if n == 0:
                    work = scaled.clone()
                work[tok] = _NEG_INF
        return self._masked(scaled, noise)

    def _masked(self, scaled: torch.Tensor, noise) -> int | None:
        """The fallback: the whole mask, then vLLM's own draw over it."""
        rt, req = self.rt, self.req
        width = scaled.shape[0]
        self.stats.masks += 1
        self.stats.mask_tokens += rt.vocab_size
        words = _fill(rt, req.matcher)
        banned = rt.banned_tokens(words, width, scaled.device)[0]
        if req.eos != rt.eos_token and req.eos < width:
            banned[req.eos] = banned[rt.eos_token]
        if self.areq.check is not None:
            for tok in (~banned).nonzero().flatten().tolist():
                if tok not in self._eos:
                    ok = self.known.get(tok)
                    banned[tok] = not (self._check(tok) if ok is None else ok)
        work = scaled.masked_fill(banned, _NEG_INF)
        if not torch.isfinite(work).any():
            return None
        if not self.areq.greedy:
            work = truncate(work, self.areq)
        return race(work, noise)


def new_awrs(params: "SamplingParams", compiled: CompiledGrammar, rt: "GrammarRuntime",
             vocab_size: int, output: list[int] | None) -> AwrsRequest:
    """A request's AWRS state; ``output``: what it has generated already
    (a request resumed after preemption), consumed by its matcher later."""
    check = check_function(compiled.check) if compiled.check else None
    return AwrsRequest(params, check, vocab_size, len(output or ()),
                       rt.ll_tokenizer.decode_bytes)


_BITMASK: dict[int, torch.Tensor] = {}


def _fill(rt: "GrammarRuntime", matcher) -> torch.Tensor:
    """The matcher's next-token bitmask in a buffer of this module's (the
    runtime's is indexed by the batch's rows, which the processor fills)."""
    import llguidance.torch as llg_torch

    buf = _BITMASK.get(rt.vocab_size)
    if buf is None:
        buf = _BITMASK[rt.vocab_size] = llg_torch.allocate_token_bitmask(1, rt.vocab_size)
    llg_torch.fill_next_token_bitmask(matcher, buf, 0)
    return buf


def one_hot(logits: torch.Tensor, rows: list[int], toks: list[int]) -> None:
    """Rows that let only their chosen token through."""
    if rows:
        from vllm_plugins.grammar.runtime import GrammarRuntime

        GrammarRuntime.force_token(logits, rows, toks)


class AwrsRows:
    """Mixed into GrammarLogitsProcessor: the rows of its AWRS requests,
    plain (:meth:`_awrs_plain`) and drafted (:meth:`_awrs_positions`)."""

    awrs_stats: AwrsStats

    def _awrs_request(self, req: "GrammarRequest", compiled: CompiledGrammar,
                      params: "SamplingParams", output: list[int] | None) -> None:
        """Give ``req`` its AWRS state (V1 runner); on V2 it is masked
        plainly, and a request with a check (which no mask applies) fails."""
        if self._v2:
            self._log_once("awrs:v2", "grammar 'sampling': 'awrs' runs on vLLM's V1 "
                           "model runner only; on V2 such requests are masked plainly")
            if compiled.check is not None:
                req.fail("a token check needs vLLM's V1 model runner")
            return
        try:
            req.awrs = new_awrs(params, compiled, self._runtime, self._vocab_size, output)
        except ValueError as e:  # the check is no longer installed here
            req.fail(str(e))

    def _awrs_ready(self, req: "GrammarRequest") -> bool:
        return (req.awrs is not None and self._runtime is not None
                and not req.must_stop)

    def _awrs_fail(self, req: "GrammarRequest", why: str) -> None:
        req.fail(why)
        self._log_once(f"awrs:{why}", "grammar request failed: %s", why)

    def _awrs_decide(self, choice: RowChoice, row_logits: torch.Tensor,
                     first: int | None = None) -> int | None:
        req = choice.req
        try:
            noise = None if choice.areq.greedy else choice.areq.noise(
                row_logits.shape[0], row_logits.device)
            tok = choice.choose(row_logits, noise, first)
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
        # The greedy rows' argmax in one call (a call per row costs several times more).
        greedy = [row for row, req in zip(rows, reqs)
                  if self._awrs_ready(req) and req.awrs.greedy and not req.awrs.truncated]
        firsts = dict(zip(greedy, race_rows(logits, greedy)))
        for row, req in zip(rows, reqs):
            if not self._awrs_ready(req):
                rest_rows.append(row)
                rest_reqs.append(req)
                continue
            choice = RowChoice(self._runtime, req, req.awrs.text, self.awrs_stats)
            tok = self._awrs_decide(choice, logits[row], firsts.get(row))
            if tok is None:  # failed: the mask path forces its failure text
                rest_rows.append(row)
                rest_reqs.append(req)
            elif not choice.untouched:
                hot_rows.append(row)
                hot_toks.append(tok)
        one_hot(logits, hot_rows, hot_toks)
        return rest_rows, rest_reqs

    def _awrs_positions(self, logits: torch.Tensor,
                        plan: list[tuple["GrammarRequest", list[int], list[int | None]]]
                        ) -> list[tuple["GrammarRequest", list[int], list[int | None]]]:
        """Drafted rows of AWRS requests: row j decided after the matcher
        tentatively consumed ``draft[:j]`` (rolled back after); rows after a
        draft the grammar refuses take EOS (never used). Returns the rest."""
        rest, hot_rows, hot_toks = [], [], []
        rt = self._runtime
        for req, draft, rows in plan:
            if not self._awrs_ready(req):
                rest.append((req, draft, rows))
                continue
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
                    hot_rows.append(row)
                    hot_toks.append(req.eos)
                    continue
                choice = RowChoice(rt, req, text, self.awrs_stats)
                tok = self._awrs_decide(choice, logits[row])
                if tok is None or not choice.untouched:
                    hot_rows.append(row)
                    hot_toks.append(req.eos if tok is None else tok)
            if n_ok:
                m.rollback(n_ok)
        one_hot(logits, hot_rows, hot_toks)
        return rest
