"""The goodput policies' per-step compiled shortcuts against the code
they replace, over random inputs: ``price_tree_into`` (and through its
table, ``price_tree_table``) against ``price_tree`` and the copies into
the step's matrices, ``_both_shapes``
against two ``goodput_allocation`` calls (proposers/draft_length/tree_goodput.py),
``rest._corrected`` against ``ModeRates``' own reads."""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_draft_length_tree import tree_controller
from vllm_plugins.proposers.array_table import ArrayTable
from vllm_plugins.proposers.draft_length.acceptance import EPS
from vllm_plugins.proposers.draft_length.calibration import OutcomeCalibrator
from vllm_plugins.proposers.draft_length.goodput import goodput_allocation
from vllm_plugins.proposers.draft_length.tree_goodput import (CHAIN, TREE, _both_shapes,
                                                              tree_allocation)
from vllm_plugins.proposers.draft_length.tree_kernels import (PRICE_TABLE, price_tree,
                                                              price_tree_into,
                                                              price_tree_table)


def _random_parents(rng, n):
    return np.asarray([-1] + [int(rng.integers(-1, i)) for i in range(1, n)], np.int64)


@pytest.mark.parametrize("seed", range(25))
def test_pricing_into_the_matrices_equals_pricing_then_copying(seed):
    rng = np.random.default_rng(seed)
    controller = tree_controller(8)
    confidence = controller.calibrator
    row = 1
    confidence.slots.arrays["cal_s"][row] += rng.uniform(0, 3, confidence.slots.arrays[
        "cal_s"][row].shape)
    confidence.slots.arrays["cal_e"][row] += rng.uniform(0, 3, confidence.slots.arrays[
        "cal_e"][row].shape)
    tables = (*confidence.kernel_state()[1:8], EPS)
    cal = OutcomeCalibrator()
    cal.s[:] = rng.uniform(0, 5, len(cal.s))
    cal.e[:] = rng.uniform(0, 5, len(cal.e))
    batch = int(rng.integers(1, 4))
    width = int(rng.integers(1, 20))
    for calibrate in (False, True):
        i = int(rng.integers(0, batch))
        n = int(rng.integers(1, width + 1))
        parents = _random_parents(rng, n)
        conf = rng.uniform(0.01, 1.0, n)
        args = (parents, conf, row, confidence.depth - 1, *tables, calibrate, cal.EDGES,
                cal.s, cal.e, cal._STRENGTH, EPS, 1.0 - EPS)
        want = price_tree(*args)
        # Matrices with something in every row already (chain rows, zeros).
        q = rng.uniform(0, 1, (batch, width))
        valid = rng.uniform(0, 1, (batch, width)) < 0.5
        q_chain, valid_chain = q.copy(), valid.copy()
        lengths_chain = rng.integers(0, width + 1, batch)
        wq, wv, wqc, wvc, wl = (x.copy() for x in (q, valid, q_chain, valid_chain,
                                                   lengths_chain))
        depth, q_raw, _, ranked, path, q_ranked, q_path = want
        wq[i, :n], wv[i, :n] = q_ranked, True
        wqc[i, :len(path)], wvc[i, :len(path)] = q_path, True
        wl[i] = len(path)
        # The same through the calibrations' table (what the controller calls).
        table = ArrayTable((*tables[:6], cal.EDGES, cal.s, cal.e), PRICE_TABLE)
        scalars = np.array((confidence.depth - 1, tables[6], EPS, cal._STRENGTH, EPS,
                            1.0 - EPS))
        inputs = (q, valid, q_chain, valid_chain, lengths_chain)
        for through_table, (q, valid, q_chain, valid_chain, lengths_chain) in (
                (False, [x.copy() for x in inputs]), (True, [x.copy() for x in inputs])):
            got = (price_tree_table(parents, conf, row, table.table, scalars, calibrate, i, q,
                                    valid, q_chain, valid_chain, lengths_chain)
                   if through_table else
                   price_tree_into(*args, i, q, valid, q_chain, valid_chain, lengths_chain))
            for g, w in zip(got, (depth, q_raw, ranked, path)):
                assert g.tolist() == w.tolist()
            for g, w in zip((q, valid, q_chain, valid_chain, lengths_chain),
                            (wq, wv, wqc, wvc, wl)):
                assert g.tolist() == w.tolist()


