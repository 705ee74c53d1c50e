"""A correction to vLLM's CPU build that speculative sampling depends on."""

from __future__ import annotations

import torch


def no_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON


def replace_expand_batch_to_tokens(_original):
    # vllm.v1.sample.rejection_sampler.expand_batch_to_tokens(x, cu_num_tokens,
    #     num_tokens, replace_from=0, replace_to=0) spreads per-request
    # temperature / top_k / top_p over the draft rows before verification.
    # Without Triton (the CPU build), vLLM 0.32 runs its expand_kernel as
    # vllm.utils.cpu_triton_utils._expand_kernel_impl, which casts the output
    # to int64 and writes into that copy: float32 (temperature, top_p) and
    # int32 (top_k) results stay uninitialised, so sampled requests are
    # verified against garbage target probabilities (wrong output
    # distribution, recovered token 0) with every speculative method. Only
    # where Triton is absent; the Triton kernel is correct.
    def expand_batch_to_tokens(x, cu_num_tokens, num_tokens, replace_from=0,
                               replace_to=0):
        counts = torch.diff(cu_num_tokens.to(torch.int64),
                            prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
        x = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
        return torch.repeat_interleave(x, counts, output_size=num_tokens)

    return expand_batch_to_tokens
