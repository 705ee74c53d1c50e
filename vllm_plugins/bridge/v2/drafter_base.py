"""What V2's runner reads off any drafter, shared by our two V2 drafters
(the host route, ``speculator.PluginSpeculator``, and the device route,
``device_speculator.DeviceSpeculator``). Each is made a subclass of vLLM's
``BaseSpeculator`` by ``speculator.make_speculator``.
"""

from __future__ import annotations

import torch

from vllm_plugins.bridge import ranks
from vllm_plugins.bridge.state import RunnerState, attach
from vllm_plugins.bridge.v2.taps import tap_samplers


class V2Drafter:
    supports_mm_inputs = False
    num_query_per_req = 1
    num_extra_query_per_req = 0

    def __init__(self, vllm_config, device, req_states, proposer):
        self.proposer = proposer  # our Drafter: options, load_model, metrics
        self.device = device
        self.req_states = req_states
        self.num_speculative_steps = int(vllm_config.speculative_config.num_speculative_tokens)
        self.max_num_reqs = vllm_config.scheduler_config.max_num_seqs
        # V2's rejection sampler reads this each step: None verifies every
        # draft as deterministic (one-hot).
        self.draft_logits = None
        # Read by V2's adaptive verification only (off for our methods).
        self.draft_token_confidence_probs = torch.zeros(
            self.max_num_reqs, self.num_speculative_steps, dtype=torch.float32, device=device)
        self.pcp_manager = None
        # Our one state object on the runner (``attach``): counters, digests.
        self.state = RunnerState(proposer=proposer)
        # Whether our controller may choose the step's k (``step_k``): not
        # under data parallelism, where vLLM keeps its own dynamic k off.
        parallel = getattr(vllm_config, "parallel_config", None)
        self.steers_step_k = getattr(parallel, "data_parallel_size", 1) <= 1

    def init_cudagraph_manager(self, cudagraph_mode) -> None:
        """Nothing of ours to capture."""

    def capture(self) -> None:
        pass

    def attach(self, runner) -> None:
        """After V2's ``load_model``: our taps on its samplers, our state on
        the runner, the target handed to the proposer (as V1's custom_class
        route does)."""
        tap_samplers(runner, self)
        self.state = attach(runner, self.proposer)
        self.proposer.load_model(runner.model)
        ranks.join_tensor_parallel()

    def step_k_report(self) -> dict | None:
        """What the step tells V2's scheduler of the next step's k
        (``step_k.OUTPUT_ATTR``): the k our drafter wants; None: the
        scheduler's own."""
        if not self.steers_step_k:
            return None
        k = self.proposer.next_step_k()
        return None if k is None else {"k": int(k)}

    def observe_params(self, req_index: int, sampling_params) -> None:
        """A new request's parameters (the sampler tap)."""

    def observe_logits(self, logits: torch.Tensor, input_batch) -> None:
        """The step's verified rows' logits (the sampler tap)."""

    def propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                aux_hidden_states, num_sampled, num_rejected, last_sampled,
                next_prefill_tokens, temperature, seeds, dp_sync_state=None,
                dummy_run: bool = False, skip_attn_for_dummy_run: bool = False,
                mm_inputs=None, is_profile: bool = False,
                num_speculative_tokens: int | None = None) -> torch.Tensor:
        """``[num_reqs, k]`` int64 drafts, every entry a token id.

        ``num_speculative_tokens``: the step's k, where the scheduler chose
        one below the engine's (vLLM's ``num_speculative_tokens_per_batch_size``,
        picked by batch size): V2 verifies only the first that many of each
        row next step. Rows stay the engine's k wide (V2 stores them whole
        and marks the entries past the step's k -1)."""
        num_reqs = int(input_batch.num_reqs)
        if dummy_run or is_profile:
            return torch.zeros(num_reqs, self.num_speculative_steps, dtype=torch.int64,
                               device=self.device)
        step_k = self.num_speculative_steps
        if num_speculative_tokens is not None:
            step_k = max(0, min(int(num_speculative_tokens), step_k))
        return self.draft(input_batch, num_reqs, num_sampled, last_sampled, step_k)

    def draft(self, input_batch, num_reqs: int, num_sampled: torch.Tensor,
              last_sampled: torch.Tensor, step_k: int) -> torch.Tensor:
        """The step's ``[num_reqs, num_speculative_steps]`` drafts, of which
        V2 verifies the first ``step_k`` of each row."""
        raise NotImplementedError
