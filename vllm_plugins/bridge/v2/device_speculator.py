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

Draft length on this route is V2's k, every step; the draft-length
controllers read host figures, so they do not run here.
"""

from __future__ import annotations

import torch

from vllm_plugins.bridge.state import attach
from vllm_plugins.bridge.v2.taps import tap_samplers
from vllm_plugins.drafter import DeviceStep


class DeviceSpeculator:
    """Made a ``BaseSpeculator`` subclass by ``speculator.make_speculator``."""

    supports_mm_inputs = False
    num_query_per_req = 1
    num_extra_query_per_req = 0

    def __init__(self, vllm_config, device, req_states, proposer):
        self.k = int(vllm_config.speculative_config.num_speculative_tokens)
        self.device = device
        self.req_states = req_states
        self.proposer = proposer  # the Drafter: options, load_model, metrics
        self.drafter = proposer.device_drafter()
        max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        self.draft_logits = None  # deterministic drafts
        self.draft_token_confidence_probs = torch.zeros(max_num_reqs, self.k, device=device)
        self.pcp_manager = None
        self.state = None
        self._seeded: dict[int, str] = {}  # state row -> the request seeded there
        self._top1: tuple[torch.Tensor, torch.Tensor] | None = None

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        pass

    def capture(self) -> None:
        pass

    def attach(self, runner) -> None:
        tap_samplers(runner, self)
        self.state = attach(runner, self.proposer)
        self.proposer.load_model(runner.model)  # moves the tables to the target's device

    def observe_params(self, req_index, sampling_params) -> None:
        pass

    def observe_logits(self, logits: torch.Tensor, input_batch) -> None:
        """The target's top-1 and its log-probability at every row, on the
        logits' device."""
        with torch.no_grad():
            x = logits.float()
            best, ids = x.max(dim=-1)
            self._top1 = (ids, best - torch.logsumexp(x, dim=-1))

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        num_reqs = int(input_batch.num_reqs)
        top1, self._top1 = self._top1, None
        if dummy_run or is_profile or top1 is None:
            return torch.zeros(num_reqs, self.k, dtype=torch.int64, device=self.device)
        self.state.counters.steps += 1
        slots = input_batch.idx_mapping[:num_reqs]
        step = DeviceStep(
            slots=slots,
            cu_num_logits=input_batch.cu_num_logits[:num_reqs + 1],
            verified_inputs=input_batch.input_ids[input_batch.logits_indices].to(torch.int64),
            top1_ids=top1[0], top1_logprobs=top1[1],
            num_sampled=num_sampled[:num_reqs],
            last_tokens=last_sampled[slots, 0].to(torch.int64),
            num_tokens=self.k)
        self._add_new_requests(step, input_batch, num_reqs)
        return self.drafter.device_step(step)

    def _add_new_requests(self, step: DeviceStep, input_batch, num_reqs: int) -> None:
        index = input_batch.idx_mapping_np[:num_reqs]
        req_ids = input_batch.req_ids[:num_reqs]
        new = [b for b, req_id in enumerate(req_ids) if self._seeded.get(int(index[b])) != req_id]
        if not new:
            return
        rows = [int(index[b]) for b in new]
        lengths = self.req_states.prefill_len.np[rows].astype("int64")
        step.new_slots = torch.as_tensor(rows, dtype=torch.int64, device=self.device)
        step.new_tokens = self.req_states.all_token_ids.gpu[
            step.new_slots, :int(lengths.max())].to(torch.int64)
        step.new_lengths = torch.as_tensor(lengths, device=self.device)
        for b in new:
            self._seeded[int(index[b])] = req_ids[b]
