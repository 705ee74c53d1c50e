"""Token Recycling's tables as a draft source.

The tables, their learning and the tree builder are the
``token_recycling`` method's own (one ``TokenRecyclingProposer`` held
inside, drafting trees with no policy of its own), so the source drafts
what the method would and the method is unchanged. The tables learn from
the target's top-k at every row the step verified, read against the nodes
that were sent (``sent``), as the method learns from its own trees.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import choice, flag, unit_float
from vllm_plugins.proposers.sources.base import DraftSource, SourceTree
from vllm_plugins.proposers.token_recycling_tables import TABLE_OPTIONS
from vllm_plugins.proposers.token_recycling_tree import BUILDERS


class RecyclingSource(DraftSource):
    name = "token_recycling"
    OPTIONS = (
        *TABLE_OPTIONS,
        unit_float("min_confidence", 0.02),
        flag("seed_from_prompt", True),
        choice("tree_builder", "best_first", BUILDERS),
        # Off by default in the hybrid: the ngram and suffix sources find
        # the context's verbatim spans.
        flag("context_branch", False),
    )

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer

        self.TOPK = options["topk"]
        self._inner = TokenRecyclingProposer(
            None, {**options, "draft_shape": "tree", "draft_length": "fixed"}, vocab_size)

    def load(self) -> None:
        self._inner.load_model(None)

    def learn(self, ctx) -> None:
        self._inner.learn(ctx)

    def propose(self, request, budget: int) -> SourceTree:
        tok, par, p = self._inner._tree.build(np.asarray(request.context, np.int64), budget,
                                              self.options["min_confidence"])
        return SourceTree(tok, par, p)

    def sent(self, ctx, drafts) -> None:
        self._inner.proposed(ctx, drafts)

    def free(self, req_id: str) -> None:
        self._inner.free(req_id)
