"""What a self-drafting proposer asks of the target's own layers, in plain
types: which sublayers a draft forward runs (``LayerPlan``), for which batch
rows (``DraftRows``), and what it returns (``SelfDraftResult``).

Layer-skip (SWIFT) and early-exit (DEL) self-speculation draft with the
target's weights: no copy, no second model. The partial forwards themselves
build vLLM attention metadata and forward contexts, so they live in the
bridge (``vllm_plugins.bridge.v1.target_layers.TargetLayers``), which hands
them to the proposer as ``StepContext.target``.

A plan says which sublayers run: ``attn[i]`` / ``mlp[i]`` per layer for the
first ``exit_layer`` layers, then the final norm and LM head. The residual
stream is carried explicitly (``s = s + attn(norm(s))``), so skipping a
sublayer leaves the stream untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Seconds spent in this worker's partial forwards, by part (written by the
# bridge's TargetLayers, read by the proposers' metrics).
SECONDS = {"metadata": 0.0, "layers": 0.0, "head": 0.0}


@dataclass(frozen=True)
class LayerPlan:
    """Which sublayers a draft forward runs."""

    attn: tuple[bool, ...]
    mlp: tuple[bool, ...]
    exit_layer: int = -1  # layers 0..exit_layer-1 may run; -1: all

    @classmethod
    def full(cls, num_layers: int) -> "LayerPlan":
        return cls((True,) * num_layers, (True,) * num_layers, num_layers)

    @classmethod
    def early_exit(cls, num_layers: int, exit_layer: int) -> "LayerPlan":
        return cls((True,) * num_layers, (True,) * num_layers, exit_layer)

    @classmethod
    def skipping(cls, num_layers: int, skip_attn=(), skip_mlp=()) -> "LayerPlan":
        attn = tuple(i not in set(skip_attn) for i in range(num_layers))
        mlp = tuple(i not in set(skip_mlp) for i in range(num_layers))
        return cls(attn, mlp, num_layers)

    @property
    def depth(self) -> int:
        return len(self.attn) if self.exit_layer < 0 else self.exit_layer

    def cost(self) -> float:
        """Fraction of the target's sublayers this plan runs (0..1)."""
        n = len(self.attn)
        d = self.depth
        return (sum(self.attn[:d]) + sum(self.mlp[:d])) / (2.0 * n)


@dataclass
class DraftRows:
    """Requests to draft for, as rows of this step's batch."""

    rows: np.ndarray  # batch row of each request
    last_tokens: np.ndarray  # the newest token (not yet in the KV cache)
    positions: np.ndarray  # its position (== tokens already in the cache)


@dataclass
class SelfDraftResult:
    tokens: np.ndarray  # [R, steps] greedy draft tokens
    top1_prob: np.ndarray  # [R, steps] draft model's probability of each token
    lengths: np.ndarray = field(default=None)  # [R] tokens before the stop rule
