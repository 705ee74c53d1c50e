"""The device route's compiled CPU step against its torch twin: on random
steps (requests in random slots, rows of every count, prefill chunks that
sampled nothing, colliding contexts, keys that wrap), the same tables, the
same histories and the same drafts, step after step, across a resize of
the history rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_plugins.drafter import DeviceStep
from vllm_plugins.proposers.token_recycling_device import DeviceRecyclingTables
from vllm_plugins.proposers.token_recycling_device_step import DeviceRecyclingDrafter

VOCAB, MAX_SLOTS = 50, 12


def _random_step(rng, k, ids_dtype, new_every):
    r = int(rng.integers(1, 9))
    slots = torch.tensor(rng.choice(MAX_SLOTS, r, replace=False), dtype=torch.int64)
    counts = rng.integers(1, k + 2, r)
    cu = torch.tensor(np.concatenate(([0], np.cumsum(counts))), dtype=torch.int32)
    rows = int(cu[-1])
    # Few distinct tokens: rows and contexts collide within a step.
    inputs = torch.tensor(rng.integers(0, 6, rows), dtype=ids_dtype)
    top1 = torch.tensor(rng.integers(0, 6, (rows, 1)), dtype=torch.int64)
    lps = torch.tensor(-rng.exponential(0.4, (rows, 1)), dtype=torch.float32)
    sampled = torch.tensor([int(rng.integers(0, c + 1)) for c in counts], dtype=torch.int32)
    # V2's layout: the rows' inputs at logits_indices among more input ids,
    # the newest tokens by state row.
    input_ids = torch.tensor(rng.integers(0, 6, rows + 5), dtype=ids_dtype)
    positions = torch.tensor(rng.permutation(rows + 5)[:rows], dtype=ids_dtype)
    input_ids[positions.long()] = inputs
    last_sampled = torch.tensor(rng.integers(0, 6, (MAX_SLOTS + 3, 1)), dtype=torch.int64)
    step = DeviceStep(slots, cu, input_ids, positions, top1, lps, sampled, last_sampled, k)
    if rng.random() < new_every:
        new = slots[:int(rng.integers(1, r + 1))]
        width = int(rng.integers(1, 9))
        step.new_slots = new
        step.new_tokens = torch.tensor(rng.integers(0, 8, (new.shape[0], width)))
        step.new_lengths = torch.tensor(rng.integers(1, width + 1, new.shape[0]))
    return step


@pytest.mark.parametrize("order,context_slots,min_confidence", [
    (1, 64, 0.02), (2, 16, 0.02), (3, 64, 0.3), (3, 7, 0.0), (5, 64, 0.02)])
@pytest.mark.parametrize("ids_dtype,seed_from_prompt", [(torch.int32, True), (torch.int64, True),
                                                       (torch.int64, False)])
def test_the_compiled_step_is_its_torch_twin(order, context_slots, min_confidence, ids_dtype,
                                             seed_from_prompt):
    rng = np.random.default_rng(order * 100 + context_slots)
    k = 4
    twin, compiled = (DeviceRecyclingTables(VOCAB, order, context_slots, MAX_SLOTS,
                                            min_confidence, "cpu", compiled=c)
                      for c in (False, True))
    assert compiled.compiled and not twin.compiled
    drafters = [DeviceRecyclingDrafter(t, seed_from_prompt) for t in (twin, compiled)]
    drafted = 0
    for i in range(60):
        if i == 30:  # new history rows: the compiled step must see them
            for t in (twin, compiled):
                t.resize_slots(MAX_SLOTS + 3)
        step = _random_step(rng, k, ids_dtype, new_every=0.3)
        want, got = (d.device_step(step) for d in drafters)
        assert got.dtype == torch.int64 and got.shape == want.shape
        assert torch.equal(got, want)
        # The tables but the trash entry (the twin's losing writes land
        # there; drafting never reads it), and every slot's history.
        assert torch.equal(compiled.kt[:-1], twin.kt[:-1])
        assert torch.equal(compiled.lp[:-1], twin.lp[:-1])
        assert torch.equal(compiled.hist1[:-1], twin.hist1[:-1])
        assert bool((compiled.winner == -1).all())  # the scratch is left clean
        drafted += int((got != step.last_sampled[step.slots]).sum())
    assert drafted > 50  # the chains drafted, not only padded


def test_keys_that_wrap_are_hashed_as_the_twin_hashes_them():
    """Order 5 keys pass 2**63 (PRIME**4 is about 1e24): the compiled step
    wraps as torch's int64 does, so a long context lands in the same
    entry and is found again."""
    twin, compiled = (DeviceRecyclingTables(60000, 5, 1 << 12, 2, 0.02, "cpu", compiled=c)
                      for c in (False, True))
    tokens = torch.tensor([59000, 58000, 57000, 56000, 55000, 54000], dtype=torch.int64)
    for t in (twin, compiled):
        step = DeviceStep(torch.tensor([0]), torch.tensor([0, 6], dtype=torch.int32), tokens,
                          torch.arange(6), torch.roll(tokens, -1).view(6, 1),
                          torch.full((6, 1), -0.01), torch.tensor([6], dtype=torch.int32),
                          torch.tensor([[53000], [0]]), 5)
        DeviceRecyclingDrafter(t, seed_from_prompt=False).device_step(step)
    assert (twin.kt[:-1, 0].abs() > 1 << 62).any()
    assert torch.equal(compiled.kt[:-1], twin.kt[:-1])


@pytest.mark.parametrize("order,context_slots,min_confidence", [
    (1, 64, 0.02), (2, 16, 0.02), (3, 64, 0.3), (3, 7, 0.0), (5, 64, 0.02)])
def test_v1s_compiled_learn_and_propose_are_their_torch_twins(order, context_slots,
                                                              min_confidence):
    """V1's route (``DeviceChains``) on CPU tables: ``compiled_learn`` and
    ``compiled_propose`` against the tables' ``learn`` and ``propose`` on
    random steps (requests that learn nothing, rows of every count, few
    distinct tokens), across a resize of the history rows: the same tables
    but the trash entry, histories, drafts and probabilities."""
    from vllm_plugins.proposers.token_recycling_device_compiled import (compiled_learn,
                                                                        compiled_propose)

    rng = np.random.default_rng(order * 10 + context_slots)
    twin, compiled = (DeviceRecyclingTables(VOCAB, order, context_slots, MAX_SLOTS,
                                            min_confidence, "cpu", compiled=c)
                      for c in (False, True))
    drafted = 0
    for i in range(60):
        if i == 30:
            for t in (twin, compiled):
                t.resize_slots(MAX_SLOTS + 3)
        r, n = int(rng.integers(1, 9)), int(rng.integers(1, 6))
        slots = rng.choice(MAX_SLOTS, r, replace=False).astype(np.int64)
        verified = rng.integers(0, 6, (r, n))
        ids = rng.integers(0, 6, (r, n))
        lps = (-rng.exponential(0.4, (r, n))).astype(np.float32)
        lens = rng.integers(0, n + 1, r)
        accepted = np.array([rng.integers(0, max(m, 1)) for m in lens], np.int64)
        twin.learn(*(torch.from_numpy(a) for a in (slots, verified, ids[:, :, None],
                                                   lps[:, :, None], lens, accepted)))
        compiled_learn(compiled, slots, verified, ids, lps, lens, accepted)
        assert torch.equal(compiled.kt[:-1], twin.kt[:-1])
        assert torch.equal(compiled.lp[:-1], twin.lp[:-1])
        assert torch.equal(compiled.hist1[:-1], twin.hist1[:-1])
        last, k = rng.integers(0, 6, r), int(rng.integers(0, 6))
        want = twin.propose(torch.from_numpy(slots), torch.from_numpy(last), k)
        got = compiled_propose(compiled, slots, last, k)
        assert got[0].dtype == np.int64 and got[1].dtype == np.float32
        assert np.array_equal(got[0], want[0].numpy())
        assert np.array_equal(got[1], want[1].numpy())
        drafted += int((got[0] >= 0).sum())
    assert drafted > 50
