"""The step's ``StepContext``, built from Model Runner V2's own state.

V2 keeps a request's tokens in ``RequestState`` rows (``idx_mapping`` maps
batch rows to them), has already appended this step's accepted and sampled
tokens when the drafter runs (``postprocess_sampled``), and tells the drafter
how many tokens each request emitted (``num_sampled``: 0 while a prefill is
still in chunks). The verified inputs are the step's ``input_ids`` at its
``logits_indices``: the token before the drafts, then the drafts. This is
the host route: it reads those on the host, one wait per step, and every
host-side method (numba walks, suffix trees, STAND's store) runs on it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_plugins.bridge.groups import group_of
from vllm_plugins.step_context import RequestStep, StepContext


@dataclass
class VerifiedTopk:
    """The target's top-k at every logits row of one step, in batch order
    (taken by the sampler tap, read by the same step's proposal)."""

    ids: torch.Tensor  # [rows, k] int64
    logprobs: torch.Tensor  # [rows, k] float32


@dataclass
class StepTimes:
    """What the controllers are told of the previous step."""

    step_seconds: float | None = None
    propose_seconds: float | None = None
    topk_seconds: float | None = None


@dataclass
class RequestBook:
    """What the V2 drafter keeps per request, keyed by V2's state index
    (parameters, from the sampler tap) and by request id (who is live)."""

    params_by_index: dict[int, object] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)
    # Each live request's parsed extra_args["speculation"] (None without
    # one), parsed at its first step.
    speculation: dict[str, object] = field(default_factory=dict)

    def finished(self, req_states) -> set[str]:
        """Requests we drafted for that V2 has since removed (finished,
        aborted or preempted: ``finish_requests`` runs before the step)."""
        gone = {r for r in self.live if r not in req_states.req_id_to_index}
        self.live -= gone
        for req_id in gone:
            self.speculation.pop(req_id, None)
        return gone


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def build_context(req_states, input_batch, num_sampled: torch.Tensor,
                  topk: VerifiedTopk | None, book: RequestBook, max_draft: int,
                  times: StepTimes, step_max_draft: int | None = None,
                  steers_step_k: bool = False) -> StepContext:
    """``max_draft``: the engine's ``num_speculative_tokens`` (a request's
    own ``max_draft`` is checked against it). ``step_max_draft``: the step's
    k where V2's scheduler chose a smaller one; the context's ``max_draft``.
    ``steers_step_k``: our controller chooses the next step's k.

    ``num_draft`` is read from the rows V2 verified (``cu_num_logits``),
    not from what we sent: drafts the scheduler did not schedule are
    neither accepted nor rejected."""
    num_reqs = int(input_batch.num_reqs)
    req_ids = list(input_batch.req_ids[:num_reqs])
    index = np.asarray(input_batch.idx_mapping_np[:num_reqs], dtype=np.int64)
    sampled = _host(num_sampled[:num_reqs]).astype(np.int64)
    index_t = torch.from_numpy(index).to(req_states.total_len.gpu.device)
    total = _host(req_states.total_len.gpu[index_t]).astype(np.int64)
    width = int(total.max()) if num_reqs else 0
    tokens = _host(req_states.all_token_ids.gpu[index_t, :width]).astype(np.int64)
    prompt_len = np.asarray(req_states.prompt_len.np[index], dtype=np.int64)
    cu = np.asarray(input_batch.cu_num_logits_np[:num_reqs + 1], dtype=np.int64)
    verified = _host(input_batch.input_ids[input_batch.logits_indices]).astype(np.int64)
    ids = lps = None
    if topk is not None and topk.ids.shape[0] == int(cu[-1]):
        ids, lps = _host(topk.ids).astype(np.int64), _host(topk.logprobs)
    finished = book.finished(req_states)
    requests = []
    for b, req_id in enumerate(req_ids):
        n, emitted = int(total[b]), int(sampled[b])
        rows = slice(int(cu[b]), int(cu[b + 1]))
        params = book.params_by_index.get(int(index[b]))
        book.live.add(req_id)
        if req_id not in book.speculation:
            from vllm_plugins.proposers.sources.request import worker_speculation

            book.speculation[req_id] = worker_speculation(params, max_draft)
        requests.append(RequestStep(
            req_id=req_id,
            accepted=tokens[b, n - emitted:n],
            context=tokens[b, :n],
            num_prompt_tokens=int(prompt_len[b]),
            num_draft=int(cu[b + 1] - cu[b] - 1) if emitted else 0,
            verified_tokens=verified[rows],
            topk_ids=ids[rows] if ids is not None and emitted else None,
            topk_logprobs=lps[rows] if lps is not None and emitted else None,
            temperature=float(getattr(params, "temperature", 0.0) or 0.0),
            sampling_params=params,
            group_id=group_of(req_id, params),
            speculation=book.speculation[req_id],
        ))
    return StepContext(
        requests=requests,
        finished=finished,
        max_draft=max_draft if step_max_draft is None else step_max_draft,
        steers_step_k=steers_step_k,
        last_step_seconds=times.step_seconds,
        last_step_tokens=int(input_batch.num_tokens),
        last_propose_seconds=times.propose_seconds,
        last_topk_seconds=times.topk_seconds,
    )
