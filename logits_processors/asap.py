"""Grammar-aligned sampling: ASAp (Park et al., "Grammar-Aligned Decoding", 2024).

Why this exists: plain grammar masking samples token ``t`` after prefix ``w``
with probability ``P(t|w) / P(allowed|w)`` over the allowed tokens. It ignores
how likely the model is to *finish* grammatically after ``t``, so prefixes the
model would rarely complete are over-sampled: the output follows a distorted
distribution, not the model's distribution conditioned on the output being in
the grammar, ``P(y | y in L)``.

The exact conditional samples ``t`` with probability
``P(t|w) * EFG(wt) / EFG(w)``, where the expected future grammaticality
``EFG(w) = sum_t P(t|w) * EFG(wt)`` (``EFG`` of a finished string is 1 if it
is in the language, 0 if not) is intractable. ASAp (adaptive sampling with
approximate expected futures) keeps, per (prompt, grammar), a trie of the
prefixes sampled so far and an *upper bound* ``E~(w) >= EFG(w)`` per prefix:

* a prefix never visited has ``E~ = 1`` if the grammar allows it, 0 if not
  (so the first sample is plain masking);
* each sample draws ``t`` with probability proportional to
  ``P(t|w) * E~(wt)`` (:meth:`AsapCursor.observe` returns the log-weights);
* after a sample, the bounds along its path are tightened bottom-up
  (:meth:`AsapTrie.update`): ``E~(w) = (mass of allowed tokens not yet
  visited) + sum over visited children c of P(c|w) * E~(wc)``. Mass that the
  grammar masked out at a visited prefix is thereby subtracted from every
  ancestor.

The bounds only decrease and stay sound, and over repeated samples they
converge to ``EFG``, so the sampling distribution converges to the exact
grammar-conditioned one. Values are kept in log space (``E~`` of a prefix is a
product over its future and underflows in linear space).

Memory is bounded by :class:`AsapStore`: a cap on trie nodes over all tries of
one engine; when a new node would exceed it, whole least-recently-used tries
are evicted (their bounds restart at 1, which is sound: sampling falls back to
plain masking there); a single trie that alone reaches the cap stops growing
(its samples continue with the bounds it has).

This module knows nothing about vLLM: callers hand it logits rows (torch) and
token ids. ``grammar.py`` wires it into the logits processor.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections import OrderedDict
from collections.abc import Iterable

import torch

#: Default cap on trie nodes per engine (all tries together): it bounds ASAp's
#: state per engine (docs/grammar.md states the bytes per node).
DEFAULT_MAX_NODES = 100_000
#: Environment variable that overrides :data:`DEFAULT_MAX_NODES`.
MAX_NODES_ENV = "VLLM_PLUGINS_ASAP_MAX_NODES"

_NEG_INF = float("-inf")


def max_nodes_from_env() -> int:
    """The node cap from :data:`MAX_NODES_ENV`, validated (a clear error names it)."""
    raw = os.environ.get(MAX_NODES_ENV)
    if raw is None or raw == "":
        return DEFAULT_MAX_NODES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{MAX_NODES_ENV} must be a positive integer, got {raw!r}")
    return value


def _logaddexp(a: float, b: float) -> float:
    if a == _NEG_INF:
        return b
    if b == _NEG_INF:
        return a
    hi, lo = (a, b) if a > b else (b, a)
    return hi + math.log1p(math.exp(lo - hi))


class AsapNode:
    """One sampled prefix. All quantities are natural logs of probabilities."""

    __slots__ = ("log_p", "log_mass", "log_seen", "log_efg", "children")

    def __init__(self, log_p: float = 0.0) -> None:
        #: log P(this node's token | parent prefix); 0 for the root.
        self.log_p = log_p
        #: log P(next token is allowed by the grammar | this prefix); None until
        #: a logits row was seen here (then the bound uses mass 1).
        self.log_mass: float | None = None
        #: log of the summed P(child | this prefix) over the children in the trie.
        self.log_seen = _NEG_INF
        #: the upper bound log E~(prefix); 0 (E~ = 1) until an update reaches it.
        self.log_efg = 0.0
        self.children: dict[int, AsapNode] | None = None

    def recompute(self) -> float:
        """E~ from the mass not yet explored plus the children's bounds (log)."""
        mass = 0.0 if self.log_mass is None else self.log_mass
        if self.log_seen == _NEG_INF:
            unexplored = mass
        elif self.log_seen < mass:
            unexplored = mass + math.log1p(-math.exp(self.log_seen - mass))
        else:  # rounding: the children took all the allowed mass
            unexplored = _NEG_INF
        explored = _NEG_INF
        if self.children:
            for c in self.children.values():
                explored = _logaddexp(explored, c.log_p + c.log_efg)
        return min(_logaddexp(unexplored, explored), 0.0)


