"""Suffix trees as a draft source: arctic-inference's ``SuffixDecodingCache``.

The same library and the same calls as vLLM's ``suffix`` method
(vllm/v1/spec_decode/suffix_decoding.py): a suffix tree per live request
over its prompt and output, and a global tree over the outputs of up to
``max_cached_requests`` requests (FIFO eviction), both matched against the
context's last ``max_tree_depth`` tokens; the better scored of the two
drafts is used. Here with the library's tree speculation
(``use_tree_spec``), so a draft branches where earlier text did. The
library's estimates are path probabilities; a node's confidence is its
own divided by its parent's.

The cache is told every emitted token. Steps that drafted nothing (the
policy resting the method) are caught up from the context's length, so
the trees never miss text.

Memory: the library's, bounded by ``max_cached_requests`` outputs of at
most the model's length, plus one tree per live request.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import integer, number, unit_float
from vllm_plugins.proposers.sources.base import DraftSource, SourceTree


def conditional(parents: list[int], probs: list[float]) -> list[float]:
    """Each node's probability given its parent's, from the library's path
    probabilities (each clipped to [0, 1]; 0 under a parent of 0). Plain
    Python over the library's lists: a draft is at most a budget of
    nodes, where numpy's per-call cost would be most of the work."""
    q = [min(max(p, 0.0), 1.0) for p in probs]
    out = []
    for i, par in enumerate(parents):
        above = 1.0 if par < 0 else q[par]
        out.append(min(max(q[i] / above, 0.0), 1.0) if above > 0 else 0.0)
    return out


class SuffixSource(DraftSource):
    name = "suffix"
    # vLLM's defaults (SpeculativeConfig.suffix_decoding_*).
    OPTIONS = (
        integer("max_tree_depth", 24, 1, 1024),
        integer("max_cached_requests", 10000, 0, 1 << 20),
        number("max_spec_factor", 1.0, 0.0, lo_open=True),
        unit_float("min_token_prob", 0.1),
    )

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=options["max_tree_depth"],
                                         max_cached_requests=options["max_cached_requests"])
        self._told: dict[str, int] = {}   # request -> context tokens the cache holds

    def _sync(self, request) -> np.ndarray:
        """Tells the cache the request's new tokens; returns the context's
        last ``max_tree_depth`` tokens as the library takes them (int32):
        the new tokens and the pattern are cut from one conversion."""
        req_id = request.req_id
        context = request.context
        depth = self.options["max_tree_depth"]
        told = self._told.get(req_id)
        if told is None:
            if req_id in self.cache.cached_requests:
                self.cache.evict_cached_response(req_id)
            told = int(request.num_prompt_tokens)
            self.cache.start_request(req_id, np.ascontiguousarray(context[:told], np.int32))
        n = len(context)
        start = max(min(told, n - depth), 0)
        tail = np.ascontiguousarray(context[start:], np.int32)
        if n > told:
            self.cache.add_active_response(req_id, tail[told - start:])
        self._told[req_id] = n
        return tail[max(len(tail) - depth, 0):]

    def propose(self, request, budget: int) -> SourceTree:
        pattern = self._sync(request)
        if budget <= 0:
            return SourceTree.empty()
        o = self.options
        draft = self.cache.speculate(request.req_id, pattern, max_spec_tokens=int(budget),
                                     max_spec_factor=o["max_spec_factor"],
                                     min_token_prob=o["min_token_prob"], use_tree_spec=True)
        if not draft.token_ids:
            return SourceTree.empty()
        tokens, parents = np.array((draft.token_ids, draft.parents), np.int64)
        return SourceTree(tokens, parents,
                          np.array(conditional(draft.parents, draft.probs), np.float64))

    def free(self, req_id: str) -> None:
        if self._told.pop(req_id, None) is not None:
            self.cache.stop_request(req_id)
