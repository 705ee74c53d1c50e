"""One row's decision under ``"sampling": "awrs"``: draw, check the drawn
token, take refused ones out and draw again, the whole mask after too many
refusals; with weights, the estimate of the row's allowed mass.

Why a module of its own: :mod:`.awrs` says why the decision is exact and
wires it into the processor; this is the per-row work the benchmarks time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from .awrs_draw import BLOCK, CdfDraw, block_sums, race, row_draw, scratch_copy

if TYPE_CHECKING:
    from vllm_plugins.grammar.runtime import GrammarRuntime

    from .awrs import AwrsRequest
    from .grammar_state import GrammarRequest

#: Refusals in one row before the whole mask is computed.
MAX_REFUSALS = 8
#: With top-k: the most tokens ranked above a drawn token that are checked
#: to place it in the allowed top-k; beyond that the mask is computed.
MAX_TOPK_SCAN = 256
_NEG_INF = float("-inf")
_MASK = object()  # a row's draws gave up: compute the whole mask


@dataclass
class AwrsStats:
    """Counts over a processor's lifetime (benchmarks read them)."""

    rows: int = 0          # rows decided by AWRS
    checks: int = 0        # single-token grammar checks (validate_tokens)
    check_calls: int = 0   # calls of requests' token checks
    masks: int = 0         # rows that computed the whole mask
    mask_tokens: int = 0   # vocabulary entries those masks covered


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
        self.log_weight: float | None = None  # with weights: log of the allowed mass estimate
        self._row: torch.Tensor | None = None
        self._scaled: torch.Tensor | None = None
        self._draw: CdfDraw | None = None  # an unseeded row's draws
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

    def choose(self, row: torch.Tensor, noise, first: int | None = None,
               draw: CdfDraw | None = None) -> int | None:
        """The mask mode's token for this row (for a seeded row's ``noise``,
        the very token; unseeded, a draw from its distribution); None:
        nothing is allowed. ``first``: the greedy argmax of ``row``, and
        ``draw``: an unseeded row's inverse-CDF draw, when the caller took
        them for several rows in one call. With weights, :attr:`log_weight`
        is then set (:meth:`_estimate`)."""
        areq = self.areq
        self.stats.rows += 1
        self.log_weight = None
        self.untouched = False
        self._row, self._scaled, self._draw = row, None, None
        if not areq.truncated:
            if areq.greedy or noise is not None:
                tok = self._race(self.scaled(), noise, first)
            else:
                tok = self._cdf(draw if draw is not None else row_draw(self.scaled()))
            if tok is not _MASK:
                return tok
        return self._masked(self.scaled(), noise)

    def scaled(self) -> torch.Tensor:
        """The row at the request's temperature, as vLLM's
        ``Sampler.apply_temperature`` divides it (computed when needed)."""
        if self._scaled is None:
            row = self._row
            self._scaled = row if self.areq.greedy else row / torch.tensor(
                self.areq.temperature, dtype=torch.float32, device=row.device)
        return self._scaled

    def _ok(self, tok: int) -> bool | None:
        """Whether the mask mode could draw ``tok``; None: too costly to tell."""
        ok = self.allowed(tok)
        if ok and self.areq.top_k and not self.areq.greedy:
            ok = self.in_top_k(tok, self.scaled())
        return ok

    def _race(self, scaled: torch.Tensor, noise, first: int | None):
        """vLLM's race (greedy, or a seeded row's replayed noise), refused
        tokens taken out; _MASK after too many refusals."""
        work = scaled  # copied at the first refusal (never the caller's row)
        for n in range(MAX_REFUSALS + 1):
            tok = first if n == 0 and first is not None else race(work, noise)
            if float(work[tok]) == _NEG_INF:
                return None  # every token removed
            ok = self._ok(tok)
            if ok is None:
                break
            if ok:
                # Greedy's first draw is the row's own argmax: vLLM draws it
                # again from the row as it is.
                self.untouched = self.areq.greedy and n == 0
                if self.areq.weights:
                    self.log_weight = self._race_estimate(scaled, work, noise, tok)
                return tok
            if n == 0:
                work = scratch_copy(scaled) if noise is None else scaled.clone()
            work[tok] = _NEG_INF
        return _MASK

    def drawn_ok(self, tok: int) -> bool:
        """Whether the mask mode could have drawn ``tok``, the token vLLM's
        sampler drew from this untruncated row."""
        self.stats.rows += 1
        self.untouched = False
        return self.allowed(tok)

    def redraw(self, tok: int, scaled: torch.Tensor, draw: CdfDraw) -> int | None:
        """The mask mode's token for a row whose drawn ``tok`` was refused
        (:meth:`drawn_ok`): ``tok`` taken out of ``draw`` (the inverse-CDF
        weights of ``scaled``, the row at the request's temperature), what
        :meth:`choose` draws on."""
        self._row = self._scaled = scaled
        draw.remove(tok)
        tok = self._cdf(draw, refused=1)
        return self._masked(scaled, None) if tok is _MASK else tok

    def _cdf(self, draw: CdfDraw, refused: int = 0):
        """An unseeded row: inverse-CDF draws, refused tokens taken out."""
        self._draw = draw
        for _ in range(MAX_REFUSALS + 1 - refused):
            tok = draw.draw()
            if tok is None:
                return None
            ok = self._ok(tok)
            if ok is None:
                break
            if ok:
                if self.areq.weights:
                    def second() -> int | None:
                        removed = draw.remove(tok)
                        nxt = draw.draw()
                        draw.restore(tok, removed)
                        return nxt

                    self.log_weight = self._estimate(draw.p(tok), draw.total / draw.initial,
                                                     second)
                return tok
            draw.remove(tok)
        return _MASK

    def _estimate(self, p_tok: float, left: float, second) -> float:
        """log of an unbiased estimate of the row's allowed mass Z (recursive
        AWRS, Lipkin et al. 2025), given the accepted token's mass ``p_tok``
        and the mass ``left`` after the refused tokens: ``p_tok`` plus the
        rest of ``left`` when ``second()`` (one more draw without replacement,
        the accepted token out too) is allowed. Given any accepted token the
        mean is Z, and a refusal removes mass outside Z only: unbiased
        (tests/test_awrs_weights.py)."""
        nxt = second()
        z = p_tok
        if nxt is not None and self.allowed(nxt):
            z += max(left - p_tok, 0.0)
        return math.log(z) if z > 0.0 else _NEG_INF

    def _race_estimate(self, scaled: torch.Tensor, work: torch.Tensor, noise,
                       tok: int) -> float:
        """:meth:`_estimate` for a raced row: the second draw is the race's
        runner-up for the same noise (a race's order is a draw without
        replacement)."""
        probs = scaled.softmax(-1)
        refused = float(probs[torch.isneginf(work)].sum()) if work is not scaled else 0.0

        def second() -> int | None:
            rest = work.clone()
            rest[tok] = _NEG_INF
            if not torch.isfinite(rest).any():
                return None
            nxt = race(rest, noise)
            return None if float(rest[nxt]) == _NEG_INF else nxt

        return self._estimate(float(probs[tok]), 1.0 - refused, second)

    def _allowed(self, width: int) -> np.ndarray:
        """The whole mask as vLLM's row of ``width`` sees it: uint8, 1 where
        the grammar (and the check) allows the token."""
        rt, req = self.rt, self.req
        self.stats.masks += 1
        self.stats.mask_tokens += rt.vocab_size
        bits = np.unpackbits(_fill(rt, req.matcher).numpy()[0].view(np.uint8),
                             bitorder="little")  # bit j of word w: token 32*w + j
        allowed = np.zeros(width, dtype=np.uint8)  # ids past the tokenizer: never
        n = min(width, bits.shape[0])
        allowed[:n] = bits[:n]
        if req.eos != rt.eos_token and req.eos < width:
            allowed[req.eos] = allowed[rt.eos_token]
        if self.areq.check is not None:
            for tok in np.flatnonzero(allowed).tolist():
                if tok not in self._eos:
                    ok = self.known.get(tok)
                    allowed[tok] = self._check(tok) if ok is None else ok
        return allowed

    def _banned(self, width: int, device: torch.device) -> torch.Tensor:
        """:meth:`_allowed` as vLLM's row takes it: True where refused."""
        return torch.from_numpy(self._allowed(width) == 0).to(device)

    def _masked_draw(self, draw: CdfDraw) -> int | None:
        """The fallback of an unseeded untruncated row: its inverse-CDF
        weights cut to the allowed tokens (numpy, no vocabulary-wide tensor)."""
        v = self._row.shape[0]
        w = draw.weights
        np.multiply(w[:v], self._allowed(v), out=w[:v])
        blocks = block_sums(w[None])[0]
        if not blocks.any():
            return None
        if self.areq.weights:
            z = float(blocks.sum()) / draw.initial
            self.log_weight = math.log(z) if z > 0.0 else _NEG_INF
        return CdfDraw(w, blocks, draw.rng).draw()

    def _masked(self, scaled: torch.Tensor, noise) -> int | None:
        """The fallback: the whole mask, then vLLM's own draw over it (an
        unseeded row: the inverse-CDF draw); with weights, Z exactly."""
        draw = self._draw
        if (isinstance(draw, CdfDraw) and not self.areq.truncated and not self.areq.top_k
                and draw.weights.shape[0] % BLOCK == 0):
            return self._masked_draw(draw)
        banned = self._banned(scaled.shape[0], scaled.device)
        if self.areq.greedy and scaled.device.type == "cpu" and not self.areq.weights:
            work = np.where(banned.numpy(), np.float32(_NEG_INF), scaled.detach().float().numpy())
            return int(work.argmax()) if np.isfinite(work).any() else None
        work = scaled.masked_fill(banned, _NEG_INF)
        if not torch.isfinite(work).any():
            return None
        if self.areq.weights:
            z = float(scaled.softmax(-1)[~banned].sum())
            self.log_weight = math.log(z) if z > 0.0 else _NEG_INF
        if self.areq.greedy:
            return race(work, None)
        work = truncate(work, self.areq)
        if noise is None:
            return row_draw(work).draw()
        return race(work, noise)


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


