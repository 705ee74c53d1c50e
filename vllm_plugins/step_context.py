"""What a plugin proposer sees of one engine step.

vLLM's ``custom_class`` route hands a proposer raw batch arrays whose rows move
between steps. Proposers here learn per request and from the target's own
distribution, so the bridge re-keys everything by request id and adds the
target's top-k at every verified position. Arrays are numpy views valid only
during the ``propose`` call; copy what must outlive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestStep:
    """One request's slice of a step, in batch order."""

    req_id: str
    # Tokens emitted this step: accepted drafts plus the one sampled token.
    # Empty while the request is still in (chunked) prefill.
    accepted: np.ndarray
    # Every token of the request so far (prompt + output, accepted included).
    context: np.ndarray
    num_prompt_tokens: int
    # Drafts that were verified this step (0 when none were proposed).
    num_draft: int
    # Input token at each verified position: the token before the drafts, then
    # the drafts themselves. Row j of topk_* is the target's distribution of
    # the token that follows verified_tokens[j].
    verified_tokens: np.ndarray
    # Target top-k at each verified position, shape [num_draft + 1, K], ids
    # sorted by descending log-probability. None when the bridge has no logits
    # for this step (e.g. the step only ran a prefill chunk).
    topk_ids: np.ndarray | None
    topk_logprobs: np.ndarray | None
    temperature: float
    # The request's vLLM SamplingParams (read only).
    sampling_params: object = None
    # Position of this request's parent prompt group (n > 1 samples share it).
    group_id: str = ""
    # Self-drafting methods only: rows of this step's token batch at the
    # verified positions (aligned with verified_tokens / topk_*).
    verify_rows: np.ndarray | None = None
    # The request's extra_args["speculation"], parsed once per request
    # (vllm_plugins.proposers.sources.request.SpeculationRequest), or None.
    speculation: object = None

    @property
    def num_accepted_drafts(self) -> int:
        return max(len(self.accepted) - 1, 0)

    @property
    def in_prefill(self) -> bool:
        return len(self.accepted) == 0


@dataclass
class StepContext:
    """A whole step: the batch in row order plus lifecycle notices."""

    requests: list[RequestStep]
    # Requests that finished or were aborted since the previous step.
    finished: set[str] = field(default_factory=set)
    # The longest draft vLLM verifies of this step's: the configured
    # num_speculative_tokens, or the step's k where the runner picks one by
    # batch size (Model Runner V2 with vLLM's
    # num_speculative_tokens_per_batch_size; 0: no drafts this step).
    max_draft: int = 1
    # Whether the runner verifies one k for the whole batch and takes the
    # next step's k from the drafter (Model Runner V2: ``Drafter.next_step_k``).
    # Drafting may then run to the engine's num_speculative_tokens, so a
    # controller weighs every k; what this step sends is still cut to
    # max_draft.
    steers_step_k: bool = False
    # Seconds the engine spent on the previous step (forward + sampling), if known.
    last_step_seconds: float | None = None
    # Tokens the previous step scheduled in total (all requests, drafts included).
    last_step_tokens: int = 0
    # Seconds the proposer spent on the previous step (learning, drafting,
    # choosing lengths), set by the proposer base: the engine waits for it
    # too, and last_step_seconds leaves it out.
    last_propose_seconds: float | None = None
    # Seconds of last_step_seconds the bridge spent extracting the target's
    # top-k for the proposer (0 or None when it extracted none): work of an
    # awake step that a step without speculation, or a resting one, skips.
    last_topk_seconds: float | None = None
    # Seconds the engine spent between our previous proposal and the
    # previous step's forward (scheduling, handling outputs): outside
    # last_step_seconds, and paid by every step, resting or not.
    last_gap_seconds: float | None = None
    # Self-drafting methods only (proposer.SELF_DRAFT): the target's layers as
    # a drafter (vllm_plugins.bridge.v1.target_layers.TargetLayers), and the verification
    # pass's residual stream after each layer the proposer asked for in
    # ``aux_layers`` ({layers run: tensor [tokens, hidden]}).
    target: object = None
    aux_streams: dict | None = None
    # Drafters that learn it (Drafter.masked_topk_wanted): the target's top-k
    # after our grammar processor's mask this step
    # (logits_processors.grammar_topk.MaskedTopk), or None.
    masked_topk: object = None

    @property
    def batch_size(self) -> int:
        return len(self.requests)


@dataclass
class Drafts:
    """A proposer's answer: one token list per request, in batch order.

    ``probs`` optionally gives, per request, the proposer's probability
    distribution over the vocabulary at each drafted position
    (shape [len(tokens), vocab]); vLLM's rejection sampler then keeps sampled
    output exact for stochastic drafts. ``confidence`` optionally gives the
    proposer's estimate that each drafted token will be accepted, consumed by
    draft-length controllers.

    ``parents`` optionally makes a request's draft a tree (vllm_plugins.tree):
    ``parents[i]`` is the index of node i's parent among the request's drafted
    nodes, or -1 for the root (the request's last committed token), with
    ``parents[i] < i``. None, or None for a request, is a chain. Every prefix
    of a tree is a tree, so cutting drafts to a prefix stays valid. A tree's
    ``probs`` row i is the distribution node i was drawn from at its parent.
    """

    tokens: list[list[int]]
    probs: list[np.ndarray | None] | None = None
    confidence: list[np.ndarray | None] | None = None
    parents: list[list[int] | None] | None = None
