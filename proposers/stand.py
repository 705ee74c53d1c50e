"""STAND: stochastic adaptive n-gram drafting from the target's own logits.

Song et al., "Accelerated Test-Time Scaling with Model-Free Speculative
Sampling" (2025). Test-time scaling samples many answers to one prompt; they
repeat each other's phrases. STAND keeps, per prompt, an n-gram table whose
values are not counts of emitted tokens but the target's own next-token
distributions (its top-k at every verified position, rejected draft
positions included), shared by all samples of that prompt, and drafts from it:

* temperature 0: the most probable path (probs are not needed: vLLM's greedy
  verification ignores them);
* temperature T > 0: one sampled chain (Gumbel-max per position; with
  ``"draft_shape": "tree"`` the paper's Gumbel-top-k tree, proposers/stand_tree.py),
  each token drawn from the stored distribution tempered by the request's T
  (proposers/stand_draws.py), and that exact distribution is handed to the
  verification as the draft's probability row, so sampled output keeps
  exactly the target's distribution.
  Requests with structured outputs are the exception: their sampled drafts go
  out without rows (rule 3).

Exactness rules kept here (see docs/stand.md):

1. The row handed over at a position is the distribution the token there was
   drawn from (float32, sums to 1, q(drafted) > 0), or none (rule 3).
2. Whether position j is drafted at all may depend on the tokens drafted
   before j, never on the token drawn at j: the length rule and the
   confidences given to the draft-length controller are computed from the
   distribution at j *before* sampling from it. For controllers whose choice
   for position j can depend on later positions (``acceptance`` looks at the
   whole chain), sampled rows are shown to the controller padded to a length
   fixed before drafting, then cut to what was drafted.
3. Where vLLM decides what to verify from the drafted tokens' values, no row
   is handed over (vLLM then treats the draft as deterministic: one-hot).
   vLLM's scheduler cuts a structured-output request's draft at the first
   token its grammar rejects, so a position is verified only if the token
   drawn there is allowed; an honest row then over-weights the allowed tokens
   (p = (.5, .5, 0) with the third banned and q = (0, .5, .5) gives
   P(second) = .75). Rejection sampling against a one-hot row yields exactly
   the target's distribution whatever process chose the token
   (``verification_depends_on_token``).

Memory (stated, bounded): ``max_entries`` contexts in all stores together
(default 2^18). A store's slot is ``topk`` (token int32, probability float32)
pairs, a weight, its key, two LRU links, a free-stack entry and, in the
index (a power of two at least twice the slots), at most 4 int32 cells:
8 * topk + 40 B, 104 B at topk=8 (``stand_store``). Arrays grow by doubling,
so up to 2 slots are allocated per entry: at most ~208 B per entry, ~52 MiB
at the defaults, whatever the number of
requests. Eviction, checked once per engine step: stores with no live
request go first, least recently used first; then every live store drops its
least recently used entries in proportion to its size. Idle stores are also
kept to ``max_stores`` (least recently used dropped first); a store with live
requests is never dropped (that would make them re-seed every step).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from vllm_plugins.options import Option, flag, integer, unit_float
from vllm_plugins.proposers import stand_debug
from vllm_plugins.proposers.base import PluginProposer, verification_depends_on_token, trim
from vllm_plugins.proposers.draft_length import draft_length_options
from vllm_plugins.proposers.stand_draws import KindCalibration, draft_distribution
from vllm_plugins.proposers.stand_store import (STORE_OPTIONS, NgramStore, greedy_chain,
                                                warm_up)
from vllm_plugins.proposers.stand_tree import dense_rows, grow_tree, observed_nodes
from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.tree.draft import path_to
from vllm_plugins.tree.sampling import is_greedy

_MASK = (1 << 63) - 1
# Controllers whose choice for position j depends only on positions <= j
# (see the module docstring, rule 2).
PREFIX_CAUSAL_POLICIES = frozenset({"fixed", "confidence", "goodput"})


class StandProposer(PluginProposer):
    OPTIONS = (
        # goodput: where verified tokens cost (a CPU at batch 8), fixed
        # drafts verify more than they return.
        *draft_length_options("goodput"),
        integer("topk", 8, 1, 64),
        integer("max_order", 3, 1, 8),
        unit_float("min_path_prob", 0.1),
        flag("calibrate", True),
        *STORE_OPTIONS,
        integer("seed", 0, 0, None),
        # "tree": Gumbel-top-k trees (proposers/stand_tree.py) for the
        # requests a tree serves exactly: greedy ones, and sampled ones
        # without structured outputs under a prefix-causal draft-length
        # controller; the rest draft chains.
        Option("draft_shape", "chain", str, choices=("chain", "tree")),
    )
    DEFAULT_NUM_SPECULATIVE_TOKENS = 6

    def __init__(self, vllm_config=None, options: dict | None = None,
                 vocab_size: int | None = None):
        super().__init__(vllm_config, options, vocab_size)
        o = self.options
        if self.vocab_size is None:
            raise ValueError("stand needs the vocabulary size")
        self.max_order = o["max_order"]
        # The exactness tests' dishonest rows (proposers/stand_debug.py).
        self.debug_probs = stand_debug.engine_mode()
        self.stores: OrderedDict[object, NgramStore] = OrderedDict()
        self._live: dict[object, int] = {}  # store key -> live requests
        self._req_key: dict[str, object] = {}
        self._req_rng: dict[str, np.random.Generator] = {}
        self._rng = np.random.default_rng(o["seed"])
        self._pad_sampled = o["draft_length"] not in PREFIX_CAUSAL_POLICIES
        self._real_lengths: list[int] | None = None
        self.calibration = KindCalibration(self.max_order)
        self._chain_out: tuple[np.ndarray, ...] | None = None
        # Per request: (kind, score) of each draft handed to vLLM last step.
        self._pending: dict[str, list[tuple[int, float]]] = {}
        # Tree drafts handed over last step: (kinds, parents, tokens).
        self._pending_tree: dict[str, tuple[list, list[int], list[int]]] = {}
        self._last_kinds: list[list[tuple[int, float]]] | None = None
        # Per-request state is also swept after SWEEP_STEPS steps unseen: the
        # bridge can miss a finish notice (it arrives on a step that schedules
        # no tokens, where vLLM's runner returns before proposing).
        self._last_seen: dict[str, int] = {}
        self._steps = 0
        self.swept_requests = 0
        self.evicted_stores = 0
        self.stores_created = 0
        # "sampled_one_hot": sampled tokens handed over without rows (rule 3).
        self.drafted = {"greedy": 0, "sampled": 0, "sampled_one_hot": 0}
        self.lookups = {"hit": 0, "miss": 0}

    def load_model(self, target_model: Any) -> None:
        super().load_model(target_model)
        warm_up()  # numba compiles (or loads) the store's loops now, not in a step

    # ------------------------------------------------------------ lifecycle
    SWEEP_STEPS = 256

    def _sweep(self, ctx: StepContext) -> None:
        self._steps += 1
        for r in ctx.requests:
            self._last_seen[r.req_id] = self._steps
        if self._steps % 64:
            return
        stale = [q for q, seen in self._last_seen.items()
                 if seen < self._steps - self.SWEEP_STEPS]
        for q in stale:
            self.free(q)
            self.swept_requests += 1

    def free(self, req_id: str) -> None:
        self._last_seen.pop(req_id, None)
        key = self._req_key.pop(req_id, None)
        if key is not None:
            left = self._live.get(key, 0) - 1
            if left > 0:
                self._live[key] = left
            else:
                self._live.pop(key, None)
        self._req_rng.pop(req_id, None)
        self._pending.pop(req_id, None)
        self._pending_tree.pop(req_id, None)

    def step(self, ctx: StepContext) -> Drafts:
        self._real_lengths = None
        self._last_kinds = None
        drafts = super().step(ctx)
        if self._real_lengths is not None and len(self._real_lengths) == len(drafts.tokens):
            drafts = trim(drafts, [min(len(t), n) for t, n in
                                   zip(drafts.tokens, self._real_lengths)])
        kinds = self._last_kinds
        if kinds is not None and len(kinds) == len(drafts.tokens):
            trees = drafts.parents or [None] * len(drafts.tokens)
            for r, t, k, par in zip(ctx.requests, drafts.tokens, kinds, trees):
                self._pending.pop(r.req_id, None)
                self._pending_tree.pop(r.req_id, None)
                if t and par is not None:
                    self._pending_tree[r.req_id] = (k[:len(t)], list(par), list(t))
                elif t:
                    self._pending[r.req_id] = k[:len(t)]
        self._real_lengths = None
        self._last_kinds = None
        return drafts

    def _observe_outcomes(self, r: RequestStep) -> None:
        """Acceptance of last step's drafts, per kind (verified positions only)."""
        tree = self._pending_tree.get(r.req_id)  # _learn reads it next
        if tree is not None and not r.in_prefill:
            kinds, parents, tokens = tree
            n = min(r.num_draft, len(parents))
            for node, ok in observed_nodes(parents[:n], tokens[:n], r.accepted):
                self.calibration.observe(*kinds[node], ok)
            return
        kinds = self._pending.pop(r.req_id, None)
        if not kinds or r.in_prefill:
            return
        n = min(r.num_draft, len(kinds))
        m = min(r.num_accepted_drafts, n)
        for j in range(min(n, m + 1)):  # the first rejected one is verified too
            kind, score = kinds[j]
            self.calibration.observe(kind, score, j < m)

    def _key_of(self, r: RequestStep) -> object:
        share = self.options["share"]
        if share == "prompt":
            prompt = np.ascontiguousarray(r.context[:r.num_prompt_tokens], dtype=np.int64)
            return ("p", r.num_prompt_tokens, hash(prompt.tobytes()))
        if share == "group":
            return ("g", r.group_id or r.req_id)
        return ("r", r.req_id)

    def _store_for(self, r: RequestStep) -> NgramStore:
        key = self._req_key.get(r.req_id)
        if key is None:
            key = self._key_of(r)
            self._req_key[r.req_id] = key
            self._live[key] = self._live.get(key, 0) + 1
        store = self.stores.get(key)
        if store is not None:
            self.stores.move_to_end(key)
            return store
        if len(self.stores) >= self.options["max_stores"]:
            # Least recently used stores without requests, down to the cap.
            for idle in [k for k in self.stores if k not in self._live]:
                del self.stores[idle]
                self.evicted_stores += 1
                if len(self.stores) < self.options["max_stores"]:
                    break
        store = NgramStore(self.options["topk"], self.options["max_entries"],
                           self.options["history"])
        self.stores[key] = store
        self.stores_created += 1
        return store

    def _rng_for(self, r: RequestStep) -> np.random.Generator:
        rng = self._req_rng.get(r.req_id)
        if rng is None:
            seed = getattr(r.sampling_params, "seed", None)
            rng = (np.random.default_rng([int(seed) & _MASK, self.options["seed"]])
                   if seed is not None else
                   np.random.default_rng(self._rng.integers(1 << 62)))
            self._req_rng[r.req_id] = rng
        return rng

    def _enforce_budget(self) -> None:
        """At most max_entries entries in all stores together (see module doc)."""
        budget = self.options["max_entries"]
        total = sum(len(s) for s in self.stores.values())
        if total <= budget:
            return
        for key in [k for k in self.stores if k not in self._live]:
            total -= len(self.stores.pop(key))
            self.evicted_stores += 1
            if total <= budget:
                return
        excess = total - budget
        for store in sorted(self.stores.values(), key=len, reverse=True):
            store.evict_lru(-(-excess * len(store) // total))  # ceil

    # ------------------------------------------------------------ learning
    def _seed(self, store: NgramStore, tokens: np.ndarray) -> None:
        """Prompt (and output so far) n-grams, before the target has spoken."""
        store.seeded = True
        store.seed_tokens(tokens, self.max_order, float(self.options["prompt_prob"]))

    def _learn(self, store: NgramStore, r: RequestStep) -> None:
        tree = self._pending_tree.pop(r.req_id, None)
        if r.topk_ids is None or len(r.verified_tokens) == 0:
            return
        if tree is not None and self._learn_tree(store, r, tree[1], tree[2]):
            return
        rows = min(len(r.verified_tokens), len(r.topk_ids))
        base = len(r.context) - len(r.accepted)
        lo = max(0, base - self.max_order)
        seq = np.concatenate([np.asarray(r.context[lo:base], dtype=np.int64),
                              np.asarray(r.verified_tokens[1:rows], dtype=np.int64)])
        head = base - lo  # seq[:head] ends with verified_tokens[0]
        probs = np.exp(np.asarray(r.topk_logprobs[:rows], dtype=np.float64))
        store.observe_rows(seq, head, r.topk_ids[:rows], probs, self.max_order)

    def _learn_tree(self, store: NgramStore, r: RequestStep, parents, tokens) -> bool:
        """Learn a step that verified (a prefix of) this request's tree, each
        row under its own node's path; False when the verified nodes are a
        chain (the bridge cut the tree to its chain prefix), which ``_learn``
        reads as one sequence."""
        m = min(len(r.verified_tokens), len(r.topk_ids)) - 1
        if (m < 1 or m > len(tokens) or list(r.verified_tokens[1:m + 1]) != tokens[:m]
                or parents[:m] == list(range(-1, m - 1))):
            return False
        base = len(r.context) - len(r.accepted)
        tail = [int(x) for x in r.context[max(0, base - self.max_order):base]]
        probs = np.exp(np.asarray(r.topk_logprobs[:m + 1], dtype=np.float64))
        for row in range(m + 1):
            path = [tokens[j] for j in path_to(parents, row - 1)] if row else []
            seq = np.asarray((tail + path)[-self.max_order:], dtype=np.int64)
            store.observe_rows(seq, len(seq), r.topk_ids[row:row + 1],
                               probs[row:row + 1], self.max_order)
        return True

    # ------------------------------------------------------------ drafting
    def draft(self, ctx: StepContext) -> Drafts:
        n = len(ctx.requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        probs: list[np.ndarray | None] = [None] * n
        conf: list[np.ndarray | None] = [None] * n
        real: list[int] = [0] * n
        kinds: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        parents: list[list[int] | None] = [None] * n
        any_probs = False
        self._sweep(ctx)
        # Learn from every request first: samples of one prompt in this batch
        # draft from each other's newest observations.
        stores = []
        for r in ctx.requests:
            if r.in_prefill:
                stores.append(None)
                continue
            self._observe_outcomes(r)
            store = self._store_for(r)
            if not store.seeded:
                self._seed(store, np.asarray(r.context, dtype=np.int64))
            self._learn(store, r)
            stores.append(store)
        self._enforce_budget()
        for i, r, length in self.drafting_requests(ctx):
            sampled = not is_greedy(r)
            if self._tree_serves(r, sampled):
                t, p, c, k, parents[i] = self.tree(stores[i], r, length, sampled)
            else:
                t, p, c, k = self.chain(stores[i], r, length, sampled)
            real[i] = len(t)
            kinds[i] = k
            if sampled and self._pad_sampled and length > len(t):
                # Rule 2: the controller sees a length fixed before drafting.
                pad = length - len(t)
                t = t + [t[-1] if t else 0] * pad
                c = np.concatenate([c, np.full(pad, np.nan, np.float32)])
            tokens[i], probs[i], conf[i] = t, p, c
            any_probs = any_probs or p is not None
        if self._pad_sampled:
            self._real_lengths = real
        self._last_kinds = kinds
        trees = parents if any(p is not None for p in parents) else None
        return Drafts(tokens, probs if any_probs else None, conf, trees)

    def _tree_serves(self, r: RequestStep, sampled: bool) -> bool:
        """Whether this request drafts a tree: never where a tree would not be
        exact (rules 2 and 3 of docs/stand.md, and the test-only rows)."""
        if self.options["draft_shape"] != "tree":
            return False
        if not sampled:
            return True
        return (not self._pad_sampled and self._debug_mode(r.sampling_params) == "exact"
                and not verification_depends_on_token(r.sampling_params))

    def tree(self, store: NgramStore, r: RequestStep, budget: int, sampled: bool):
        """``chain``'s outputs for a Gumbel-top-k tree (proposers/stand_tree.py),
        plus the parents."""
        params = r.sampling_params
        top_k = int(getattr(params, "top_k", 0) or 0) if sampled else 0
        top_p = float(getattr(params, "top_p", 1.0) or 1.0) if sampled else 1.0
        grown = grow_tree(
            store, r.context[-self.max_order:], budget, sampled=sampled,
            temperature=r.temperature, top_k=top_k, top_p=top_p,
            rng=self._rng_for(r) if sampled else None, max_order=self.max_order,
            calibration=self.calibration, calibrate=self.options["calibrate"],
            min_path_prob=self.options["min_path_prob"])
        self.lookups["hit"] += grown.hits
        self.lookups["miss"] += grown.misses
        self.drafted["sampled" if sampled else "greedy"] += len(grown.tokens)
        rows = (dense_rows(grown.rows, self.vocab_size)
                if sampled and grown.tokens else None)
        return (grown.tokens, rows, np.asarray(grown.confidence, dtype=np.float32),
                grown.kinds, grown.parents)

    def chain(self, store: NgramStore, r: RequestStep, length: int, sampled: bool
              ) -> tuple[list[int], np.ndarray | None, np.ndarray,
                         list[tuple[int, float]]]:
        """One request's draft: tokens, probability rows (sampled only),
        confidences, and each token's (kind, score) for calibration.

        A position's score is read from its stored entry: the stored top-1
        probability at temperature 0, the tempered coverage of the sampled
        distribution otherwise. Its confidence is that score, calibrated by
        the observed acceptance of tokens drafted from entries of the same
        kind (``calibrate``). The path stops before position j when the
        running product of confidences (the estimated probability that the
        whole path is accepted) would fall under ``min_path_prob``; all of it
        is known before the token at j is drawn.
        """
        if not sampled:
            return self._greedy_chain(store, r.context[-self.max_order:], length)
        seq = [int(x) for x in r.context[-self.max_order:]]
        out: list[int] = []
        confs: list[float] = []
        kinds: list[tuple[int, float]] = []
        rows: list[tuple[np.ndarray, np.ndarray]] = []
        calibrate = self.options["calibrate"]
        running = 1.0
        threshold = self.options["min_path_prob"]
        params = r.sampling_params
        top_k = int(getattr(params, "top_k", 0) or 0) if sampled else 0
        top_p = float(getattr(params, "top_p", 1.0) or 1.0) if sampled else 1.0
        rng = self._rng_for(r) if sampled else None
        mode = self._debug_mode(params) if sampled else "exact"
        for _ in range(length):
            slot, order = store.find(seq, self.max_order)
            if slot < 0:
                self.lookups["miss"] += 1
                break
            self.lookups["hit"] += 1
            ids, p = store.entry(slot)
            if len(ids) == 0:
                break
            if sampled:
                q32, score = draft_distribution(p, r.temperature, top_k, top_p)
                ids = ids[:len(q32)]
            else:
                score = float(p[0])
            kind = self.calibration.kind(sampled, order, store.is_seed(slot))
            c = self.calibration.confidence(kind, score) if calibrate else score
            if running * c < threshold:
                break
            running *= c
            if sampled:
                # Gumbel-max: argmax(log q + G) is a draw from q.
                q = q32.astype(np.float64)
                q /= q.sum()
                with np.errstate(divide="ignore"):
                    g = np.log(q) - np.log(-np.log(rng.random(len(q))))
                x = int(ids[int(np.argmax(g if mode != "argmax" else q))])
                rows.append((ids, q32))
            else:
                x = int(ids[0])
            out.append(x)
            confs.append(c)
            kinds.append((kind, score))
            seq.append(x)
            if len(seq) > self.max_order:
                seq.pop(0)
        self.drafted["sampled" if sampled else "greedy"] += len(out)
        dense = None
        if (sampled and out and mode not in ("uniform", "drawn", "argmax")
                and verification_depends_on_token(params)):
            self.drafted["sampled_one_hot"] += len(out)  # rule 3: no rows
        elif sampled and out:
            dense = np.zeros((len(out), self.vocab_size), dtype=np.float32)
            dishonest = mode == "uniform"
            for j, (ids, q32) in enumerate(rows):
                if dishonest:  # TEST ONLY: not the distribution sampled from
                    dense[j, ids] = np.float32(1.0 / len(ids))
                else:
                    dense[j, ids] = q32
        return out, dense, np.asarray(confs, dtype=np.float32), kinds

    def _greedy_chain(self, store: NgramStore, tail: np.ndarray, length: int,
                      counted: bool = True):
        """``chain`` at temperature 0, in one numba loop over the store.
        ``counted``: a drafting step's walk, which counts in the metrics and
        makes the entries it reads the most recently used."""
        bufs = self._chain_buffers(length)
        cal = self.calibration
        n, hits, misses = greedy_chain(
            store.ids, store.probs, store.weight, store.keys, store.table, store.prev,
            store.next, store.meta, np.asarray(tail, dtype=np.int64), length,
            self.max_order, cal.accepted, cal.trials, cal.score_sum, cal.prior,
            bool(self.options["calibrate"]), float(self.options["min_path_prob"]),
            counted, *bufs)
        tok, conf, kind, score = (b[:n] for b in bufs)
        if counted:
            self.lookups["hit"] += hits
            self.lookups["miss"] += misses
            self.drafted["greedy"] += n
        kinds = list(zip(kind.tolist(), score.tolist()))
        return tok.tolist(), None, conf.astype(np.float32), kinds

    def _chain_buffers(self, length: int):
        """The greedy walk's output buffers (tokens, confidences, kinds,
        scores), allocated once and grown to the longest draft asked for."""
        if self._chain_out is None or len(self._chain_out[0]) < length:
            self._chain_out = (np.empty(length, np.int64), np.empty(length, np.float64),
                               np.empty(length, np.int64), np.empty(length, np.float64))
        return self._chain_out

    def continue_draft(self, request: RequestStep, prefix, n: int) -> np.ndarray:
        """The most probable continuation, up to ``n`` tokens, of a draft that
        starts with ``prefix`` (tokens this proposer did not draft): the
        greedy walk of the request's store from its context plus the prefix,
        under the same path-probability stop as a draft. It leaves the store,
        its LRU order and the metrics as they are. Empty when the request has
        no store yet."""
        key = self._req_key.get(request.req_id)
        store = self.stores.get(key) if key is not None else None
        if store is None or n <= 0:
            return np.zeros(0, dtype=np.int64)
        tail = np.concatenate([np.asarray(request.context[-self.max_order:], np.int64),
                               np.asarray(prefix, np.int64)])[-self.max_order:]
        tokens = self._greedy_chain(store, tail, int(n), counted=False)[0]
        return np.asarray(tokens, dtype=np.int64)

    def _debug_mode(self, params) -> str:
        return stand_debug.request_mode(self.debug_probs, params)

    # ------------------------------------------------------------ metrics
    def memory_bytes(self) -> int:
        return sum(s.nbytes() for s in self.stores.values())

    def metrics(self) -> dict:
        out = super().metrics()
        out["stand"] = {
            "stores": len(self.stores),
            "entries": sum(len(s) for s in self.stores.values()),
            "bytes": self.memory_bytes(),
            "stores_created": self.stores_created,
            "evicted_stores": self.evicted_stores,
            "evicted_entries": sum(s.evicted for s in self.stores.values()),
            "drafted": dict(self.drafted),
            "lookups": dict(self.lookups),
            "live_requests": len(self._req_key),
            "live_stores": len(self._live),
            "swept_requests": self.swept_requests,
            "acceptance_by_kind": self.calibration.table(),
        }
        return out
