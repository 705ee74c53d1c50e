"""Tree drafts: the parents field survives the scheduler's cut to a prefix."""

import numpy as np

from proposers.base import trim
from vllm_plugins.step_context import Drafts


def test_trim_keeps_the_same_prefix_of_parents():
    probs = [np.eye(8)[[1, 2, 3, 4]], None]
    drafts = Drafts([[1, 2, 3, 4], [5, 6, 7]], probs, None,
                    [[-1, -1, 0, 1], None])
    cut = trim(drafts, [3, 2])
    assert cut.tokens == [[1, 2, 3], [5, 6]]
    assert cut.parents == [[-1, -1, 0], None]
    assert cut.probs[0].shape == (3, 8) and cut.probs[1] is None


def test_trim_of_chains_has_no_parents():
    assert trim(Drafts([[1, 2]]), [1]).parents is None
