"""State arrays as one table argument of a compiled call
(``vllm_plugins.proposers.array_table``): read and written in place, checked
against the layout the kernel reads, and the controller's learning through
it the same as through its arrays one by one."""

from __future__ import annotations

import numpy as np
import pytest

from vllm_plugins.proposers.array_table import ArrayTable, mat, vec
from vllm_plugins.proposers.draft_length import make_controller
from vllm_plugins.proposers.draft_length.controller_kernels import (learn_bound_step,
                                                                   learn_bound_step_table)
from vllm_plugins.proposers.jit import cached_njit

LAYOUT = ((np.int64, 1), (np.float32, 2), (np.bool_, 1))


@cached_njit
def _bump(t):
    v, m, b = vec(t, 0, np.int64), mat(t, 1, np.float32), vec(t, 2, np.bool_)
    v[len(v) - 1] += 7
    m[1, 2] = m[0, 0] + 0.5
    b[0] = not b[0]
    return v.sum() + m.shape[0] * 10 + m.shape[1]


def test_a_kernel_reads_and_writes_the_arrays_through_the_table():
    v, m, b = np.arange(5), np.ones((3, 4), np.float32), np.zeros(2, np.bool_)
    table = ArrayTable((v, m, b), LAYOUT)
    assert _bump(table.table) == 0 + 1 + 2 + 3 + 11 + 34
    assert v[-1] == 11 and m[1, 2] == 1.5 and b[0]
    assert table.arrays[0] is v


@pytest.mark.parametrize("arrays, says", [
    ((np.arange(5, dtype=np.int32), np.ones((3, 4), np.float32), np.zeros(2, np.bool_)),
     "array 0: the kernel reads int64 in 1 dimensions"),
    ((np.arange(5), np.ones(4, np.float32), np.zeros(2, np.bool_)), "array 1"),
    ((np.arange(5), np.ones((4, 3), np.float32).T, np.zeros(2, np.bool_)),
     "C-contiguous False"),
    ((np.arange(5), [[1.0]], np.zeros(2, np.bool_)), "got list"),
])
def test_an_array_the_layout_does_not_describe_is_refused_by_its_index(arrays, says):
    with pytest.raises(ValueError, match=says):
        ArrayTable(arrays, LAYOUT)
    with pytest.raises(ValueError, match="2 arrays for a layout of 3"):
        ArrayTable(arrays[:2], LAYOUT)


def _flat(c):
    """``learn_bound_step``'s state arguments, one by one."""
    slot, est, prefix, calibrate, _, _ = c._kernel_state()
    a = c.slots.arrays
    return ((*slot, *est, *(prefix or (None,) * 5), *(calibrate or (None,) * 10)),
            (a["zero_streak"], a["conf_seen"] if c.calibrator is not None
             else np.zeros(0, np.bool_)))


def _state(c):
    arrays = dict(c.slots.arrays)
    arrays.update(glob=c.estimator._glob, gps=c.estimator._gps, gpn=c.estimator._gpn)
    if c.prefix is not None:
        arrays.update(ps=c.prefix.s, pe=c.prefix.e)
    if c.calibrator is not None:
        arrays.update(gs=c.calibrator.gs, gn=c.calibrator.gn, cps=c.calibrator.gps,
                      cpn=c.calibrator.gpn)
    return arrays


CASES = [
    ("acceptance", {}),
    ("acceptance", {"estimator": "window"}),
    ("confidence", {}),
    ("goodput", {}),
    ("goodput", {"calibrate_prefix": False}),
]


@pytest.mark.parametrize("policy, options", CASES)
def test_the_learning_through_the_table_is_the_learning_through_its_arrays(policy, options):
    one, other = (make_controller(policy, options, 6) for _ in range(2))
    rng = np.random.default_rng(3)
    rows = one.slots.slots(["a", "b", "c", "d"])
    assert (other.slots.slots(["a", "b", "c", "d"]) == rows).all()
    for step in range(40):
        n = len(rows)
        verified = rng.integers(0, 7, n)
        info = np.stack([1 + rng.integers(0, verified + 1), verified,
                         rng.integers(-1, 20, n)], axis=1).astype(np.int64)
        trees = rng.random(n) < 0.3 if step % 2 else np.zeros(0, np.bool_)
        extra = (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))
        if one.calibrator is not None:   # outcomes of tree nodes, for the calibration
            k = int(rng.integers(0, 5))
            extra = (rng.choice(rows, k), rng.integers(0, 6, k), rng.random(k),
                     (rng.random(k) < 0.5).astype(np.float64))
        bound = (0.3, 2, 1, 6)
        got = []
        for c, through_table in ((one, False), (other, True)):
            outcomes, foreseen = np.full((4, n), -7, np.int64), np.full(n, np.nan)
            head = (rows, info, trees, True, True, outcomes, foreseen, *extra)
            if through_table:
                c._kernel_state()
                table, scalars, prefix_on, calibrate_on = c._learn_table
                out = learn_bound_step_table(*head, table.table, scalars, prefix_on,
                                             calibrate_on, *bound)
            else:
                state, bound_slots = _flat(c)
                out = learn_bound_step(*head, *state, *bound, *bound_slots)
            got.append((out, outcomes, foreseen))
        (a, a_out, a_seen), (b, b_out, b_seen) = got
        assert a[:2] == b[:2]
        np.testing.assert_array_equal(a[2], b[2])
        np.testing.assert_array_equal(a[3], b[3])
        np.testing.assert_array_equal(a_out, b_out)
        np.testing.assert_array_equal(a_seen, b_seen)
        for name, array in _state(one).items():
            np.testing.assert_array_equal(array, _state(other)[name], err_msg=name)


def test_the_cases_cover_each_calibration_on_and_off():
    made = [make_controller(policy, options, 6) for policy, options in CASES]
    assert {c.prefix is None for c in made} == {True, False}
    assert {c.calibrator is None for c in made} == {True, False}


def test_a_table_refuses_to_be_copied_with_addresses_of_arrays_it_does_not_hold():
    import copy
    import pickle

    table = ArrayTable((np.arange(5), np.ones((3, 4), np.float32), None), LAYOUT)
    for clone in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="not copied"):
            clone(table)
