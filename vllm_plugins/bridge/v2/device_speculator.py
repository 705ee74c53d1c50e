"""V2's drafter for the device route (``vllm_plugins.drafter.DeviceDrafter``):
a step that never waits for the host.

The host route (``speculator.PluginSpeculator``) reads the step back to
build a ``StepContext``. Here everything the step needs is already a tensor
where the logits live: the verified rows' top-1 (taken by the sampler tap),
the step's ``input_ids`` at ``logits_indices``, V2's ``num_sampled`` and
``last_sampled_tokens``, and the requests' state rows (``idx_mapping``, V2's
persistent index, is the drafter's slot). The host adds only what it
already knows: which requests are new to their row (request ids against
``idx_mapping_np``), with their tokens' length from ``RequestState``'s host
mirror of ``prefill_len``.

Draft length on this route is V2's k, every step; the worker's
draft-length controllers read host figures, so they do not run here. Under
the ``goodput`` policy the step asks the engine core to choose the next k
from what it already has (``step_k``, ``BatchStepK``), one step late.
Where the step's k is below the engine's (that choice, or vLLM's
``num_speculative_tokens_per_batch_size``), the whole row is drafted and V2
marks the entries past k -1 itself: the tables learn only the rows V2
verifies (``cu_num_logits``), so a draft V2 cut teaches nothing, and the
walk's length stays a static shape.
"""

from __future__ import annotations

import torch

from vllm_plugins.bridge.v2.drafter_base import V2Drafter
from vllm_plugins.drafter import DeviceStep
from vllm_plugins.proposers.draft_length import GoodputController
from vllm_plugins.topk import topk_logprobs


class DeviceSpeculator(V2Drafter):
    """The device route: the proposer's ``device_drafter()``."""

    def __init__(self, vllm_config, device, req_states, proposer):
        super().__init__(vllm_config, device, req_states, proposer)
        self.drafter = proposer.device_drafter()
        self._seeded: dict[int, str] = {}  # state row -> the request seeded there
        self._last_req_ids: list[str] | None = None
        self._top1: tuple[torch.Tensor, torch.Tensor] | None = None
        # V2's last_sampled_tokens (one tensor for the runner's life) and
        # whether the step reads it as it is (``_slot_column``), decided once.
        self._last_sampled: tuple[torch.Tensor, bool] | None = None
        self._engine_core_k = self.steers_step_k and isinstance(proposer.controller,
                                                                GoodputController)

    def step_k_report(self) -> dict | None:
        return {"engine_core": 1} if self._engine_core_k else None

    def observe_logits(self, logits: torch.Tensor, input_batch) -> None:
        """The target's top-1 and its log-probability at every row, on the
        logits' device (``topk_logprobs``: on a CPU its compiled pass into a
        kept buffer, where torch's ``logsumexp`` over a vocabulary costs
        more than the rest of the step). Kept [rows, 1]: the step reads
        them through ``take``, which sees any tensor flat, so a column
        view would cost a call each for nothing."""
        with torch.no_grad():
            lps, ids = topk_logprobs(logits, 1)
            self._top1 = (ids, lps)

    def draft(self, input_batch, num_reqs: int, num_sampled: torch.Tensor,
              last_sampled: torch.Tensor, step_k: int) -> torch.Tensor:
        top1, self._top1 = self._top1, None
        if top1 is None:
            return torch.zeros(num_reqs, self.num_speculative_steps, dtype=torch.int64,
                               device=self.device)
        self.state.counters.steps += 1
        step = DeviceStep(
            slots=_first(input_batch.idx_mapping, num_reqs),
            cu_num_logits=_first(input_batch.cu_num_logits, num_reqs + 1),
            input_ids=input_batch.input_ids, logits_indices=input_batch.logits_indices,
            top1_ids=top1[0], top1_logprobs=top1[1],
            num_sampled=_first(num_sampled, num_reqs),
            last_sampled=self._slot_column(last_sampled),
            num_tokens=self.num_speculative_steps)
        self._add_new_requests(step, input_batch, num_reqs)
        return self.drafter.device_step(step)

    def _slot_column(self, last_sampled: torch.Tensor) -> torch.Tensor:
        """V2's ``last_sampled_tokens`` as ``DeviceStep.last_sampled``
        wants it ([slots, 1] int64, contiguous): itself, as V2 keeps it (one
        tensor for the runner's life, checked once), else a copy."""
        seen = self._last_sampled
        if seen is None or seen[0] is not last_sampled:
            seen = self._last_sampled = (last_sampled, _slot_column_already(last_sampled))
        if seen[1]:
            return last_sampled
        return last_sampled.reshape(last_sampled.shape[0], -1)[:, :1].to(torch.int64).contiguous()

    def _add_new_requests(self, step: DeviceStep, input_batch, num_reqs: int) -> None:
        """Host work per request, a dict look-up each (the state rows as
        Python ints once); none where the step's requests are the last
        step's (a request keeps its state row for its life)."""
        req_ids = input_batch.req_ids
        if req_ids == self._last_req_ids:
            return
        self._last_req_ids = list(req_ids)
        seeded = self._seeded
        pairs = zip(input_batch.idx_mapping_np[:num_reqs].tolist(), req_ids)
        new = [(row, req_id) for row, req_id in pairs if seeded.get(row) != req_id]
        if not new:
            return
        rows = [row for row, _ in new]
        lengths = self.req_states.prefill_len.np[rows].astype("int64")
        step.new_slots = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        step.new_tokens = self.req_states.all_token_ids.gpu[
            step.new_slots, :int(lengths.max())].to(torch.int64)
        step.new_lengths = torch.as_tensor(lengths, device=self.device)
        seeded.update(new)


# Each torch call costs the step a few µs of host time, a view as much as
# a kernel: the step's inputs are taken with as few as their shapes allow.

def _first(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:n], without a call where x has n rows."""
    return x if x.shape[0] == n else x[:n]


def _slot_column_already(last_sampled: torch.Tensor) -> bool:
    """Whether V2's last sampled tokens already are one int64 column,
    contiguous."""
    return (last_sampled.dim() == 2 and last_sampled.shape[1] == 1
            and last_sampled.is_contiguous() and last_sampled.dtype == torch.int64)
