"""Token Recycling's device tables: the host chain's drafts, and no host read."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_plugins.proposers.token_recycling import TokenRecyclingProposer
from vllm_plugins.proposers.token_recycling_device import (DeviceRecyclingTables,
                                                           context_key)
from vllm_plugins.step_context import RequestStep, StepContext

V = 64


class MarkovTarget:
    """A target over V tokens whose next token depends on the last two (few
    distinct pairs, so contexts repeat and the context tables matter)."""

    def __init__(self, seed: int, k: int):
        rng = np.random.default_rng(seed)
        self.k = k
        self.logits = rng.normal(0, 2.5, (8, 8, V)).astype(np.float32)
        self.logits[:, :, 8:] -= 6  # most mass on the first 8 tokens

    def topk(self, seq: np.ndarray):
        """Top-k ids and log-probabilities after each prefix of ``seq``."""
        rows = self.logits[np.r_[seq[0], seq[:-1]] % 8, seq % 8]
        lp = rows - np.log(np.exp(rows).sum(1, keepdims=True))
        ids = np.argsort(-lp, 1, kind="stable")[:, :self.k]
        return ids.astype(np.int64), np.take_along_axis(lp, ids, 1).astype(np.float32)


def _proposer(tables: str, **opts):
    return TokenRecyclingProposer(None, {"draft_length": "fixed", "topk": 4,
                                         "tables": tables, **opts}, vocab_size=V)


def _run_side_by_side(opts, steps=40, batch=5, seed=0, rest_every=0):
    """Host and device proposers on the same steps of greedy requests that
    start, finish and are replaced; every step's drafts are compared."""
    host, dev = _proposer("host", **opts), _proposer("device", **opts)
    target = MarkovTarget(seed, 4)
    rng = np.random.default_rng(seed + 1)
    live: dict[str, dict] = {}
    prev_drafts: dict[str, list[int]] = {}
    finished: set[str] = set()
    drafted = 0
    serial = 0
    for step_no in range(steps):
        while len(live) < batch:
            prompt = rng.integers(0, 12, int(rng.integers(1, 12)))
            live[f"r{serial}"] = {"context": prompt, "prompt": len(prompt), "fresh": True}
            serial += 1
        reqs = []
        for rid, st in live.items():
            ctx = st["context"]
            if st["fresh"]:  # prefill done: the first token
                verified = ctx[-1:]
                ids, lps = target.topk(ctx)
                accepted = ids[-1:, 0]
                st["fresh"] = False
                ids, lps = ids[-1:], lps[-1:]
            else:
                drafts = np.array(prev_drafts.get(rid, []), np.int64)
                verified = np.r_[ctx[-1:], drafts]
                ids, lps = target.topk(np.r_[ctx, drafts])
                ids, lps = ids[-len(verified):], lps[-len(verified):]
                a = 0
                while a < len(drafts) and drafts[a] == ids[a, 0]:
                    a += 1
                accepted = np.r_[drafts[:a], ids[a, 0]]
            new_ctx = np.r_[ctx, accepted].astype(np.int64)
            st["context"] = new_ctx
            reqs.append(RequestStep(
                req_id=rid, accepted=accepted, context=new_ctx,
                num_prompt_tokens=st["prompt"], num_draft=len(verified) - 1,
                verified_tokens=verified.astype(np.int64),
                topk_ids=ids, topk_logprobs=lps, temperature=0.0))
        rest = rest_every and step_no % rest_every == rest_every - 1
        ctx = StepContext(reqs, finished=finished, max_draft=5)
        if rest:  # a step neither proposer sees (a resting policy)
            prev_drafts = {}
        else:
            a, b = host.step(ctx), dev.step(ctx)
            assert a.tokens == b.tokens, step_no
            for ca, cb in zip(a.confidence, b.confidence):
                np.testing.assert_allclose(ca, cb, rtol=1e-6)
            prev_drafts = {r.req_id: t for r, t in zip(reqs, a.tokens)}
            drafted += sum(map(len, a.tokens))
        finished = set()
        for rid in list(live):
            if rng.random() < 0.08:
                finished.add(rid)
                del live[rid]
    return drafted, dev


@pytest.mark.parametrize("opts", [
    {"context_order": 3},
    {"context_order": 1},
    {"context_order": 4, "seed_from_prompt": False, "min_confidence": 0.2},
    {"context_order": 2, "min_confidence": 0.0},
], ids=["order3", "matrix-only", "order4-unseeded", "order2-no-stop"])
def test_device_chains_are_the_host_chains(opts):
    drafted, _ = _run_side_by_side(opts)
    assert drafted > 100


def test_device_history_catches_up_after_steps_it_did_not_see():
    drafted, dev = _run_side_by_side({"context_order": 3}, rest_every=4, seed=3)
    assert drafted > 50


