"""One grammar request's matcher, and how far it has read the output.

The processor keeps one per batch row; the plain step, the verification of
drafted rows and the V2 runner's interface all advance it the same way.
"""

from __future__ import annotations

import llguidance
import torch

from vllm_plugins.grammar.runtime import GrammarRuntime

from .asap import AsapCursor
from .awrs import AwrsRequest
from .grammar_topk import MaskedTopk

_PLACEHOLDER = -1  # vLLM's async-scheduling placeholder for a not-yet-known token
#: What a request whose grammar failed says at the end of its output.
FAILURE_TEXT = " [grammar error: output stopped]"


class GrammarRequest:
    """One request's matcher and how far it has read the request's output."""

    __slots__ = ("matcher", "output", "n_consumed", "eos", "failed", "asap",
                 "after_failure", "reported", "awrs")

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
        # ``"sampling": "awrs"`` (V1): its settings, generator copy and check.
        self.awrs: AwrsRequest | None = None

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
        if self.awrs is not None and not self.failed:
            self.awrs.advance(tokens)

    def start_after(self, tokens: tuple[int, ...]) -> None:
        """``"continue_tokens"``: the output continues these tokens (the
        prompt ends with them), so the grammar starts after them."""
        if tokens and not self.failed and not self.matcher.consume_tokens(list(tokens)):
            self.fail(f'"continue_tokens" do not follow the grammar: '
                      f"{self.matcher.get_error() or 'a token is refused'}")

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


def copy_bit(bitmask: torch.Tensor, row: int, src: int, dst: int) -> None:
    """If token ``src`` is allowed in ``bitmask[row]``, allow ``dst`` too."""
    words = bitmask[row].numpy().view("uint32")
    if (words[src >> 5] >> (src & 31)) & 1 and (dst >> 5) < len(words):
        words[dst >> 5] |= 1 << (dst & 31)


def apply_masks(rt: GrammarRuntime, logits: torch.Tensor, bitmask: torch.Tensor | None,
                mask_rows: list[int], mask_eos: list[int],
                force_rows: list[int], force_toks: list[int],
                masked_topk: MaskedTopk) -> None:
    """Masked rows take their filled bitmask rows, with each request's own
    EOS allowed wherever the tokenizer's is; forced rows take one token.
    The rows' top-k is then recorded in ``masked_topk`` for a drafter that
    learns from it (``grammar_topk``; nothing when none asked)."""
    if bitmask is not None and mask_rows:
        for row, eos in zip(mask_rows, mask_eos):
            if eos != rt.eos_token:
                copy_bit(bitmask, row, rt.eos_token, eos)
        rt.apply(logits, mask_rows, mask_rows)
    if force_rows:
        GrammarRuntime.force_token(logits, force_rows, force_toks)
    masked_topk.record(logits, mask_rows + force_rows)
