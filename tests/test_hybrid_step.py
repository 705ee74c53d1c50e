"""The hybrid's step-level kernels against their one-request references
(fast; no engine): a step's merge is each request's merge, a step's
outcomes are each request's, and the calibration's numba learning is the
numpy formula it replaced."""

import copy

import numpy as np
import pytest

from vllm_plugins.proposers.sources import DraftSource, SourceTree
from vllm_plugins.proposers.sources.calibrate import SourceCalibrator
from vllm_plugins.proposers.sources.merge import MergedStep, Merger, outcomes

SOURCES = 3


def random_tree(rng, budget, fault=None):
    """A source tree within ``budget`` nodes, or one that breaks the
    contract one way: "parent" (a parent after its node), "confidence"
    (outside [0, 1] or NaN), "size" (more nodes than the budget)."""
    n = budget + int(rng.integers(1, 4)) if fault == "size" else int(rng.integers(1, budget + 1))
    par = np.array([int(rng.integers(-1, i)) if i else -1 for i in range(n)], np.int64)
    conf = rng.uniform(0, 1, n)
    if fault == "parent":
        par[-1] = n - 1
    elif fault == "confidence":
        conf[-1] = rng.choice([np.nan, 1.5, -0.1])
    return SourceTree(rng.integers(0, 4, n), par, conf)


def learned_calibrator(rng):
    cal = SourceCalibrator(SOURCES, 8)
    n = 300
    cal.learn(rng.integers(0, SOURCES, n), rng.integers(1, 9, n), rng.uniform(0, 1, n),
              rng.integers(0, 2, n).astype(float))
    return cal


def test_a_steps_merge_is_each_requests_merge():
    rng = np.random.default_rng(0)
    for trial in range(200):
        cal = learned_calibrator(rng)
        trees, counts, budgets, chains = [], [], [], []
        for _ in range(int(rng.integers(1, 6))):
            budget = int(rng.integers(1, 12))
            ks = sorted(rng.choice(SOURCES, int(rng.integers(1, SOURCES + 1)), replace=False))
            for k in ks:
                fault = None if rng.random() < 0.8 else rng.choice(["parent", "confidence",
                                                                    "size"])
                trees.append((int(k), random_tree(rng, budget, fault)))
            counts.append(len(ks))
            budgets.append(budget)
            chains.append(bool(rng.random() < 0.4))
        node_count = np.zeros(SOURCES, np.int64)
        step = Merger(SOURCES).merge_step(trees, counts, budgets, chains, cal, node_count)
        at, want_count = 0, np.zeros(SOURCES, np.int64)
        for r, (count, budget, chain) in enumerate(zip(counts, budgets, chains)):
            mine = trees[at:at + count]
            valid = []
            for g, (k, t) in enumerate(mine):
                try:
                    valid.append((k, t.check(budget)))
                    assert step.status[at + g] == 0, (trial, r, g)
                except ValueError:           # the merge refuses it too, saying why
                    assert step.status[at + g] in MergedStep.PROBLEMS, (trial, r, g)
            at += count
            a, m = int(step.start[r]), int(step.n[r])
            if not valid:
                assert m == 0
                continue
            tok, par, cond, mask, depth, q, raw = Merger(SOURCES).merge(valid, cal, budget)
            assert step.tokens[a:a + m].tolist() == tok.tolist()
            assert step.parents[a:a + m].tolist() == par.tolist()
            assert np.array_equal(step.cond[a:a + m], cond)
            assert np.array_equal(step.trees.mask[a:a + m], mask)
            assert np.array_equal(step.trees.depth[a:a + m], depth)
            assert np.array_equal(step.trees.raw[a:a + m], raw, equal_nan=True)
            for s in range(SOURCES):
                want_count[s] += int(np.count_nonzero(mask & (1 << s)))
            if chain:
                path = Merger(SOURCES).chain(par, q)
                c = int(step.chain_n[r])
                assert step.chain_tok[a:a + c].tolist() == tok[path].tolist()
                assert np.array_equal(step.chain_cond[a:a + c], cond[path])
            else:
                assert step.chain_n[r] == 0
        assert node_count.tolist() == want_count.tolist()


def reference_outcomes(trees, start, n, emitted, num_sources):
    """The calibration entries and accepted counts of one request, as the
    hybrid computed them a request at a time."""
    tok, par, depth = (trees.tokens[start:start + n], trees.parents[start:start + n],
                       trees.depth[start:start + n])
    raw, mask = trees.raw[start:start + n], trees.mask[start:start + n]
    observed, accepted = np.zeros(n, np.bool_), np.zeros(n, np.bool_)
    path = np.zeros(n, np.int64)
    m = outcomes(tok, par, depth, np.asarray(emitted, np.int64), observed, accepted, path)
    idx = np.nonzero(observed)[0]
    node_i, src = np.nonzero(~np.isnan(raw[idx]))
    acc, alone = np.zeros(num_sources, np.int64), np.zeros(num_sources, np.int64)
    for v in path[:m].tolist():
        bits = [k for k in range(num_sources) if mask[v] >> k & 1]
        for k in bits:
            acc[k] += 1
        if len(bits) == 1:
            alone[bits[0]] += 1
    return (src, depth[idx][node_i], raw[idx][node_i, src],
            accepted[idx][node_i].astype(np.float64), acc, alone)