def test_slots_are_reused_and_grow_past_the_start():
    p = _proposer("device")
    p.device_chains.tables.resize_slots(2)
    p.device_chains._free = [1, 0]
    _run = [RequestStep(req_id=f"q{i}", accepted=np.array([3]), context=np.array([1, 2, 3]),
                        num_prompt_tokens=2, num_draft=0, verified_tokens=np.array([2]),
                        topk_ids=np.array([[3, 0, 0, 0]]),
                        topk_logprobs=np.zeros((1, 4), np.float32), temperature=0.0)
            for i in range(5)]
    p.step(StepContext(_run, max_draft=3))
    assert p.device_chains.tables.max_slots >= 5
    assert sorted(p.device_chains._slot.values()) == list(range(5))
    p.step(StepContext([], finished={"q0", "q3"}, max_draft=3))
    assert "q0" not in p.device_chains._slot
    assert len(p.device_chains._free) == p.device_chains.tables.max_slots - 3


def test_a_step_that_gives_every_request_no_draft_drafts_nothing():
    """The controller may give every request of a step length 0: the walk is
    then zero tokens wide."""
    p = _proposer("device")
    req = RequestStep(req_id="q", accepted=np.array([3]), context=np.array([1, 2, 3]),
                      num_prompt_tokens=2, num_draft=0, verified_tokens=np.array([2]),
                      topk_ids=np.array([[3, 0, 0, 0]]),
                      topk_logprobs=np.zeros((1, 4), np.float32), temperature=0.0)
    p.step(StepContext([req], max_draft=3))
    tokens, conf = [None], [None]
    p.device_chains.draft([(0, req, 0)], tokens, conf)
    assert tokens == [[]] and len(conf[0]) == 0


def test_device_tables_refuse_what_they_do_not_do():
    with pytest.raises(ValueError, match="tables.*draft_shape='tree'"):
        _proposer("device", draft_shape="tree")
    with pytest.raises(ValueError, match="save_path='x'"):
        _proposer("device", save_path="x")


def test_continue_draft_from_device_tables_matches_host():
    host, dev = _proposer("host"), _proposer("device")
    target = MarkovTarget(7, 4)
    seq = np.random.default_rng(2).integers(0, 8, 58)
    ids, lps = target.topk(seq)
    # After a 40-token prompt, one step verified 17 drafts, all accepted.
    r = RequestStep(req_id="a", accepted=seq[40:], context=seq, num_prompt_tokens=40,
                    num_draft=17, verified_tokens=seq[39:57], topk_ids=ids[39:57],
                    topk_logprobs=lps[39:57], temperature=0.0)
    for p in (host, dev):
        p.step(StepContext([r], max_draft=4))
    for prefix in ([], [3], [3, 5, 1]):
        got = dev.continue_draft(r, prefix, 6)
        assert got.dtype == np.int64
        assert got.tolist() == host.continue_draft(r, prefix, 6).tolist()


# ------------------------------------------------------------ the tensor core
def _tables(device="cpu", order=3, slots=1024, max_slots=8):
    return DeviceRecyclingTables(V, order, slots, max_slots, 0.02, device)