class AsapTrie:
    """The sampled prefixes of one (prompt, grammar, sampling setting)."""

    __slots__ = ("root", "n_nodes", "store", "evicted", "active")

    def __init__(self, store: "AsapStore | None" = None) -> None:
        self.root = AsapNode()
        self.n_nodes = 1
        self.store = store
        self.evicted = False
        self.active = 0  # cursors walking this trie now

    def add_child(self, node: AsapNode, token: int, log_p: float) -> AsapNode | None:
        """A new child of ``node``; None when the memory cap refuses it."""
        if self.store is not None and not self.store._grow(self):
            return None
        child = AsapNode(log_p)
        if node.children is None:
            node.children = {}
        node.children[token] = child
        node.log_seen = _logaddexp(node.log_seen, log_p)
        self.n_nodes += 1
        return child

    @staticmethod
    def update(path: list[AsapNode]) -> None:
        """Tighten the bounds along one sample's path, leaf to root (the ASAp step)."""
        for node in reversed(path):
            node.log_efg = node.recompute()

    def bound(self) -> float:
        """E~ at the root: an upper bound on P(output in the language)."""
        return math.exp(self.root.log_efg)


class AsapCursor:
    """One request's walk down a trie: reweights its rows, updates at the end.

    Call order per step: :meth:`advance` with the tokens sampled since the
    previous step, then :meth:`observe` with the row's logits; :meth:`finish`
    once when the request leaves the batch.

    Under speculative decoding one step observes a row per verified position:
    the row after the committed output plus ``draft`` (its first ``j``
    drafted tokens) is observed with that ``draft``, and reweighted with the
    bounds of the trie node at that prefix. Bounds only change in
    :meth:`finish` (the end of a sample), never while a sample is under way:
    a node's weights are the same whether the tokens before it are committed
    or drafted, so the row at position ``j`` gets what plain decoding gives it
    after committing ``draft[:j]``. What a row teaches the trie (the
    probability of the token sampled from it, the grammar's mass at its
    prefix) is held until the next :meth:`advance` shows which positions
    were committed; rows after a rejected draft leave no trace.
    """

    __slots__ = ("trie", "path", "terminal", "temperature", "max_len", "_seen", "_since",
                 "done", "finished", "cut")

    def __init__(self, trie: AsapTrie, terminal: Iterable[int], temperature: float,
                 max_len: int | None = None) -> None:
        if not temperature > 0:
            raise ValueError(f"ASAp needs a positive temperature, got {temperature!r}")
        self.trie = trie
        self.path: list[AsapNode] = [trie.root]
        # Tokens that end a sample (EOS, stop tokens): a finished string, no node below.
        self.terminal = frozenset(terminal)
        self.temperature = float(temperature)
        self.max_len = max_len  # the most tokens a sample has, if limited
        # The rows observed since the last advance, by the drafted tokens
        # before their position: (logits / T, its log-normaliser, log of the
        # grammar's mass there). P(child | prefix) of a token sampled from one
        # is read when the token is advanced.
        self._seen: dict[tuple[int, ...], tuple[torch.Tensor, float, float]] = {}
        # The tokens advanced since those rows were observed.
        self._since: list[int] = []
        # True once the walk has left the trie (EOS sampled, a token with no row
        # seen, memory cap): later rows are not reweighted.
        self.done = False
        self.finished = False
        # Under speculation, for the step being verified: the number of
        # drafts before the first row that arrives fully masked (plain
        # decoding leaves the trie there: the rows after it get no weights).
        # Rows are not observed in position order (vLLM samples the bonus
        # row first), so the caller says it up front; None: no such row.
        self.cut: int | None = None
        trie.active += 1

    def advance(self, tokens: Iterable[int]) -> None:
        """Follow the sampled ``tokens`` down the trie, adding nodes as needed."""
        for tok in tokens:
            if self.done:
                return
            if tok in self.terminal:
                self.done = True
                return
            node = self.path[-1]
            seen = self._seen.get(tuple(self._since))
            if seen is not None and node.log_mass is None:
                node.log_mass = seen[2]  # a drafted position's row, now committed
            child = node.children.get(tok) if node.children else None
            if child is None:
                if seen is None:
                    # No row was seen for this position (e.g. resumed after a
                    # preemption): its probability is unknown.
                    self.done = True
                    return
                scaled, log_z, _ = seen
                child = self.trie.add_child(node, tok, float(scaled[tok]) - log_z)
                if child is None:
                    self.done = True
                    return
            self.path.append(child)
            self._since.append(tok)

    def observe(
        self, raw: torch.Tensor, masked: torch.Tensor, draft: Iterable[int] = ()
    ) -> tuple[list[int], list[float]] | None:
        """Record the row after the committed prefix + ``draft``; return
        (tokens, logit offsets) for the sampler.

        ``raw`` is the row the processor received, ``masked`` the same row after
        the grammar mask (allowed tokens finite). The offsets, added to
        ``masked``, make the sampler (which divides by the temperature) draw
        ``t`` with probability proportional to ``P_T(t|w) * E~(wt)``; they are
        ``T * log E~`` for the children already in the trie (others keep 1).
        None when the cursor has left the trie, or nothing is to be reweighted.
        """
        if self.done:
            return None
        if self._since:  # a new step: the previous step's rows are spent
            self._seen = {}
            self._since = []
        draft = tuple(draft)
        if self.cut is not None and len(draft) > self.cut:
            return None  # after a fully masked row: plain decoding has left the trie
        node: AsapNode | None = self.path[-1]
        for tok in draft:
            if tok in self.terminal:
                return None  # after the end of the sample: no such row in plain decoding
            node = node.children.get(tok) if node is not None and node.children else None
        scaled = raw / self.temperature  # log P_T(t|w) + log Z
        known = node is not None and node.log_mass is not None
        parts = [torch.logsumexp(scaled, 0)]
        if not known:
            parts.append(torch.logsumexp(scaled.masked_fill(~torch.isfinite(masked), _NEG_INF), 0))
        values = torch.stack(parts).tolist()  # one device sync
        log_z = values[0]
        if not math.isfinite(log_z):
            if not draft:
                self.done = True
            return None
        log_mass = node.log_mass if known else min(values[1] - log_z, 0.0)
        if not draft and node.log_mass is None:
            node.log_mass = log_mass  # the committed position: as plain decoding
        self._seen[draft] = (scaled, log_z, log_mass)
        if node is None or not node.children:
            return None
        toks = list(node.children)
        offsets = [self.temperature * node.children[t].log_efg for t in toks]
        return toks, offsets

    def finish(self, tail: Iterable[int] = ()) -> None:
        """The sample is over (finished, cut or aborted): tighten its path's bounds.

        ``tail``: the tokens sampled since the last advance, the sample's last
        token included (under speculation a step commits several). All but
        the last are followed, as plain decoding follows them one step at a
        time; the last is sampled from the row of the prefix where plain
        decoding's sample ends, whose mass is recorded.
        """
        if self.finished:
            return
        self.finished = True
        tail = list(tail)
        for k, tok in enumerate(tail):
            if tok in self.terminal:  # the sample ended there
                tail = tail[:k + 1]
                break
        if self.max_len is not None:  # tokens past the limit were never part of it
            tail = tail[:max(self.max_len - (len(self.path) - 1), 0)]
        if tail:
            self.advance(tail[:-1])
            seen = self._seen.get(tuple(self._since))
            node = self.path[-1]
            if not self.done and seen is not None and node.log_mass is None:
                node.log_mass = seen[2]
        self._seen = {}
        self.trie.active -= 1
        AsapTrie.update(self.path)


