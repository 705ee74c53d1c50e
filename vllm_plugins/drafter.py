"""The interface both model runners' adapters call.

A drafter is built by vLLM from the speculative config (``Class(vllm_config)``,
vLLM's ``custom_class`` route, or V2's ``init_speculator`` through our
patch), handed the target once (``load_model``), and then called once per
engine step. Each runner has one adapter (V1: ``vllm_plugins/bridge/v1/``;
V2: ``vllm_plugins/bridge/v2/``); what a drafter needs of the
runner is declared here, never probed with ``getattr``:

- ``Drafter``: the host route. ``step(StepContext) -> Drafts``: the step's
  requests keyed by id, each with its context, verified tokens and the
  target's top-k (``topk_wanted`` ids a row). Both runners serve it.
- ``DeviceDrafter``: the device route, for a drafter whose state is tensors
  on the target's device. ``device_step(DeviceStep) -> Tensor``: tensors in,
  tensors out, no read of a value back to the host, shapes that depend on
  the padded batch size and k only. V2 serves it (its async steps and CUDA
  graphs keep their speed); a ``Drafter`` offers one through
  ``device_drafter()``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm_plugins.counted import Counted
from vllm_plugins.step_context import Drafts, StepContext


class Drafter(Counted):
    """One of our speculative methods, as a runner adapter sees it."""

    # Drafts by running the target's own layers: the adapter hands
    # ``StepContext.target`` and each request's ``verify_rows``, and the
    # scheduler reserves KV slots for the drafts (``num_lookahead_tokens``).
    SELF_DRAFT: ClassVar[bool] = False
    # Layers after which the verification pass's residual stream is handed
    # over as ``StepContext.aux_streams`` (vLLM's EAGLE-3 route); () for none.
    aux_layers: tuple[int, ...] = ()
    # The longest draft a step may hold (the engine's num_speculative_tokens).
    max_draft: int
    vocab_size: int | None

    @classmethod
    def runner_v2_refusal(cls, options: dict) -> str | None:
        """Why Model Runner V2 cannot serve this drafter with these options
        (None: it can). Read at start-up (``bridge.v2.gate``)."""
        return None

    @abstractmethod
    def load_model(self, target_model: Any) -> None:
        """The target, once, after vLLM loaded it."""

    @abstractmethod
    def topk_wanted(self) -> int:
        """How many of the target's top-k per verified row the adapter
        takes for the coming step (0: none)."""

    @abstractmethod
    def step(self, ctx: StepContext) -> Drafts:
        """One engine step: learn, draft. Never raises."""

    @abstractmethod
    def metrics(self) -> dict:
        """A full report, for ``collective_rpc`` readers."""

    # counters() (``Counted``): totals that only grow, for ``/metrics``.

    def masked_topk_wanted(self) -> int:
        """Ids a row of the target's top-k after our grammar processor's
        mask that the drafter learns (``StepContext.masked_topk``); 0: none."""
        return 0

    def device_drafter(self) -> DeviceDrafter | None:
        """This drafter's device route, where it has one."""
        return None

    def next_step_k(self) -> int | None:
        """The batch-wide draft length this drafter wants verified after
        its next step, decided in the step that just ran (``step`` with
        ``StepContext.steers_step_k``); None: no choice, the runner's k holds.
        A runner that verifies one k for every request (Model Runner V2)
        schedules it one step late."""
        return None


@dataclass
class DeviceStep:
    """One step as tensors on the target's device (``R``: the step's
    requests; ``rows``: its logits rows, ``cu_num_logits`` a request)."""

    # [R] int64: each request's state row, persistent while it lives (V2's
    # ``idx_mapping``): the drafter's per-request slot.
    slots: Any
    # [R + 1]: request r's logits rows are cu_num_logits[r]:cu_num_logits[r + 1]
    # (the row after the request's newest token before this step's drafts,
    # then one per draft).
    cu_num_logits: Any
    # The step's input tokens [tokens] int32 or int64, and [rows] the input
    # position of each logits row: row i's input token is
    # input_ids[logits_indices[i]] (V2's own tensors, read where they are).
    input_ids: Any
    logits_indices: Any
    # [rows, 1] int64 and float32: the target's top-1 after each row's input
    # and its log-probability (read flat, with ``take``).
    top1_ids: Any
    top1_logprobs: Any
    # [R]: tokens each request emitted this step (0: a prefill chunk), at
    # most one a logits row.
    num_sampled: Any
    # [slots, 1] int64, contiguous: each slot's newest token (V2's
    # ``last_sampled_tokens``), read at ``slots``.
    last_sampled: Any
    # Drafts a request, the step's k.
    num_tokens: int
    # Requests new to their slot this step: their slots [n], tokens so far
    # [n, width] and lengths [n] (host-known shapes), or None.
    new_slots: Any = None
    new_tokens: Any = None
    new_lengths: Any = None


class DeviceDrafter(ABC):
    """A drafter whose whole step is tensor ops on the target's device."""

    @abstractmethod
    def device_step(self, step: DeviceStep) -> Any:
        """Learn the step's verified rows and draft: ``[R, num_tokens]``
        int64, every entry a token id (V2 verifies k tokens a request). The
        runner copies them before its next step (V2 into its request
        states), so a drafter may return a buffer it reuses."""
