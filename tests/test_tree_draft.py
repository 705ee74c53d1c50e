"""Tree drafts: the parent-list layout and the parents field surviving the
scheduler's cut to a prefix (fast; no engine)."""

import numpy as np
import pytest
import torch

from vllm_plugins.proposers.base import trim
from vllm_plugins.step_context import Drafts
from vllm_plugins.tree import (ancestor_mask, chain_parents, depths, path_to,
                               validate)


def random_parents(rng, n):
    return [int(rng.integers(-1, i)) for i in range(n)]


def test_trim_keeps_the_same_prefix_of_parents():
    probs = [np.eye(8)[[1, 2, 3, 4]], None]
    drafts = Drafts([[1, 2, 3, 4], [5, 6, 7]], probs, None,
                    [[-1, -1, 0, 1], None])
    cut = trim(drafts, [3, 2])
    assert cut.tokens == [[1, 2, 3], [5, 6]]
    assert cut.parents == [[-1, -1, 0], None]
    assert cut.probs[0].shape == (3, 8) and cut.probs[1] is None
    validate(cut.parents[0])


def test_trim_of_chains_has_no_parents():
    assert trim(Drafts([[1, 2]]), [1]).parents is None


def test_chain_is_the_causal_triangle():
    assert chain_parents(4) == [-1, 0, 1, 2]
    assert chain_parents(0) == []
    assert depths(chain_parents(4)) == [1, 2, 3, 4]
    assert torch.equal(ancestor_mask(chain_parents(4)),
                       torch.ones(5, 5, dtype=torch.bool).tril())


def test_mask_depths_and_paths_agree_with_walking_up():
    rng = np.random.default_rng(0)
    for n in (1, 5, 40, 128):
        par = random_parents(rng, n)
        validate(par)
        mask, dep = ancestor_mask(par), depths(par)
        for i in range(n):
            path = path_to(par, i)
            assert path[-1] == i and len(path) == dep[i]
            assert all(par[b] == a for a, b in zip([-1] + path, path))
            seen = {0} | {j + 1 for j in path}
            assert set(torch.nonzero(mask[i + 1]).flatten().tolist()) == seen
        assert mask[0].tolist() == [True] + [False] * n


@pytest.mark.parametrize("parents, defect", [
    ([0], "node 0 has parent 0"),
    ([-1, 2, 0], "node 1 has parent 2"),
    ([-1, -2], "node 1 has parent -2"),
])
def test_validate_names_the_defect(parents, defect):
    with pytest.raises(ValueError, match=defect):
        validate(parents)
