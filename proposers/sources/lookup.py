"""Prompt lookup (n-gram) as a draft source, branching where the context
disagrees with itself.

vLLM's ``ngram`` drafts the tokens that followed the latest earlier
occurrence of the context's longest repeated suffix (``prompt_lookup_min``
to ``prompt_lookup_max`` tokens). This source takes up to ``max_matches``
of the latest such occurrences and merges their continuations into one
small trie: where they agree it is a chain, where they part it branches,
each branch as probable as the share of occurrences that took it. A root
child's estimate is that share times m / (m + 1) for a suffix of m tokens
(a uniform prior over whether the repeat goes on); a deeper node's, its
share of its parent's occurrences. The hybrid calibrates both per depth.

One numba pass per request over the context and buffers allocated once.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import positive_int
from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.sources.base import DraftSource, SourceTree


@cached_njit
def _lookup_tree(ctx, lo, hi, max_matches, budget, ends, out_tok, out_par, out_cnt,
                 out_conf):
    """Trie of the continuations after the latest ``max_matches``
    occurrences of the longest suffix (lo..hi tokens) seen earlier in
    ``ctx``. Returns (nodes, match length); ``out_cnt``: occurrences
    through each node; ``out_conf``: its estimate (module doc)."""
    n = len(ctx)
    if n < lo + 1:
        return 0, 0
    best = 0
    # Longest match: for each earlier end position, how many tokens back agree.
    for e in range(n - 2, -1, -1):
        k = 0
        while k < hi and e - k >= 0 and ctx[e - k] == ctx[n - 1 - k]:
            k += 1
        if k > best:
            best = k
            if best == hi:
                break
    if best < lo:
        return 0, 0
    found = 0
    for e in range(n - 2, -1, -1):
        if found == max_matches:
            break
        k = 0
        while k < best and e - k >= 0 and ctx[e - k] == ctx[n - 1 - k]:
            k += 1
        if k == best:
            ends[found] = e
            found += 1
    m = 0
    for f in range(found):
        parent = -1
        pos = ends[f] + 1
        while pos < n and pos - ends[f] <= budget:
            t = ctx[pos]
            child = -1
            for v in range(m):
                if out_par[v] == parent and out_tok[v] == t:
                    child = v
                    break
            if child < 0:
                if m == budget:
                    break
                child = m
                m += 1
                out_tok[child] = t
                out_par[child] = parent
                out_cnt[child] = 0
            out_cnt[child] += 1
            parent = child
            pos += 1
    total = 0
    for v in range(m):
        if out_par[v] < 0:
            total += out_cnt[v]
    for v in range(m):
        if out_par[v] < 0:
            out_conf[v] = out_cnt[v] / total * (best / (best + 1.0))
        else:
            out_conf[v] = out_cnt[v] / out_cnt[out_par[v]]
    return m, best


class LookupSource(DraftSource):
    name = "ngram"
    OPTIONS = (
        positive_int("prompt_lookup_min", 2, 4096),
        positive_int("prompt_lookup_max", 5, 4096),
        positive_int("max_matches", 4, 64),
    )

    @classmethod
    def check_options(cls, options) -> None:
        if options["prompt_lookup_min"] > options["prompt_lookup_max"]:
            raise ValueError(
                f"draft source option 'prompt_lookup_min' of source 'ngram' must be <= "
                f"'prompt_lookup_max' ({options['prompt_lookup_max']}), got "
                f"{options['prompt_lookup_min']}")

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        self._ends = np.zeros(options["max_matches"], np.int64)
        self._grow(max(max_draft, 16))

    def _grow(self, budget: int) -> None:
        self._tok = np.zeros(budget, np.int64)
        self._par = np.zeros(budget, np.int64)
        self._cnt = np.zeros(budget, np.int64)
        self._conf = np.zeros(budget, np.float64)

    def load(self) -> None:
        self.propose_context(np.array([1, 2, 3, 1, 2], np.int64), 2)

    def propose(self, request, budget: int) -> SourceTree:
        return self.propose_context(request.context, budget)

    def propose_context(self, context, budget: int) -> SourceTree:
        if budget <= 0:
            return SourceTree.empty()
        if len(self._tok) < budget:
            self._grow(budget)
        o = self.options
        ctx = np.ascontiguousarray(context, np.int64)
        m, _ = _lookup_tree(ctx, o["prompt_lookup_min"], o["prompt_lookup_max"],
                            o["max_matches"], budget, self._ends, self._tok, self._par,
                            self._cnt, self._conf)
        if m == 0:
            return SourceTree.empty()
        return SourceTree(self._tok[:m].copy(), self._par[:m].copy(), self._conf[:m].copy())
