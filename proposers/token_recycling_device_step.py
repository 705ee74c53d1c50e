"""Token Recycling's step on the device route (``DeviceDrafter``): the
verified rows' top-1 into the tables, then each request's chain, as tensor
ops with no read back to the host (``vllm_plugins.drafter``).

Where a chain stops (the tables know nothing, or its estimated acceptance
falls below ``min_confidence``) the row is padded with the request's newest
token: the runner verifies k tokens a request either way, and any token is
an exact draft.
"""

from __future__ import annotations

import torch

from vllm_plugins.drafter import DeviceDrafter, DeviceStep
from vllm_plugins.proposers.token_recycling_device import DeviceRecyclingTables
from vllm_plugins.proposers.token_recycling_device_compiled import compiled_seed, compiled_step


def verified_rows(cu_num_logits: torch.Tensor, num_sampled: torch.Tensor,
                  cols: torch.Tensor, num_rows: int, out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[N, O, R]`` int64 indices of each request's logits rows, requests
    last, row j at ``[j, :, r]`` (``cols`` [N, O, 1]: j), clamped into the
    step's ``num_rows`` rows (written into ``out`` where given); ``[N, O,
    R]`` bool: the row is the request's and verified (none of a prefill
    chunk that sampled nothing)). The row's index, before the clamp, is
    below the request's end where it is the request's: one comparison, no
    per-request count."""
    rows = torch.add(cu_num_logits[:-1], cols, out=out)
    valid = rows < cu_num_logits[1:] * (num_sampled > 0)
    return rows.clamp_(max=max(num_rows - 1, 0)), valid


class _Rows:
    """``verified_rows``' constants and buffer for r requests, n rows each
    and the tables' o context orders, built once per shape (each call
    costs more than its work): ``first`` is row j's index once."""

    def __init__(self, r: int, n: int, o: int, device):
        with torch.inference_mode(False):
            self.cols = torch.arange(n, device=device).view(n, 1, 1).expand(n, o, 1).contiguous()
            self.rows = torch.zeros(n, o, r, dtype=torch.int64, device=device)
        self.first = self.rows[:, 0]


class DeviceRecyclingDrafter(DeviceDrafter):
    """The device route over ``DeviceRecyclingTables``."""

    def __init__(self, tables: DeviceRecyclingTables, seed_from_prompt: bool):
        self.tables = tables
        self.seed_from_prompt = seed_from_prompt

    def device_step(self, step: DeviceStep) -> torch.Tensor:
        t = self.tables
        # The prefill's end is each new slot's history; its tokens seed the
        # tables (entries the target has not filled).
        new = step.new_slots is not None
        if t.compiled:
            if new:
                compiled_seed(t, step.new_slots, step.new_tokens, step.new_lengths,
                              self.seed_from_prompt)
            return compiled_step(t, step)
        if new:
            t.seed(step.new_slots, step.new_tokens, step.new_lengths, self.seed_from_prompt)
        r, n = step.slots.shape[0], step.num_tokens + 1
        c = t.per_shape(("rows", r, n), lambda: _Rows(r, n, t.order, t.device))
        rows, valid = verified_rows(step.cu_num_logits, step.num_sampled, c.cols,
                                    step.logits_indices.shape[0], out=c.rows)
        # A request samples at most one token a logits row: its history
        # moves on by num_sampled, 0 where it verified nothing.
        return t.learn_and_draft(
            step.slots, step.input_ids.index_select(0, step.logits_indices).take(c.first),
            step.top1_ids.take(rows), step.top1_logprobs.take(rows), valid, step.num_sampled,
            step.last_sampled.take(step.slots), step.num_tokens)
