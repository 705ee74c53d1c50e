"""STAND's n-gram store: its rules, and the numba store and walk against
plain-Python references (fast; no engine)."""

from collections import OrderedDict

import numpy as np
import pytest

from tests.test_stand import greedy_history, proposer, req
from vllm_plugins.proposers.stand_store import NgramStore, context_keys


# ------------------------------------------------------------------- store
def test_context_keys_differ_by_order_and_content():
    k = context_keys([1, 2, 3], 3)
    assert len(k) == 3 and len(set(k)) == 3
    assert context_keys([9, 2, 3], 3)[:2] == k[:2]  # orders 1, 2 share the tail
    assert context_keys([9, 2, 3], 3)[2] != k[2]
    assert context_keys([3], 3) == k[:1]


def test_observations_average_and_keep_the_top_width():
    s = NgramStore(width=2, capacity=16, history=4)
    s.observe(7, np.array([3, 4]), np.array([0.6, 0.3]))
    ids, p = s.entry(s.slot_of(7))
    assert list(ids) == [3, 4] and p == pytest.approx([0.6, 0.3])
    s.observe(7, np.array([5, 3]), np.array([0.5, 0.4]))
    ids, p = s.entry(s.slot_of(7))
    # (0.6 + 0.4) / 2 = 0.5 for 3; 0.25 for 5; 0.15 for 4 drops (width 2)
    assert list(ids) == [3, 5] and p == pytest.approx([0.5, 0.25])
    assert s.weight[s.slot_of(7)] == 2


def test_weight_caps_so_entries_keep_adapting():
    s = NgramStore(width=1, capacity=16, history=2)
    for _ in range(10):
        s.observe(1, np.array([3]), np.array([1.0]))
    s.observe(1, np.array([4]), np.array([1.0]))
    ids, p = s.entry(s.slot_of(1))
    assert list(ids) == [3] and p[0] == pytest.approx(2 / 3)


def test_prompt_seeds_never_overwrite_the_target_and_are_replaced_by_it():
    s = NgramStore(width=2, capacity=16, history=4)
    s.seed(1, 9, 0.5)
    assert list(s.entry(s.slot_of(1))[0]) == [9]
    s.observe(1, np.array([3, 4]), np.array([0.7, 0.2]))
    ids, p = s.entry(s.slot_of(1))
    assert list(ids) == [3, 4] and p == pytest.approx([0.7, 0.2])  # seed gone
    s.seed(1, 9, 0.5)
    assert list(s.entry(s.slot_of(1))[0]) == [3, 4]


def test_lru_eviction_keeps_entries_bounded():
    s = NgramStore(width=1, capacity=4, history=4, initial=2)
    for key in range(4):
        s.observe(key, np.array([key]), np.array([1.0]))
    assert len(s) == 4 and s.evicted == 0
    s.touch(0)  # 0 was used recently: 1 is now the oldest
    assert s.lru_keys() == [1, 2, 3, 0]
    s.observe(99, np.array([5]), np.array([1.0]))
    assert len(s) == 4 and s.evicted == 1
    assert 1 not in s and 0 in s and 99 in s
    assert len(s.weight) == 4  # never grows past capacity


def test_find_prefers_the_longest_context():
    s = NgramStore(width=1, capacity=16, history=4)
    k1, k2 = context_keys([5, 6], 2)
    s.observe(k1, np.array([1]), np.array([0.9]))
    s.observe(k2, np.array([2]), np.array([0.9]))
    slot, order = s.find([5, 6], 2)
    assert s.entry(slot)[0][0] == 2 and order == 2
    slot, order = s.find([4, 6], 2)
    assert s.entry(slot)[0][0] == 1 and order == 1
    assert s.find([4, 7], 2) == (-1, 0)