def test_a_steps_outcomes_are_each_requests():
    rng = np.random.default_rng(1)
    for trial in range(200):
        cal = learned_calibrator(rng)
        trees, counts, budgets = [], [], []
        for _ in range(int(rng.integers(1, 6))):
            k, budget = int(rng.integers(1, SOURCES + 1)), int(rng.integers(1, 12))
            for s in sorted(rng.choice(SOURCES, k, replace=False)):
                trees.append((int(s), random_tree(rng, budget)))
            counts.append(k)
            budgets.append(budget)
        step = Merger(SOURCES).merge_step(trees, counts, budgets, [False] * len(counts),
                                          cal, np.zeros(SOURCES, np.int64))
        starts, lengths, emitted = step.start.tolist(), step.n.tolist(), []
        for a, m in zip(starts, lengths):
            # the target's tokens: often down a path of the tree, then a token
            e = [int(t) for t in rng.integers(0, 4, int(rng.integers(1, 6)))]
            if m and rng.random() < 0.7:
                v = int(rng.integers(m))
                path = []
                while v >= 0:
                    path.append(int(step.tokens[a + v]))
                    v = int(step.parents[a + v])
                e = path[::-1] + e[:1]
            emitted.append(np.asarray(e, np.int64))
        acc, alone = np.zeros(SOURCES, np.int64), np.zeros(SOURCES, np.int64)
        got = Merger(SOURCES).outcomes_step(step.trees, starts, lengths, emitted, acc, alone)
        want = [reference_outcomes(step.trees, a, m, e, SOURCES)
                for a, m, e in zip(starts, lengths, emitted)]
        for j in range(4):
            assert np.array_equal(got[j], np.concatenate([w[j] for w in want])), (trial, j)
        assert acc.tolist() == sum(w[4] for w in want).tolist()
        assert alone.tolist() == sum(w[5] for w in want).tolist()
        assert got[4].tolist() == [w[5].tolist() for w in want]   # per request


def numpy_learn(cal, source, depth, c, outcome):
    """The calibration's learning as numpy writes it."""
    d = np.clip(np.asarray(depth, np.int64) - 1, 0, cal.depth - 1)
    c = np.clip(np.nan_to_num(np.asarray(c, np.float64)), 0.0, 1.0)
    b = np.clip((c * cal.bins).astype(np.int64), 0, cal.bins - 1)
    src, x = np.asarray(source, np.int64), np.asarray(outcome, np.float64)
    for a in (cal.s, cal.n, cal.sd, cal.nd):
        a *= cal.decay
    np.add.at(cal.s, (src, b), x)
    np.add.at(cal.n, (src, b), 1.0)
    np.add.at(cal.sd, (src, d, b), x)
    np.add.at(cal.nd, (src, d, b), 1.0)


def test_calibration_learns_as_the_numpy_formula():
    rng = np.random.default_rng(2)
    for trial in range(50):
        got, want = SourceCalibrator(SOURCES, 5), SourceCalibrator(SOURCES, 5)
        for _ in range(4):
            n = int(rng.integers(1, 200))
            c = rng.choice([-1.0, 0.0, 0.35, 0.999, 1.0, 1.7, np.nan, np.inf, -np.inf], n)
            args = (rng.integers(0, SOURCES, n), rng.integers(-1, 9, n), c,
                    rng.integers(0, 2, n).astype(float))
            got.learn(*args)
            numpy_learn(want, *args)
        for name in ("s", "n", "sd", "nd"):
            assert np.array_equal(getattr(got, name), getattr(want, name)), (trial, name)


def test_the_proposer_cost_bench_runs_every_method_on_the_same_steps():
    """``python -m vllm_plugins.bench proposer-cost``: each method's steps
    timed, drafting, and the first method the ratios' reference."""
    from vllm_plugins.bench import proposer_cost

    args = proposer_cost.parse_args(["--steps", "6", "--warmup", "2", "--prompt", "40",
                                     "--distinct", "20", "--output", "12",
                                     "--batch-sizes", "1,3"])
    rows = proposer_cost.run(proposer_cost.DEFAULT_METHODS, args.batch_sizes, args)
    assert [(r["batch"], r["method"]) for r in rows] == [
        (b, m) for b in (1, 3) for m in proposer_cost.DEFAULT_METHODS]
    for r in rows:
        assert r["steps"] == 6 and r["median_ms"] > 0 and r["nodes_per_step"] > 0, r
        if r["method"] == "token_recycling":
            assert r["ratio_to_token_recycling"] == 1.0


