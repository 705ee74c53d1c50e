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


def verified_rows(cu_num_logits: torch.Tensor, num_sampled: torch.Tensor,
                  cols: torch.Tensor, num_rows: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(``[R, N, O]`` int64 indices of each request's logits rows, row j at
    ``[:, j, :]`` for each of ``cols`` ([1, N, O], row j: j) O columns,
    clamped into the step's ``num_rows`` rows; ``[R]`` how many are the
    request's and verified: 0 for a prefill chunk that sampled nothing;
    ``[R]`` how far the request's history moves on: the tokens it
    committed where it verified any, else 0)."""
    r = cu_num_logits.shape[0] - 1
    rows = (cu_num_logits[:-1].view(r, 1, 1) + cols).clamp_(max=max(num_rows - 1, 0))
    count = cu_num_logits.diff()
    return rows, count * (num_sampled > 0), num_sampled * (count > 0)


def _rows_cols(n: int, o: int, device) -> torch.Tensor:
    """``verified_rows``' ``cols``: row j at [0, j, :], for each of the
    tables' o context orders (built once per shape: each call costs more
    than its work)."""
    with torch.inference_mode(False):
        return torch.arange(n, device=device).view(1, n, 1).expand(1, n, o).contiguous()


class DeviceRecyclingDrafter(DeviceDrafter):
    """The device route over ``DeviceRecyclingTables``."""

    def __init__(self, tables: DeviceRecyclingTables, seed_from_prompt: bool):
        self.tables = tables
        self.seed_from_prompt = seed_from_prompt

    def device_step(self, step: DeviceStep) -> torch.Tensor:
        t = self.tables
        if step.new_slots is not None:
            # The prefill's end is each new slot's history; its tokens seed
            # the tables (entries the target has not filled).
            t.seed(step.new_slots, step.new_tokens, step.new_lengths, self.seed_from_prompt)
        n = step.num_tokens + 1
        cols = t.per_shape(("rows", n), lambda: _rows_cols(n, t.order, t.device))
        rows, num_verified, shift = verified_rows(step.cu_num_logits, step.num_sampled, cols,
                                                  step.verified_inputs.shape[0])
        return t.learn_and_draft(
            step.slots, step.verified_inputs.take(rows.select(2, 0)), step.top1_ids.take(rows),
            step.top1_logprobs.take(rows), num_verified, shift, step.last_tokens,
            step.num_tokens)
