"""Token Recycling's device route (``DeviceRecyclingDrafter.device_step``,
what V2 calls with ``"tables": "device"``) reads nothing back to the host:
it runs unchanged on meta tensors (any read of a value would raise), its
shapes follow the batch size and k only, and on CPU tensors it learns what
a verified row says and drafts it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_plugins.drafter import DeviceStep
from vllm_plugins.proposers.token_recycling_device_step import DeviceRecyclingDrafter, verified_rows
from vllm_plugins.proposers.token_recycling_device import DeviceRecyclingTables

VOCAB, K = 64, 3


def device_step(tables, slots, cu, inputs, top1, lps, sampled, last, k, new=None):
    """The step as V2 hands it: the rows' inputs among the step's input ids
    (here after two padding tokens), the newest tokens by state row."""
    dev = inputs.device
    input_ids = torch.cat((torch.zeros(2, dtype=inputs.dtype, device=dev), inputs))
    positions = torch.arange(2, 2 + inputs.shape[0], device=dev)
    last_sampled = torch.zeros(8, 1, dtype=torch.int64, device=dev)
    last_sampled[slots, 0] = last
    step = DeviceStep(slots, cu, input_ids, positions, top1, lps, sampled, last_sampled, k)
    if new is not None:
        step.new_slots, step.new_tokens, step.new_lengths = new
    return DeviceRecyclingDrafter(tables, seed_from_prompt=True).device_step(step)


def step_inputs(device, num_reqs):
    # Request 0 verified its k drafts plus the bonus row; request 1 is a
    # prefill's last row; request 2 a prefill chunk that sampled nothing.
    counts = [K + 1, 1, 1][:num_reqs]
    cu = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32)
    rows = int(cu[-1])
    inputs = torch.arange(rows, dtype=torch.int64) + 5
    top1 = ((inputs + 1) % VOCAB).view(rows, 1)
    lps = torch.full((rows, 1), -0.1)
    sampled = torch.tensor([2, 1, 0][:num_reqs], dtype=torch.int32)
    last = torch.tensor([7, 9, 11][:num_reqs], dtype=torch.int64)
    slots = torch.tensor([4, 0, 2][:num_reqs], dtype=torch.int64)
    return [t.to(device) for t in (slots, cu, inputs, top1, lps, sampled, last)]


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_the_step_runs_on_tensors_that_cannot_be_read_back(num_reqs):
    tables = DeviceRecyclingTables(VOCAB, 3, 256, 8, 0.02, "meta")
    new = (torch.tensor([4], device="meta"), torch.zeros(1, 6, dtype=torch.int64,
                                                           device="meta"),
           torch.tensor([6], device="meta"))
    drafts = device_step(tables, *step_inputs("meta", num_reqs), K, new=new)
    assert drafts.device.type == "meta"
    assert drafts.shape == (num_reqs, K) and drafts.dtype == torch.int64


def test_the_step_learns_the_verified_rows_and_drafts_them():
    tables = DeviceRecyclingTables(VOCAB, 1, 256, 8, 0.02, "cpu")
    slots, cu, inputs, top1, lps, sampled, last = step_inputs("cpu", 3)
    drafts = device_step(tables, slots, cu, inputs, top1, lps, sampled, last, K)
    # Every input row of the two requests that sampled was learned: its
    # top-1 is the next token, so a chain from 7 walks 8, 9, 10 ...
    assert tables.next_token(torch.tensor([5, 6, 7, 8, 9])).tolist() == [6, 7, 8, 9, 10]
    # ... and the chunk's row (input 10) was not.
    assert tables.next_token(torch.tensor([10])).tolist() == [-1]
    assert drafts[0].tolist() == [8, 9, 10]
    # Where the tables know nothing the row is padded with the last token.
    assert drafts[2].tolist() == [11, 11, 11]


def test_rows_past_a_request_are_clamped_and_not_counted():
    cu = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    cols = torch.arange(4).view(4, 1, 1).expand(4, 2, 1)
    rows, valid = verified_rows(cu, torch.tensor([3, 0, 1], dtype=torch.int32), cols, 7)
    # Requests last, each row once per context order.
    assert rows.shape == valid.shape == (4, 2, 3)
    assert rows[:, 0].t().tolist() == [[0, 1, 2, 3], [4, 5, 6, 6], [5, 6, 6, 6]]
    assert torch.equal(rows[:, 0], rows[:, 1])
    # Every row of a request that sampled, up to its end; none of a chunk
    # that sampled nothing.
    assert valid[:, 0].t().tolist() == [[True] * 4, [False] * 4, [True, True, False, False]]
    assert torch.equal(valid[:, 0], valid[:, 1])


def test_the_v2_speculator_reads_nothing_back_either():
    """``DeviceSpeculator.draft`` (the step's inputs from V2's input batch,
    then the drafter) on meta tensors shaped as V2's: int32 input ids and
    logits offsets, int64 state rows and last sampled tokens."""
    from types import SimpleNamespace

    from vllm_plugins.bridge.v2.device_speculator import DeviceSpeculator

    tables = DeviceRecyclingTables(VOCAB, 3, 256, 8, 0.02, "meta")
    proposer = SimpleNamespace(controller=None, device_drafter=lambda: DeviceRecyclingDrafter(
        tables, seed_from_prompt=True))
    config = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=K),
                             scheduler_config=SimpleNamespace(max_num_seqs=8))
    spec = DeviceSpeculator(config, torch.device("meta"), None, proposer)
    slots, cu, inputs, top1, lps, sampled, last = step_inputs("meta", 3)
    spec._seeded = {4: "a", 0: "b", 2: "c"}  # no request is new
    batch = SimpleNamespace(idx_mapping=slots, idx_mapping_np=np.array([4, 0, 2], np.intp),
                            req_ids=["a", "b", "c"],
                            cu_num_logits=cu, input_ids=inputs.int(),
                            logits_indices=torch.arange(inputs.shape[0], dtype=torch.int32,
                                                        device="meta"))
    spec.observe_logits(torch.zeros(inputs.shape[0], VOCAB, device="meta"), batch)
    drafts = spec.draft(batch, 3, sampled, torch.zeros(8, 1, dtype=torch.int64, device="meta"), K)
    assert drafts.device.type == "meta"
    assert drafts.shape == (3, K) and drafts.dtype == torch.int64


def test_the_v2_speculator_seeds_requests_new_to_their_row():
    """A request is new where its state row last held another request (or
    none): its prompt's end becomes the row's history, once."""
    from types import SimpleNamespace

    from vllm_plugins.bridge.v2.device_speculator import DeviceSpeculator
    from vllm_plugins.drafter import DeviceStep as Step

    spec = DeviceSpeculator.__new__(DeviceSpeculator)
    spec.device = torch.device("cpu")
    spec._seeded = {4: "a", 0: "old"}
    spec._last_req_ids = None
    tokens = torch.arange(40, dtype=torch.int32).view(5, 8)
    spec.req_states = SimpleNamespace(prefill_len=SimpleNamespace(np=np.array([3, 0, 5, 0, 6])),
                                      all_token_ids=SimpleNamespace(gpu=tokens))
    batch = SimpleNamespace(idx_mapping_np=np.array([4, 0, 2], np.intp), req_ids=["a", "b", "c"])
    step = Step(*[None] * 8, num_tokens=K)
    spec._add_new_requests(step, batch, 3)
    assert step.new_slots.tolist() == [0, 2]
    assert step.new_lengths.tolist() == [3, 5]
    assert step.new_tokens.dtype == torch.int64
    assert step.new_tokens.tolist() == [[0, 1, 2, 3, 4], [16, 17, 18, 19, 20]]
    assert spec._seeded == {4: "a", 0: "b", 2: "c"}
    again = Step(*[None] * 8, num_tokens=K)
    spec._add_new_requests(again, batch, 3)
    assert again.new_slots is None
    # "b" finished and "d" took its row: only "d" is new.
    batch.req_ids = ["a", "d", "c"]
    later = Step(*[None] * 8, num_tokens=K)
    spec._add_new_requests(later, batch, 3)
    assert later.new_slots.tolist() == [0]


def test_v2_copies_a_steps_drafts_before_its_next_step():
    """The compiled step returns a buffer it reuses for the next step of its
    shape (``DeviceDrafter.device_step``): V2 copies the drafts into its
    request states right after ``propose``."""
    import inspect

    from vllm.v1.worker.gpu import model_runner

    source = inspect.getsource(model_runner.GPUModelRunner)
    after = source.split("draft_tokens = self.speculator.propose(", 1)[1]
    copy = "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens"
    assert copy in after.split("def ", 1)[0]