@pytest.mark.parametrize("seed", range(40))
def test_both_shapes_in_one_call_equals_two_allocations(seed):
    rng = np.random.default_rng(seed)
    batch, width = int(rng.integers(1, 5)), int(rng.integers(1, 12))
    # Non-increasing rows, with ties now and then, and some positions not offered.
    q = np.sort(rng.choice([0.2, 0.5, 0.9], (batch, width)) if seed % 3 == 0
                else rng.uniform(0, 1, (batch, width)), axis=1)[:, ::-1].copy()
    q_chain = np.sort(rng.uniform(0, 1, (batch, width)), axis=1)[:, ::-1].copy()
    lengths = rng.integers(0, width + 1, batch)
    valid = np.arange(width)[None, :] < lengths[:, None]
    valid_chain = np.arange(width)[None, :] < rng.integers(0, width + 1, batch)[:, None]
    a, b = float(rng.uniform(0.5, 2)), float(rng.uniform(0.001, 0.5))
    verify, tree_s = float(rng.choice([0.0, 0.1])), float(rng.choice([0.0, 0.05, 0.3]))
    shape_s = float(rng.choice([0.0, 0.2]))
    token_s = float(rng.choice([0.0, 0.002, 0.02]))
    sizes = (None, np.zeros(0, np.int64),
             rng.integers(1, batch * (width + 1) + 1, 4))[seed % 3]
    # Per-count corrections over part of the counts, of either sign.
    by_count = (None, rng.uniform(-0.2, 0.4, int(rng.integers(0, batch * (width + 1) + 2))))[
        seed % 2]
    as_tree = goodput_allocation(q, valid, a, b + token_s, verify + tree_s, shape_s, sizes,
                                 by_count)
    as_chain = goodput_allocation(q_chain, valid_chain, a, b, verify, shape_s, sizes, by_count)
    want = (*as_tree, TREE) if as_tree[1] > as_chain[1] else (*as_chain, CHAIN)
    got = tree_allocation(q, valid, q_chain, valid_chain, a, b, verify, tree_s, shape_s, sizes,
                          token_s, by_count)
    assert got[0].tolist() == want[0].tolist() and got[1:] == want[1:]
    # The compiled call itself, with the arguments the wrapper gives it.
    warm = np.zeros(0, np.int64) if sizes is None or shape_s <= 0 else sizes
    keep, goodput, tokens, tree = _both_shapes(q, valid, q_chain, valid_chain, a, b, verify,
                                               tree_s, shape_s, warm, sizes is not None,
                                               token_s,
                                               np.zeros(0) if by_count is None else by_count)
    assert keep.tolist() == want[0].tolist() and (goodput, tokens) == want[1:3]
    assert (TREE if tree else CHAIN) == want[3]


def test_a_new_tree_controller_has_its_tree_loops_compiled(monkeypatch):
    """``make_controller``'s warm-up reaches the tree path's loops too: no
    compilation in the steps of a world of trees and chains."""
    import numba.core.dispatcher as dispatcher

    from tests.draft_length_tree_world import Cost, TreeWorld, run

    c = tree_controller(16)
    compiled = []
    real = dispatcher.Dispatcher.compile
    monkeypatch.setattr(dispatcher.Dispatcher, "compile",
                        lambda self, sig: compiled.append(self.py_func.__name__) or real(self, sig))
    run(c, TreeWorld(3, Cost(0.02, 0.0005, 0.002), nodes=12, tree_rows=2), 80)
    assert compiled == []


@pytest.mark.parametrize("seed", range(20))
def test_the_rest_comparison_reads_the_rates_as_mode_rates_gives_them(seed):
    """rest._corrected against ModeRates.rates and ModeRates.bias."""
    from vllm_plugins.proposers.draft_length.rest import ModeRates, _corrected

    rng = np.random.default_rng(seed)
    modes = ModeRates()
    modes._tables[:] = rng.uniform(0, 5, modes._tables.shape)
    modes._tables[3] *= rng.uniform(0, 1, modes._tables[3].shape) < 0.7   # unpromised cells
    for batch in (1, 2, 7, 64, 300):
        goodput, idle = float(rng.uniform(1, 100)), float(rng.uniform(1, 100))
        _, _, n_rest, n_awake = modes.rates(batch)
        want = (n_rest, n_awake, modes.bias(batch) * goodput,
                modes.bias(batch, resting=True) * idle)
        assert _corrected(modes._tables, modes.cell(batch), goodput, idle) == want
