"""Tree drafts: the layout (draft.py), the acceptance rules (acceptance.py),
and which requests a tree may serve and which sample greedily (sampling.py).

A proposer may return, per request, nodes in topological order with each
node's parent; the bridge verifies every node in one target forward and asks
acceptance.py which root-down path the target keeps. A chain is the tree with
one path, so these rules also reproduce chain verification.
"""

from vllm_plugins.tree.acceptance import (
    TreeAcceptance,
    greedy_accept,
    row_starts,
    sample_accept_deterministic,
    sample_accept_with_probs,
)
from vllm_plugins.tree.draft import (
    ROOT,
    ancestor_mask,
    chain_length,
    chain_parents,
    children,
    depths,
    path_to,
    validate,
)

__all__ = [
    "ROOT", "TreeAcceptance", "ancestor_mask", "chain_length", "chain_parents", "children",
    "depths", "greedy_accept", "path_to", "row_starts",
    "sample_accept_deterministic", "sample_accept_with_probs", "validate",
]