class OddTreeSource(DraftSource):
    """A tree that breaks the contract in the way its name says."""

    name = "odd"
    odd = "huge"

    def propose(self, request, budget):
        chain = SourceTree.chain([3, 4], [0.5, 0.5])
        if self.odd == "not-numbers":
            return SourceTree(np.array(["a", "b"]), chain.parents, chain.confidence)
        if self.odd == "huge":          # an id past int64
            return SourceTree([2 ** 70, 3], chain.parents, chain.confidence)
        if self.odd == "column":        # one column of ids beside 1-D trees
            return SourceTree(chain.tokens[:, None], chain.parents, chain.confidence)
        if self.odd == "negative":
            return SourceTree(np.array([-1, 3]), chain.parents, chain.confidence)
        return SourceTree(np.array([3, VOCAB_PAST]), chain.parents, chain.confidence)


VOCAB_PAST = 10 ** 6  # past the hybrid's vocabulary


@pytest.mark.parametrize("odd", ["not-numbers", "huge", "column", "negative", "past-vocab"])
def test_a_source_drafting_an_odd_tree_costs_only_its_own_candidates(odd, monkeypatch,
                                                                     caplog):
    """A tree of what is not a number, of ids past int64, of the wrong shape,
    or of ids outside the vocabulary is that source's fault alone: the other
    sources draft for every request, and the error counts against that
    source (logged once)."""
    from tests.test_hybrid import hybrid, request
    from vllm_plugins.proposers import sources
    from vllm_plugins.step_context import StepContext

    monkeypatch.setitem(sources.BUILTIN, "odd", f"{__name__}:OddTreeSource")
    monkeypatch.setattr(OddTreeSource, "odd", odd)
    p = hybrid(sources=["odd", "ngram"])
    context = [7, 8, 9, 7, 8, 9, 7, 8]
    for _ in range(3):
        d = p.step(StepContext([request(context), request(context, req_id="b")],
                               max_draft=8))
        assert d.tokens[0][:2] == [9, 7] and d.tokens[1][:2] == [9, 7]   # ngram's
        assert all(0 <= t < p.vocab_size for ts in d.tokens for t in ts)
    m = p.metrics()
    assert m["num_errors"] == 0
    assert m["sources"]["odd"]["errors"] == 6 and m["sources"]["ngram"]["errors"] == 0
    assert sum("'odd'" in r.getMessage() for r in caplog.records) == 1


def test_trees_of_different_steps_are_read_together():
    """A request that sat out a step is read against the tree of the step it
    last drafted in, beside requests whose trees are the last step's: the
    same entries, in batch order, as reading each tree alone."""
    from tests.test_hybrid import hybrid, request
    from vllm_plugins.step_context import StepContext

    p = hybrid(sources=["ngram", "token_recycling"])
    a, b = [7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3, 1, 2, 3, 1, 2]
    p.step(StepContext([request(a), request(b, req_id="b")], max_draft=8))
    old_b = p._merged["b"]
    p.step(StepContext([request(a + [9], [9])], max_draft=8))    # b sits out
    new_a = p._merged["a"]
    assert old_b.trees is not new_a.trees
    expected = copy.deepcopy(p.calibrator)
    emitted = [np.array([7, 8]), np.array([3, 5])]
    p.step(StepContext([request(a + [9, 7, 8], emitted[0]),
                        request(b + [3, 5], emitted[1], req_id="b")], max_draft=8))
    acc, alone = np.zeros(2, np.int64), np.zeros(2, np.int64)
    want = [[x.copy() for x in Merger(2).outcomes_step(rec.trees, [rec.start], [rec.n], [e],
                                                       acc, alone)[:4]]
            for rec, e in ((new_a, emitted[0]), (old_b, emitted[1]))]
    entries = [np.concatenate([w[j] for w in want]) for j in range(4)]
    assert len(entries[0]) > 0
    expected.learn(*entries)    # the step learned these entries, in this order
    for table in ("s", "n", "sd", "nd"):
        assert np.array_equal(getattr(p.calibrator, table), getattr(expected, table)), table


def test_outcomes_learned_in_the_kernel_are_the_calibrators_learning():
    """``outcomes_step`` with a calibrator leaves its tables as its own
    ``learn`` of the entries returned would."""
    rng = np.random.default_rng(4)
    for trial in range(50):
        cal = learned_calibrator(rng)
        trees, counts = [], []
        for _ in range(int(rng.integers(1, 5))):
            for s in sorted(rng.choice(SOURCES, 2, replace=False)):
                trees.append((int(s), random_tree(rng, 8)))
            counts.append(2)
        step = Merger(SOURCES).merge_step(trees, counts, [8] * len(counts),
                                          [False] * len(counts), cal, np.zeros(SOURCES, np.int64))
        emitted = [np.asarray(rng.integers(0, 4, 3), np.int64) for _ in counts]
        expected = copy.deepcopy(cal)
        got = Merger(SOURCES).outcomes_step(step.trees, step.start.tolist(), step.n.tolist(),
                                            emitted, np.zeros(SOURCES, np.int64),
                                            np.zeros(SOURCES, np.int64), cal)
        if len(got[0]):
            expected.learn(*got[:4])
        for table in ("s", "n", "sd", "nd"):
            assert np.array_equal(getattr(cal, table), getattr(expected, table)), (trial, table)
