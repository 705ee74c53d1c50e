"""Corrections to vLLM's CPU build that our proposers depend on."""

from __future__ import annotations

from collections.abc import Mapping

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


def add_kernel_scan_vars(_missing):
    # vllm.triton_utils.dispatcher._rebind_kernels (run by the CPU platform's
    # register_triton_kernel_overrides at every worker start) scans the
    # globals of every imported module and reads ``vars(value).get("kernel")``
    # of each one that has a ``__dict__``. llvmlite's ``binding.ffi.lib``
    # answers any attribute, ``__dict__`` included, with a C function
    # wrapper, so once numba is imported in the process (our proposers use
    # it) the scan raises AttributeError and the engine does not start. That
    # is every engine built in a process that already validated our
    # speculative config: an in-process engine
    # (VLLM_ENABLE_V1_MULTIPROCESSING=0), or a second engine there. This
    # module-level ``vars`` shadows the builtin for the dispatcher alone and
    # reads such an object as having no namespace.
    def vars_or_empty(obj):
        namespace = vars(obj)
        return namespace if isinstance(namespace, Mapping) else {}

    return vars_or_empty
