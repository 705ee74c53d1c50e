"""The Triton kernels compiled on a GPU against their twins (skipped without
CUDA), and the GPU benchmark's refusal of a host without one."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import (case, causal_like, check_move_kv, check_move_kv_layers,
                                dense_reference, move_case, run)
from vllm_plugins.kernels import kv_move, tree_attention as ta


# ---------------------------------------------------------------- Triton, compiled on CUDA
#
# The same kernels compiled for a GPU, where bfloat16 is checked too (the
# interpreter cannot), on model-sized heads, long contexts, wide trees and
# many requests. Each kernel is compared with its twin run on the same CUDA
# tensors and, in float32, with the float64 dense reference.

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="compiled Triton kernels need a CUDA device")

CUDA_ATTENTION_CASES = [
    # layout, block_size, heads, kv_heads, head_size, dtype, query_lens, committed
    ("flash", 16, 32, 8, 128, "bfloat16", (81, 1, 33, 64), (1000, 4000, 17, 300)),
    ("flash", 16, 32, 8, 128, "float16", (81, 7), (2047, 0)),
    ("flash", 16, 32, 8, 128, "float32", (16, 81), (129, 700)),
    ("flash", 32, 28, 4, 128, "bfloat16", (49, 12, 2), (513, 64, 3000)),
    ("cpu", 32, 9, 3, 64, "bfloat16", (33, 5), (200, 31)),
    ("contiguous", 16, 64, 8, 128, "bfloat16", (80,) * 8, (100, 200, 400, 800, 1600, 3200,
                                                            50, 6400)),
    ("flash", 64, 16, 16, 64, "bfloat16", (7, 64), (90, 10)),
    ("flash", 16, 8, 1, 256, "bfloat16", (20, 3), (300, 40)),
]


def check_cuda_attention(layout, block_size, heads, kv_heads, head_size, dtype, query_lens,
                         committed):
    dtype = getattr(torch, dtype)
    query, key_cache, value_cache, batch = case(
        50 + block_size + heads, layout, block_size, heads, kv_heads, head_size, dtype,
        query_lens=query_lens, committed=committed, device="cuda")
    scale = head_size ** -0.5
    twin = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, scale)
    kernel = run(ta.tree_attention_triton, query, key_cache, value_cache, batch, scale)
    tol = 2e-5 if dtype == torch.float32 else (3e-3 if dtype == torch.float16 else 2e-2)
    torch.testing.assert_close(kernel.float(), twin.float(), atol=tol, rtol=tol)
    for launch in ({"splits": 1}, {"splits": 5, "tile": 16}, {"splits": 1, "tile": 64},
                   {"rows": 64, "num_warps": 4}, {"rows": 128, "num_warps": 8, "tile": 64,
                                                  "splits": 3}):
        other = ta.tree_attention_triton(query, key_cache, value_cache, batch["block_table"],
                                         batch["seq_lens"], batch["query_start_loc"],
                                         batch["tree_mask"], scale, **launch)
        torch.testing.assert_close(other.float(), twin.float(), atol=tol, rtol=tol)
    if dtype == torch.float32:
        cpu_batch = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        ref = dense_reference(query.cpu(), key_cache.cpu(), value_cache.cpu(), cpu_batch, scale)
        torch.testing.assert_close(kernel.cpu().double(), ref, atol=2e-5, rtol=1e-4)
    wrong = run(ta.tree_attention_triton, query, key_cache, value_cache, batch, scale,
                tree_mask=causal_like(batch))
    assert (wrong.float() - twin.float()).abs().max() > 10 * tol


@needs_cuda
@pytest.mark.parametrize("params", CUDA_ATTENTION_CASES,
                         ids=["-".join(map(str, c[:6])) for c in CUDA_ATTENTION_CASES])
def test_cuda_tree_attention_kernel_matches_twin(params):
    check_cuda_attention(*params)


@needs_cuda
def test_cuda_dispatch_takes_the_kernels(monkeypatch):
    """On CUDA tensors the dispatchers call the Triton kernels."""
    called = []
    attention, move = ta.tree_attention_triton, kv_move.move_kv_triton
    monkeypatch.setattr(ta, "tree_attention_triton",
                        lambda *a, **k: called.append("attention") or attention(*a, **k))
    monkeypatch.setattr(kv_move, "move_kv_triton",
                        lambda *a, **k: called.append("move") or move(*a, **k))
    query, key_cache, value_cache, batch = case(60, "flash", 16, 8, 2, 64, torch.bfloat16,
                                                device="cuda")
    run(ta.tree_attention, query, key_cache, value_cache, batch, 0.125)
    keys, values, src, dst = move_case(61, "flash", 16, 2, 64, torch.bfloat16, "cuda")
    kv_move.move_kv(keys, values, torch.tensor(src, device="cuda"),
                    torch.tensor(dst, device="cuda"))
    assert called == ["attention", "move"]


@needs_cuda
@pytest.mark.parametrize("layout,block_size,kv_heads,head_size,dtype", [
    ("flash", 16, 8, 128, torch.bfloat16), ("flash", 32, 1, 64, torch.float16),
    ("contiguous", 16, 4, 256, torch.float32)])
def test_cuda_move_kv_kernel_matches_reference(layout, block_size, kv_heads, head_size, dtype):
    check_move_kv("triton", layout, block_size, kv_heads, head_size, dtype, "cuda")


@needs_cuda
@pytest.mark.parametrize("layout,dtype", [("flash", torch.bfloat16), ("cpu", torch.float16)])
def test_cuda_move_kv_layers_kernel_matches_reference(layout, dtype):
    check_move_kv_layers("dispatch", layout, dtype, "cuda")


def test_gpu_kernel_bench_says_it_needs_cuda():
    from vllm_plugins.bench import tree_kernels_gpu

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: the bench would run")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        tree_kernels_gpu.main(["--tables", "move"])
