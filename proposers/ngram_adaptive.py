"""vLLM's own n-gram (prompt lookup) drafting under our draft-length controller.

The lookup is vLLM's numba function, unchanged; what this adds is the
per-request length decision (``draft_length``), so vLLM's built-in method can
be compared with and without it. Use ``{"method": "ngram_adaptive",
"prompt_lookup_min": 2, "prompt_lookup_max": 5, "draft_length": "goodput"}``.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.options import positive_int
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.draft_length import draft_length_options
from vllm_plugins.step_context import Drafts, StepContext


class NgramAdaptiveProposer(PluginProposer):
    OPTIONS = (
        *draft_length_options("goodput"),
        # A lookup length allocates nothing; the bound keeps one lookup's cost
        # to a few thousand comparisons per context position.
        positive_int("prompt_lookup_min", 2, 4096),
        positive_int("prompt_lookup_max", 5, 4096),
    )
    DEFAULT_NUM_SPECULATIVE_TOKENS = 5
    CAN_REST = True   # a lookup in each request's context, no state

    @classmethod
    def check_options(cls, where: str, options: dict) -> None:
        lo, hi = options["prompt_lookup_min"], options["prompt_lookup_max"]
        if lo > hi:
            raise ValueError(f"speculative_config option 'prompt_lookup_min' of method "
                             f"'{where}' must be <= 'prompt_lookup_max' ({hi}), got {lo}")

    def __init__(self, vllm_config=None, options: dict | None = None,
                 vocab_size: int | None = None):
        super().__init__(vllm_config, options, vocab_size)
        # vllm.v1.spec_decode.ngram_proposer._find_longest_matched_ngram_and_propose_tokens
        # (origin_tokens, min_ngram, max_ngram, max_model_len, k) -> np.ndarray
        from vllm.v1.spec_decode.ngram_proposer import (
            _find_longest_matched_ngram_and_propose_tokens as lookup)

        self._lookup = lookup

    def draft(self, ctx: StepContext) -> Drafts:
        lo, hi = self.options["prompt_lookup_min"], self.options["prompt_lookup_max"]
        out: list[list[int]] = [[] for _ in ctx.requests]
        for i, r, k in self.drafting_requests(ctx):
            if k <= 0:
                continue
            tokens = np.ascontiguousarray(r.context, dtype=np.int32)
            found = self._lookup(tokens, lo, hi, len(tokens) + k, k)
            out[i] = [int(t) for t in found]
        return Drafts(out)