class _DictStore:
    """The store as plain Python, an OrderedDict in LRU order (the shape the
    numba store replaced): the reference it must match entry for entry."""

    def __init__(self, width, capacity, history):
        self.width, self.capacity, self.history = width, capacity, float(history)
        self.entries = OrderedDict()  # key -> [ids, probs (float32 values), weight]

    def _entry(self, key):
        if key in self.entries:
            self.entries.move_to_end(key)
        else:
            if len(self.entries) >= self.capacity:
                self.entries.popitem(last=False)
            self.entries[key] = [[], [], 0.0]
        return self.entries[key]

    def observe(self, key, ids, probs):
        e = self._entry(key)
        w = e[2]
        if w == 0.0:
            merged = {int(t): float(p) for t, p in zip(ids, probs) if p > 0.0}
        else:
            merged = {t: w / (w + 1.0) * p for t, p in zip(e[0], e[1])}
            for t, p in zip(ids.tolist(), probs.tolist()):
                if p > 0.0:
                    merged[t] = merged.get(t, 0.0) + 1.0 / (w + 1.0) * p
        top = sorted(merged.items(), key=lambda kv: -kv[1])[:self.width]
        e[0] = [t for t, _ in top]
        e[1] = [float(np.float32(p)) for _, p in top]
        e[2] = float(np.float32(min(w + 1.0, self.history)))

    def seed(self, key, token, prob):
        if key in self.entries and self.entries[key][2] > 0.0:
            return
        e = self._entry(key)
        e[0], e[1] = [token], [float(np.float32(prob))]

    def find(self, seq, max_order):
        keys = context_keys(seq, max_order)
        for order in range(len(keys), 0, -1):
            if keys[order - 1] in self.entries:
                self.entries.move_to_end(keys[order - 1])
                return self.entries[keys[order - 1]], order
        return None, 0


def _same_store(s, ref):
    assert s.lru_keys() == list(ref.entries)
    for key, (ids, probs, weight) in ref.entries.items():
        got_ids, got_p = s.entry(s.slot_of(key))
        assert got_ids.tolist() == ids and got_p.tolist() == probs
        assert float(s.weight[s.slot_of(key)]) == weight


@pytest.mark.parametrize("seed", range(4))
def test_numba_store_matches_the_dict_store(seed):
    """Seeds, observations of verified rows, lookups and evictions in random
    order, with arrays that grow and a capacity that evicts: the same
    entries, probabilities and LRU order as the plain store."""
    rng = np.random.default_rng(seed)
    width, order, capacity = int(rng.integers(1, 5)), int(rng.integers(1, 4)), 60
    s, ref = NgramStore(width, capacity, history=3, initial=4), _DictStore(width, capacity, 3)
    for _ in range(60):
        seq = rng.integers(0, 6, int(rng.integers(2, 12)))  # few symbols: keys repeat
        op = rng.integers(4)
        if op == 0:
            s.seed_tokens(seq, order, 0.5)
            for end in range(1, len(seq)):
                for key in context_keys(seq[max(0, end - order):end], order):
                    ref.seed(key, int(seq[end]), 0.5)
        elif op == 1:
            head = int(rng.integers(1, len(seq) + 1))
            rows = len(seq) - head + 1
            ids = rng.integers(0, 8, (rows, int(rng.integers(1, 6))))
            probs = rng.dirichlet(np.ones(ids.shape[1]), rows) * (rng.random((rows, 1)) < 0.9)
            s.observe_rows(seq, head, ids, probs, order)
            for j in range(rows):
                tail = seq[max(0, head + j - order):head + j]
                for key in context_keys(tail, order):
                    ref.observe(key, ids[j], probs[j])
        elif op == 2:
            slot, o = s.find(seq, order)
            entry, want_o = ref.find(seq, order)
            assert o == want_o
            assert (slot < 0) == (entry is None)
        else:
            n = int(rng.integers(0, 5))
            s.evict_lru(n)
            for _ in range(min(n, len(ref.entries))):
                ref.entries.popitem(last=False)
        _same_store(s, ref)
        assert len(s) == len(ref.entries) <= capacity


