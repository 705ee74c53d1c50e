"""STAND's n-gram store as a draft source.

The store, its learning and its greedy walk are the ``stand`` method's own
(one ``StandProposer`` held inside): per prompt, n-grams whose values are
the target's own next-token distributions, learned from its top-k at every
verified row, read against the nodes that were sent (``sent``), and shared
by the samples of one prompt. The source drafts the store's most probable
path, each node's estimate its stored probability; that draft is a
function of the store, so it is verified as a deterministic (one-hot)
draft, exact at any temperature. STAND's sampled drafts, which need their
probability rows, stay the ``stand`` method's.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import integer, unit_float
from vllm_plugins.proposers.sources.base import DraftSource, SourceTree
from vllm_plugins.proposers.stand_store import STORE_OPTIONS


class StandSource(DraftSource):
    name = "stand"
    OPTIONS = (
        integer("topk", 8, 1, 64),
        integer("max_order", 3, 1, 8),
        unit_float("min_path_prob", 0.05),
        *STORE_OPTIONS,
    )

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        from vllm_plugins.proposers.stand import StandProposer

        self.TOPK = options["topk"]
        # Calibration by kind reads the outcomes of STAND's own drafts; here
        # the hybrid calibrates per depth instead.
        self._inner = StandProposer(None, {**options, "draft_length": "fixed",
                                           "calibrate": False}, vocab_size)

    def load(self) -> None:
        self._inner.load_model(None)

    def learn(self, ctx) -> None:
        inner = self._inner
        inner._sweep(ctx)
        for r in ctx.requests:
            if r.in_prefill:
                continue
            store = inner._store_for(r)
            if not store.seeded:
                inner._seed(store, np.asarray(r.context, dtype=np.int64))
            inner._learn(store, r)
        inner._enforce_budget()

    def propose(self, request, budget: int) -> SourceTree:
        inner = self._inner
        store = inner.stores.get(inner._req_key.get(request.req_id))
        if store is None or budget <= 0:
            return SourceTree.empty()
        tok, _, conf, _ = inner._greedy_chain(store, request.context[-inner.max_order:],
                                              budget)
        return SourceTree.chain(tok, np.clip(conf.astype(np.float64), 0.0, 1.0))

    def sent(self, ctx, drafts) -> None:
        """Tree drafts are learned node by node along their paths next step;
        chains along the verified rows."""
        parents = drafts.parents or [None] * len(ctx.requests)
        for r, tok, par in zip(ctx.requests, drafts.tokens, parents):
            self._inner._pending_tree.pop(r.req_id, None)
            if par is not None and tok:
                self._inner._pending_tree[r.req_id] = ([], list(par), list(tok))

    def free(self, req_id: str) -> None:
        self._inner.free(req_id)
