"""A draft source from another package that fails on one tensor-parallel
rank only (tests/test_tensor_parallel_e2e.py): on the second rank it raises
at every third context length, elsewhere it drafts the last token repeated
(the tiny test model repeats tokens in runs, so such drafts are accepted)."""

import numpy as np

from vllm_plugins.proposers.sources import DraftSource, SourceTree


class RankOneFailsSource(DraftSource):
    name = "rank_one_fails"

    def propose(self, request, budget):
        import torch.distributed as dist

        if (dist.is_initialized() and dist.get_rank() == 1
                and len(request.context) % 3 == 0):
            raise RuntimeError("fails on the second rank only")
        n = min(budget, 3)
        return SourceTree.chain(np.full(n, int(request.context[-1])), np.full(n, 0.9))