def _plain_greedy_chain(ref, calibration, tail, length, max_order, calibrate, threshold):
    """StandProposer.chain at temperature 0 as the plain Python loop was."""
    seq, out, confs, kinds, running = [int(x) for x in tail], [], [], [], 1.0
    for _ in range(length):
        entry, order = ref.find(seq, max_order)
        if entry is None or not entry[0]:
            break
        score = float(entry[1][0])
        kind = calibration.kind(False, order, entry[2] == 0.0)
        c = calibration.confidence(kind, score) if calibrate else score
        if running * c < threshold:
            break
        running *= c
        out.append(entry[0][0])
        confs.append(c)
        kinds.append((kind, score))
        seq.append(entry[0][0])
    return out, np.asarray(confs, np.float32), kinds


@pytest.mark.parametrize("calibrate", [True, False])
def test_greedy_chain_matches_the_plain_walk(calibrate):
    rng = np.random.default_rng(int(calibrate))
    max_order = 3
    p = proposer(max_order=max_order, calibrate=calibrate, min_path_prob=0.05)
    cal = p.calibration
    cal.accepted[:] = rng.random(len(cal.accepted)) * 20
    cal.trials[:] = cal.accepted + rng.random(len(cal.accepted)) * 20
    cal.score_sum[:] = cal.trials * rng.random(len(cal.accepted))
    cal.trials[::4], cal.accepted[::4] = 1.0, 0.5  # the edge of the scaling rule
    cal.score_sum[1::4] = 0.0
    s, ref = NgramStore(4, 500, history=4, initial=8), _DictStore(4, 500, 4)
    text = rng.integers(0, 7, 400)
    s.seed_tokens(text[:100], max_order, 0.5)
    for end in range(1, 100):
        for key in context_keys(text[max(0, end - max_order):end], max_order):
            ref.seed(key, int(text[end]), 0.5)
    for start in range(100, 390, 5):
        ids = rng.integers(0, 7, (5, 4))
        probs = np.sort(rng.dirichlet(np.ones(4) * 0.3, 5), axis=1)[:, ::-1]
        s.observe_rows(text[:start + 4], start, ids, probs, max_order)
        for j in range(5):
            for key in context_keys(text[max(0, start + j - max_order):start + j], max_order):
                ref.observe(key, ids[j], probs[j])
    walked = 0
    for _ in range(200):
        tail = rng.integers(0, 7, max_order)
        length = int(rng.integers(1, 9))
        got = p._greedy_chain(s, tail, length)
        want = _plain_greedy_chain(ref, cal, tail, length, max_order, calibrate, 0.05)
        assert got[0] == want[0] and got[1] is None
        assert got[2].tolist() == want[1].tolist() and got[3] == want[2]
        walked += len(want[0])
    _same_store(s, ref)  # lookups moved the same entries to the LRU end
    assert walked > 100


def test_continue_draft_walks_on_from_the_prefix_and_changes_nothing():
    p = proposer(min_path_prob=0.01, max_order=2)
    greedy_history(p)  # request "a": ... 3 -> 4 (0.9), 4 -> 5 (0.8)
    r = req("a", [1, 2, 3, 4, 5], [5], verified=[4], topk=[[(5, 0.8)]], num_prompt=3)
    store = next(iter(p.stores.values()))
    before = (store.lru_keys(), dict(p.lookups), dict(p.drafted))
    got = p.continue_draft(r, [2, 3], 4)  # as if the draft began 2, 3
    assert got.dtype == np.int64 and got.tolist()[:2] == [4, 5]
    want = p._greedy_chain(store, [2, 3], 4, counted=False)[0]
    assert got.tolist() == want
    assert (store.lru_keys(), dict(p.lookups), dict(p.drafted)) == before
    assert p.continue_draft(r, [2, 3], 0).tolist() == []
    assert p.continue_draft(req("new", [1, 2], [2]), [], 3).tolist() == []  # no store yet


