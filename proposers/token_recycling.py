"""Token Recycling: draft from the target's own recent top-k successors.

Every verification step computes the target's distribution at each verified
position, including rejected draft positions, and vLLM throws all but the
sampled token away. We keep it: a vocab x k adjacency matrix holds, per token,
the target's top-k successors the last time that token was verified. Drafts
walk the matrix from the last token along the most probable successor.

vLLM verifies one chain per request (no tree attention on this route), so the
chain must be right as often as possible. A bigram matrix forgets everything
but the last token; ``context_order`` adds direct-mapped tables keyed by the
last 2..n tokens, filled from the same verified positions, and drafting backs
off from the longest context that has an entry to the matrix. Prompt n-grams
seed empty entries, so a request can copy from its own prompt before the
target has verified anything.

Memory (stated, fixed at start): matrix vocab*k*(4+4) bytes (SmolLM2, k=8:
1.5 MiB); context table context_slots*(8+4+4) bytes (default 2^20: 16 MiB).
"""

from __future__ import annotations

import atexit
import math
import os

import numpy as np

from vllm_plugins.options import Option, flag, integer, positive_int, unit_float
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.draft_length import draft_length_options
from vllm_plugins.step_context import Drafts, StepContext

_MASK = (1 << 63) - 1
_PRIME = 1000003
# Seeded (prompt-copied) entries carry this log-probability: unknown to the
# target, so drafting trusts them like a coin flip.
_SEED_LOGP = math.log(0.5)


def context_hash(tokens, order: int) -> int:
    h = 0x9E3779B97F4A7C15 ^ order
    for t in tokens:
        h = ((h * _PRIME) ^ int(t)) & _MASK
    return h