class AsapStore:
    """The tries of one engine, LRU by use, capped by total node count."""

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be positive, got {max_nodes}")
        self.max_nodes = max_nodes
        self.n_nodes = 0
        self._tries: OrderedDict[bytes, AsapTrie] = OrderedDict()

    @staticmethod
    def key(grammar: str, prompt: Iterable[int] | None, setting: str) -> bytes | None:
        """Digest of what fixes the target distribution; None without a prompt."""
        if prompt is None:
            return None
        h = hashlib.blake2b(digest_size=16)
        for part in (grammar, setting):
            h.update(part.encode())
            h.update(b"\0")
        h.update(",".join(map(str, prompt)).encode())
        return h.digest()

    def trie(self, key: bytes | None) -> AsapTrie:
        """The trie for ``key`` (created if new); a private one for ``None``."""
        if key is None:
            return AsapTrie(None)
        trie = self._tries.get(key)
        if trie is not None:
            self._tries.move_to_end(key)
            return trie
        trie = AsapTrie(self)
        if not self._grow(trie):  # the root
            return AsapTrie(None)  # cannot fit even a root: unshared, unlearned
        self._tries[key] = trie
        return trie

    def cursor(self, key: bytes | None, terminal: Iterable[int], temperature: float,
               max_len: int | None = None) -> AsapCursor:
        return AsapCursor(self.trie(key), terminal, temperature, max_len)

    def __len__(self) -> int:
        return len(self._tries)

    def _grow(self, trie: AsapTrie) -> bool:
        """Make room for one node of ``trie``; False if it may not grow.

        Evicts least-recently-used tries other than ``trie``, those without a
        request walking them first.
        """
        if trie.evicted:
            return False
        while self.n_nodes + 1 > self.max_nodes:
            others = [k for k, t in self._tries.items() if t is not trie]
            if not others:
                return False
            idle = [k for k in others if not self._tries[k].active]
            victim_key = (idle or others)[0]
            victim = self._tries.pop(victim_key)
            victim.evicted = True
            self.n_nodes -= victim.n_nodes
        self.n_nodes += 1
        return True
