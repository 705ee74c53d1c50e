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


def verified_rows(cu_num_logits: torch.Tensor, num_sampled: torch.Tensor, width: int,
                  num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(``[R, width]`` indices of each request's logits rows, clamped into
    the step's rows; ``[R]`` how many are the request's and verified: 0 for
    a prefill chunk that sampled nothing)."""
    start = cu_num_logits[:-1].to(torch.int64)
    count = cu_num_logits[1:].to(torch.int64) - start
    rows = start.unsqueeze(1) + torch.arange(width, device=start.device)
    rows = rows.clamp(max=max(num_rows - 1, 0))
    return rows, count * (num_sampled.to(torch.int64) > 0)


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
        k = step.num_tokens
        rows, num_verified = verified_rows(step.cu_num_logits, step.num_sampled, k + 1,
                                           step.verified_inputs.shape[0])
        num_accepted = (step.num_sampled.to(torch.int64) - 1).clamp(min=0)
        t.learn(step.slots, step.verified_inputs[rows], step.top1_ids[rows].unsqueeze(-1),
                step.top1_logprobs[rows].unsqueeze(-1), num_verified, num_accepted)
        drafts, _conf = t.propose(step.slots, step.last_tokens, k)
        return torch.where(drafts < 0, step.last_tokens.unsqueeze(1), drafts)