def context_hashes(seq: np.ndarray, ends: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """``context_hash(seq[e - n:e], n)`` for every pair (e, n), at once.

    The same values: uint64 products wrap modulo 2**64, and the mask keeps
    the low 63 bits, which the wrap leaves as the exact product has them.
    """
    h = np.uint64(0x9E3779B97F4A7C15) ^ orders.astype(np.uint64)
    prime, mask = np.uint64(_PRIME), np.uint64(_MASK)
    for i in range(int(orders.max(initial=0))):
        live = i < orders
        t = seq[np.where(live, ends - orders + i, 0)].astype(np.uint64)
        h = np.where(live, ((h * prime) ^ t) & mask, h)
    return h


class RecyclingTables:
    """The adjacency matrix plus the higher-order context tables."""

    def __init__(self, vocab_size: int, k: int, context_order: int, slots: int):
        self.vocab_size = vocab_size
        self.k = k
        self.context_order = context_order
        self.ids = np.full((vocab_size, k), -1, dtype=np.int32)
        self.logp = np.full((vocab_size, k), -np.inf, dtype=np.float32)
        self.slots = slots if context_order >= 2 else 1
        self.ctx_key = np.full(self.slots, -1, dtype=np.int64)
        self.ctx_tok = np.full(self.slots, -1, dtype=np.int32)
        self.ctx_logp = np.full(self.slots, -np.inf, dtype=np.float32)

    # ------------------------------------------------------------- learning
    def learn_rows(self, inputs: np.ndarray, topk_ids: np.ndarray,
                   topk_logprobs: np.ndarray) -> None:
        """Matrix rows of the verified input tokens <- the target's top-k."""
        k = min(self.k, topk_ids.shape[1])
        self.ids[inputs, :k] = topk_ids[:, :k]
        self.logp[inputs, :k] = topk_logprobs[:, :k]

    def learn_context(self, seq: np.ndarray, end: int, tok: int, logp: float,
                      only_if_empty: bool = False) -> None:
        """Context tables: the last n tokens of seq[:end] -> tok, n = 2..order."""
        self.learn_contexts(np.asarray(seq), np.array([end]), np.array([tok]),
                            np.array([logp], np.float32), only_if_empty=only_if_empty)

    def learn_contexts(self, seq: np.ndarray, ends: np.ndarray, toks: np.ndarray,
                       logps: np.ndarray, starts: np.ndarray | None = None,
                       only_if_empty: bool = False) -> None:
        """``learn_context`` for many ends of ``seq`` in one pass, as if
        called for each in order (a later end overwrites an earlier one's
        slot). A context reaches back no further than its ``starts`` entry
        (default 0): several requests' sequences may share ``seq``. With
        ``only_if_empty`` (prompt seeding) a context already in the table
        keeps its entry, and within the call its first occurrence wins."""
        if self.context_order < 2 or len(ends) == 0:
            return
        orders = np.arange(2, self.context_order + 1)
        e = np.repeat(np.asarray(ends, np.int64), len(orders))
        n = np.tile(orders, len(ends))
        lo = 0 if starts is None else np.repeat(np.asarray(starts, np.int64), len(orders))
        ok = e - n >= lo
        pick = np.repeat(np.arange(len(ends)), len(orders))[ok]
        e, n = e[ok], n[ok]
        keys = context_hashes(seq, e, n).astype(np.int64)
        slots = keys % self.slots
        if only_if_empty:
            fresh = self.ctx_key[slots] != keys
            first = np.zeros(len(keys), bool)
            first[np.unique(keys, return_index=True)[1]] = True
            fresh &= first
            keys, slots, pick = keys[fresh], slots[fresh], pick[fresh]
        # Repeated slots: numpy's advanced assignment keeps the last value.
        self.ctx_key[slots] = keys
        self.ctx_tok[slots] = np.asarray(toks)[pick]
        self.ctx_logp[slots] = np.asarray(logps)[pick]

    def seed_matrix(self, tokens: np.ndarray) -> None:
        """Prompt bigrams fill matrix rows the target has not filled yet."""
        if len(tokens) < 2:
            return
        prev, nxt = tokens[:-1], tokens[1:]
        empty = self.ids[prev, 0] < 0
        self.ids[prev[empty], 0] = nxt[empty]
        self.logp[prev[empty], 0] = _SEED_LOGP

    # ------------------------------------------------------------- drafting
    def next_token(self, seq: list[int]) -> tuple[int, float]:
        for n in range(min(self.context_order, len(seq)), 1, -1):
            h = context_hash(seq[-n:], n)
            slot = h % self.slots
            if self.ctx_key[slot] == h:
                return int(self.ctx_tok[slot]), float(self.ctx_logp[slot])
        last = seq[-1]
        return int(self.ids[last, 0]), float(self.logp[last, 0])

    def chain(self, tail: list[int], length: int, min_confidence: float
              ) -> tuple[list[int], list[float]]:
        """Most probable chain; stops when the running product of the stored
        top-1 probabilities (the chain's estimated acceptance) falls below
        min_confidence."""
        seq = list(tail)
        out, conf = [], []
        running = 1.0
        for _ in range(length):
            tok, lp = self.next_token(seq)
            if tok < 0:
                break
            p = math.exp(lp)
            running *= p
            if running < min_confidence:
                break
            out.append(tok)
            conf.append(p)
            seq.append(tok)
        return out, conf

    # ------------------------------------------------------------- persistence
    def save(self, path: str) -> None:
        tmp = path + ".tmp.npz"
        np.savez(tmp, ids=self.ids, logp=self.logp, ctx_key=self.ctx_key,
                 ctx_tok=self.ctx_tok, ctx_logp=self.ctx_logp,
                 meta=np.array([self.vocab_size, self.k, self.context_order,
                                self.slots]))
        os.replace(tmp, path)

    def load(self, path: str) -> None:
        with np.load(path) as f:
            meta = [int(x) for x in f["meta"]]
            mine = [self.vocab_size, self.k, self.context_order, self.slots]
            if meta != mine:
                raise ValueError(
                    f"token_recycling warm_start_path {path!r} holds tables for "
                    f"(vocab, topk, context_order, context_slots)={tuple(meta)}, "
                    f"but this engine uses {tuple(mine)}")
            self.ids[...] = f["ids"]
            self.logp[...] = f["logp"]
            self.ctx_key[...] = f["ctx_key"]
            self.ctx_tok[...] = f["ctx_tok"]
            self.ctx_logp[...] = f["ctx_logp"]


class TokenRecyclingProposer(PluginProposer):
    OPTIONS = (
        *draft_length_options("goodput"),
        positive_int("topk", 8, 64),
        integer("context_order", 3, 1, 8),
        # A context slot is a key, a token and a log-probability: 16 bytes.
        integer("context_slots", 1 << 20, 1024, 1 << 30,
                table_bytes=lambda o: 16 * o["context_slots"] if o["context_order"] >= 2
                else 16),
        unit_float("min_confidence", 0.02),
        flag("seed_from_prompt", True),
        Option("warm_start_path", None, (str, type(None))),
        Option("save_path", None, (str, type(None))),
    )
    DEFAULT_NUM_SPECULATIVE_TOKENS = 6
    CAN_REST = True   # drafts from the tables and each request's context

    def __init__(self, vllm_config=None, options: dict | None = None,
                 vocab_size: int | None = None):
        super().__init__(vllm_config, options, vocab_size)
        o = self.options
        if self.vocab_size is None:
            raise ValueError("token_recycling needs the vocabulary size")
        self.tables = RecyclingTables(self.vocab_size, o["topk"], o["context_order"],
                                      o["context_slots"])
        if o["warm_start_path"] and os.path.exists(o["warm_start_path"]):
            self.tables.load(o["warm_start_path"])
        if o["save_path"]:
            atexit.register(self.tables.save, o["save_path"])
        self._seen: set[str] = set()

    def free(self, req_id: str) -> None:
        self._seen.discard(req_id)

    def learn(self, ctx: StepContext) -> None:
        """Tables <- every verified row of the step, all requests in one
        vectorised pass (row by row, the Python loop was most of the
        learning time); a request's prompt seeds the tables the first time
        it is seen."""
        t = self.tables
        inputs, ids, lps = [], [], []
        seqs, ends, starts = [], [], []
        offset = 0
        for r in ctx.requests:
            if r.req_id not in self._seen and len(r.accepted) > 0:
                self._seen.add(r.req_id)
                if self.options["seed_from_prompt"]:
                    self._seed(np.asarray(r.context[:r.num_prompt_tokens], np.int64))
            if r.topk_ids is None or len(r.verified_tokens) == 0:
                continue
            rows = len(r.verified_tokens)
            inputs.append(r.verified_tokens)
            ids.append(r.topk_ids[:rows])
            lps.append(r.topk_logprobs[:rows])
            if t.context_order >= 2:
                # Row j's context: the tokens before this step's output,
                # then drafts 1..j (verified_tokens[0] is the last of those).
                base = len(r.context) - len(r.accepted)
                lo = max(0, base - t.context_order)
                seqs += [np.asarray(r.context[lo:base], np.int64),
                         r.verified_tokens[1:].astype(np.int64)]
                ends.append(offset + base - lo + np.arange(rows))
                starts.append(np.full(rows, offset))
                offset += base - lo + rows - 1
        if not inputs:
            return
        ids_all, lps_all = np.concatenate(ids), np.concatenate(lps)
        t.learn_rows(np.concatenate(inputs), ids_all, lps_all)
        if seqs:
            t.learn_contexts(np.concatenate(seqs), np.concatenate(ends),
                             ids_all[:, 0], lps_all[:, 0], np.concatenate(starts))

    def _seed(self, prompt: np.ndarray) -> None:
        t = self.tables
        t.seed_matrix(prompt)
        if len(prompt) > 2:
            t.learn_contexts(prompt, np.arange(2, len(prompt)), prompt[2:],
                             np.full(len(prompt) - 2, _SEED_LOGP, np.float32),
                             only_if_empty=True)

    def draft(self, ctx: StepContext) -> Drafts:
        self.learn(ctx)
        n = len(ctx.requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        conf: list[np.ndarray | None] = [None] * n
        order = self.tables.context_order
        for i, r, length in self.drafting_requests(ctx):
            tail = [int(x) for x in r.context[-order:]]
            tokens[i], c = self.tables.chain(tail, length, self.options["min_confidence"])
            conf[i] = np.asarray(c, dtype=np.float32)
        return Drafts(tokens, None, conf)
