"""A complete draft source from another package: the successors seen most.

It keeps, for every token, how often each token followed it in the
requests' prompts and outputs, and drafts the chain of most frequent successors,
each node's estimate the share of its successor among all that followed.
Made usable by name with one entry point (see docs/hybrid.md):

    [project.entry-points."vllm_plugins.draft_sources"]
    bigram = "hybrid_example_source:BigramSource"
"""

from collections import Counter, defaultdict

import numpy as np

from vllm_plugins.options import positive_int
from vllm_plugins.proposers.sources import DraftSource, SourceTree


class BigramSource(DraftSource):
    name = "bigram"
    # Declared options are validated like a method's, given as
    # "source_options": {"bigram": {"min_count": 3}}.
    OPTIONS = (positive_int("min_count", 2, 1 << 20),)

    def __init__(self, options, vocab_size, max_draft):
        super().__init__(options, vocab_size, max_draft)
        self.follow = defaultdict(Counter)   # token -> Counter of next tokens
        self.seen = {}                       # request -> context tokens counted

    def learn(self, ctx):
        """Count each new token of every context after the one before it."""
        for r in ctx.requests:
            start = max(self.seen.get(r.req_id, 0), 1)
            context = r.context.tolist()
            for prev, nxt in zip(context[start - 1:-1], context[start:]):
                self.follow[prev][nxt] += 1
            self.seen[r.req_id] = len(context)

    def propose(self, request, budget):
        """The chain of most frequent successors, while they were seen
        ``min_count`` times."""
        tokens, conf = [], []
        last = int(request.context[-1])
        while len(tokens) < budget:
            counts = self.follow.get(last)
            if not counts:
                break
            token, count = counts.most_common(1)[0]
            if count < self.options["min_count"]:
                break
            tokens.append(token)
            conf.append(count / sum(counts.values()))
            last = token
        return SourceTree.chain(np.array(tokens, np.int64), np.array(conf))

    def free(self, req_id):
        self.seen.pop(req_id, None)
