"""One request's grammar, kept in step with its output, and the draft it forces.

Where the grammar leaves only one way to go, the *text* is forced, not the
tokens: after ``{"`` a schema with one property forces ``name"``, but the model
may write that as ``name`` + ``":`` or ``na`` + ``me"`` or anything else that
spells it. So the draft walks the forced bytes (``LLMatcher.compute_ff_bytes``)
and tokenizes them with the model's tokenizer, keeping only the prefix whose
tokenization cannot change with what follows (``LLTokenizer.tokenize_partial``:
the trailing ``"`` above stays out, because ``":`` is a token too). Every
drafted token is checked against the grammar; a draft stops at the first token
the grammar rejects.

After the forced tokens, the inner proposer's draft continues: its tokens are
used as long as they agree with what was forced (same position), else the
inner proposer is asked for a continuation after the draft so far (when it can
give one), and the walk alternates forced text and inner tokens until the
budget is spent or the grammar rejects a token.

The matcher is advanced tentatively while drafting and rolled back after, so
between steps it holds exactly the request's output tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import llguidance

# (tokens so far in this draft, how many more) -> the inner proposer's tokens
Continuation = Callable[[list[int], int], list[int]]


class RequestGrammar:
    """An ``LLMatcher`` that follows one request's output tokens."""

    def __init__(self, matcher: llguidance.LLMatcher, ll_tokenizer: llguidance.LLTokenizer):
        self.matcher = matcher
        self.tokenizer = ll_tokenizer
        self.consumed = 0  # output tokens the matcher holds
        self.error: str | None = None

    # -------------------------------------------------------------- following
    def follow(self, output: Sequence[int]) -> bool:
        """Consume output tokens not yet seen. False once the grammar rejected
        one (e.g. vLLM's backend allows text ours does not): the request then
        drafts without the grammar."""
        if self.error is not None:
            return False
        if len(output) < self.consumed:  # output shrank (never seen): start over
            self.matcher.reset()
            self.consumed = 0
        new = [int(t) for t in output[self.consumed:]]
        if not new:
            return True
        if self.matcher.is_stopped():
            # Complete: only EOS (or a stop token vLLM adds) can follow.
            self.consumed = len(output)
            return True
        n = self.matcher.try_consume_tokens(new)
        self.consumed += n
        if n < len(new):
            if self.matcher.is_stopped() and self.matcher.is_accepting():
                # The grammar ended with EOS / a stop token: nothing more to follow.
                self.consumed = len(output)
                return True
            self.error = (f"token {new[n]} at output position {self.consumed} is "
                          f"rejected: {self.matcher.get_error() or 'not allowed'}")
            return False
        return True

    # -------------------------------------------------------------- drafting
    def forced_tokens(self, limit: int, recent: Sequence[int] = ()) -> list[int]:
        """Tokens for the text the grammar forces next, at most ``limit``: the
        unambiguous tokenization of the forced bytes, cut at the first token
        the grammar rejects."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        forced = self.matcher.compute_ff_bytes()
        if not forced:
            return []
        tokens, _ambiguous_tail = self.tokenizer.tokenize_partial(
            forced, recent_tokens=[int(t) for t in recent[-8:]])
        tokens = [int(t) for t in tokens[:limit]]
        if not tokens:
            return []
        return tokens[:self.matcher.validate_tokens(tokens)]

    def draft(self, budget: int, inner: Sequence[int] = (), recent: Sequence[int] = (),
              continuation: Continuation | None = None,
              eos: int | None = None) -> tuple[list[int], list[bool]]:
        """Forced tokens, then the inner draft, alternating, checked by the
        grammar. Returns the tokens and, per token, whether it was forced.

        ``inner`` is the inner proposer's draft from the current position;
        ``continuation`` gives more inner tokens after a draft prefix that the
        inner draft did not start with (None: no inner tokens there). Where
        the grammar is complete and nothing may follow, the draft ends with
        ``eos`` (the request's EOS, which both vLLM's structured output and
        our processor force there), so the step that verifies the closing
        text also ends the request."""
        out: list[int] = []
        forced_flags: list[bool] = []
        pending: list[int] | None = [int(t) for t in inner]  # inner tokens aligned here
        consumed = 0
        try:
            while len(out) < budget:
                if self.matcher.is_stopped():
                    if eos is not None:
                        out.append(int(eos))
                        forced_flags.append(True)
                    break
                f = self.forced_tokens(budget - len(out), [*recent, *out])
                if f:
                    if not self.matcher.consume_tokens(f):
                        break  # cannot happen after validate_tokens; be safe
                    consumed += len(f)
                    out += f
                    forced_flags += [True] * len(f)
                    pending = (pending[len(f):] if pending is not None
                               and pending[:len(f)] == f else None)
                    continue
                if pending is None:
                    pending = (continuation(list(out), budget - len(out))
                               if continuation is not None else [])
                chunk = [int(t) for t in pending[:budget - len(out)]]
                if not chunk:
                    break
                n = self.matcher.try_consume_tokens(chunk)
                consumed += n
                out += chunk[:n]
                forced_flags += [False] * n
                if n < len(chunk):
                    break  # the grammar rejects the inner proposer's next token
                pending = []  # the inner draft is used up at this alignment
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return out, forced_flags