def _step_inputs(r, n, k=4, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    verified = torch.randint(0, V, (r, n), generator=g)
    ids = torch.randint(0, V, (r, n, k), generator=g)
    lps = torch.log(torch.rand(r, n, k, generator=g)).sort(2, descending=True).values
    nv = torch.randint(0, n + 1, (r,), generator=g)
    na = torch.clamp(nv - 1, min=0) // 2
    slots = torch.arange(r) % 8
    return [t.to(device) for t in (slots, verified, ids, lps, nv, na)]


def test_keys_are_the_polynomial_of_the_context():
    t = _tables()
    window = torch.tensor([[5, 6, 7], [-1, 6, 7], [-1, -1, 7]])
    keys = ((window + 1).flip(1) * t.powers).cumsum(1)
    assert keys[0].tolist() == [context_key([7]), context_key([6, 7]),
                                context_key([5, 6, 7])]
    # A token the request does not have adds nothing: the shorter context.
    assert keys[1, 2] == keys[1, 1] and keys[2].tolist() == [context_key([7])] * 3


def test_rows_past_num_verified_write_nowhere():
    t = _tables()
    before = {n: getattr(t, n).clone() for n in ("key", "tok1", "lp", "hist1")}
    slots, verified, ids, lps, nv, na = _step_inputs(4, 3)
    t.learn(slots, verified, ids, lps, torch.zeros(4, dtype=torch.int64),
            torch.zeros(4, dtype=torch.int64))
    for n, b in before.items():  # everything but the trash entries
        assert torch.equal(getattr(t, n)[:-1], b[:-1]), n
    assert (t.winner == -1).all()
    t.learn(slots, verified, ids, lps, nv, na)
    assert not torch.equal(t.tok1[:-1], before["tok1"][:-1])
    assert (t.winner == -1).all()


def test_the_last_of_several_rows_for_one_token_wins():
    t = _tables(order=1)
    verified = torch.tensor([[5, 5], [5, 9]])
    ids = torch.tensor([[[1], [2]], [[3], [4]]]).expand(2, 2, 4).contiguous()
    lps = torch.zeros(2, 2, 4)
    t.learn(torch.tensor([0, 1]), verified, ids, lps, torch.tensor([2, 1]),
            torch.tensor([1, 0]))
    # Rows in order (request, row): token 5's last valid row is (1, 0);
    # token 9's only row is past request 1's count.
    assert t.next_token(torch.tensor([5, 9])).tolist() == [3, -1]
    assert t.key[t.slots + 5] == 6


@pytest.mark.parametrize("order", [1, 3])
def test_learn_seed_and_propose_run_on_tensors_that_cannot_be_read(order):
    """Meta tensors hold no values: the first host read (``.item()``,
    ``.tolist()``, a branch on a value, a boolean mask, ``nonzero``) raises.
    The outputs' shapes depend on the batch size and draft length only."""
    t = _tables("meta", order=order)
    for r in (1, 3, 8):
        slots, verified, ids, lps, nv, na = _step_inputs(r, 4, device="meta")
        t.seed(slots, verified, torch.full((r,), 3, device="meta"))
        t.learn(slots, verified, ids, lps, nv, na)
        drafts, conf = t.propose(slots, verified[:, 0], 5)
        assert drafts.device.type == "meta" and drafts.shape == (r, 5)
        assert drafts.dtype == torch.int64
        assert conf.shape == (r, 5) and conf.dtype == torch.float32
    with pytest.raises(Exception):  # the meta device does catch a host read
        drafts.sum().item()


def test_propose_pads_with_minus_one_where_confidence_falls():
    t = _tables(order=1)
    chain = torch.tensor([[1, 2, 3, 4]])  # 1 -> 2 -> 3 -> 4, probabilities below
    probs = torch.tensor([0.9, 0.5, 0.04, 1.0])
    ids = torch.zeros(1, 4, 4, dtype=torch.int64)
    ids[0, :, 0] = torch.tensor([2, 3, 4, 5])
    lps = torch.full((1, 4, 4), -30.0)
    lps[0, :, 0] = probs.log()
    t.learn(torch.tensor([0]), chain, ids, lps, torch.tensor([4]), torch.tensor([3]))
    drafts, conf = t.propose(torch.tensor([0, 1]), torch.tensor([1, 7]), 4)
    # 0.9 * 0.5 * 0.04 = 0.018 < 0.02: the chain stops after two tokens.
    assert drafts.tolist() == [[2, 3, -1, -1], [-1, -1, -1, -1]]
    assert conf[0, :2].tolist() == pytest.approx([0.9, 0.5]) and conf[:, 2:].eq(0).all()


def test_the_device_check_runs_on_cpu_tensors_without_vllm(tmp_path):
    """``python -m vllm_plugins.bench tr-device`` at small sizes on the CPU
    (no graph, no sync mode there), in a process that never imports vLLM."""
    out = tmp_path / "tr.json"
    argv = ["tr-device", "--device", "cpu", "--batch-sizes", "1,3", "--steps", "3",
            "--vocab", "512", "--context-slots", "4096", "--out", str(out)]
    code = ("import sys\nfrom vllm_plugins.bench.__main__ import main\n"
            f"assert main({argv!r}) == 0\n"
            "assert not [m for m in sys.modules if m.split('.')[0] == 'vllm'], 'vllm'\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3]
    assert all(r["host_ms"] > 0 and r["topk_ms"] > 0 and "graph_ms" not in r for r in rows)
    # The device route's step: timed, and its torch calls do not grow with
    # the batch.
    assert all(r["route_ms"] > 0 and r["compiled_ms"] > 0 for r in rows)
    assert rows[0]["route_calls"] == rows[1]["route_calls"] > 0


def test_a_step_s_outputs_outlive_the_next_step_of_its_shape():
    """The walk's per-shape buffers are scratch: what propose returned is
    not overwritten by the next call, nor lost when shapes are let go."""
    t = _tables()
    t.SHAPES_KEPT = 2
    slots, verified, ids, lps, nv, na = _step_inputs(4, 3)
    t.learn(slots, verified, ids, lps, torch.full((4,), 3), torch.full((4,), 2))
    first = t.propose(slots, verified[:, 0], 4)
    kept = [x.clone() for x in first]
    t.propose(slots, verified[:, 1], 4)
    for r in (1, 2, 3):  # other shapes push this one out, then it is rebuilt
        t.propose(slots[:r], verified[:r, 0], 4)
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    again = t.propose(slots, verified[:, 0], 4)
    assert all(torch.equal(a, b) for a, b in zip(again, kept))
    assert len(t._shapes) <= 2
