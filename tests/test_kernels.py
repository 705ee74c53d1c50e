"""Tree attention and the KV move: each Triton kernel against its torch twin
under Triton's interpreter (on CPU), each twin against a plain reference, and
the tree-attention twin against vLLM's own CPU attention op on a chain. The
compiled kernels' checks on a GPU are tests/test_kernels_cuda.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.kernel_cases import (case, causal_like, chain_parents, check_move_kv,
                                check_move_kv_layers, dense_reference, make_batch,
                                move_case, move_reference, run, serial_copy)
from vllm_plugins.kernels import kv_move, tree_attention as ta
from vllm_plugins.kernels.cache_layout import cpu_cache_views


# ---------------------------------------------------------------- tree attention: twin

TWIN_CASES = [
    # layout, block_size, heads, kv_heads, head_size
    ("contiguous", 16, 4, 4, 64),
    ("contiguous", 32, 8, 2, 128),
    ("cpu", 32, 6, 2, 64),
    ("cpu", 64, 4, 1, 128),
    ("contiguous", 128, 2, 2, 64),
    ("cpu", 128, 8, 4, 80),
]


@pytest.mark.parametrize("layout,block_size,heads,kv_heads,head_size", TWIN_CASES)
def test_twin_matches_dense_reference(layout, block_size, heads, kv_heads, head_size):
    query, key_cache, value_cache, batch = case(1, layout, block_size, heads, kv_heads, head_size)
    scale = head_size ** -0.5
    ours = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, scale)
    ref = dense_reference(query, key_cache, value_cache, batch, scale)
    torch.testing.assert_close(ours.double(), ref, atol=2e-5, rtol=1e-4)


def test_twin_bfloat16_and_out_argument():
    query, key_cache, value_cache, batch = case(2, "cpu", 32, 4, 2, 64, dtype=torch.bfloat16)
    out = torch.full_like(query, 7.0)
    got = ta.tree_attention_torch(query, key_cache, value_cache, batch["block_table"],
                                  batch["seq_lens"], batch["query_start_loc"],
                                  batch["tree_mask"], 0.125, out=out)
    assert got is out
    ref = dense_reference(query, key_cache, value_cache, batch, 0.125)
    torch.testing.assert_close(got.double(), ref, atol=2e-2, rtol=2e-2)


def test_wrong_mask_is_detected():
    """The comparison can fail: a causal mask over a branching tree gives
    other outputs than the tree mask."""
    query, key_cache, value_cache, batch = case(3, "contiguous", 16, 4, 2, 64,
                                                query_lens=(12, 9), committed=(5, 30))
    assert any(p != chain_parents(len(p)) for p in batch["parents"])
    ref = dense_reference(query, key_cache, value_cache, batch, 0.125)
    wrong = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, 0.125,
                tree_mask=causal_like(batch))
    assert (wrong.double() - ref).abs().max() > 1e-2


def test_bad_shapes_fail_with_one_error_naming_the_argument():
    query, key_cache, value_cache, batch = case(4, "contiguous", 16, 6, 4, 64)
    with pytest.raises(ValueError, match="kv heads"):
        run(ta.tree_attention_torch, query, key_cache, value_cache, batch, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_twin_matches_vllm_cpu_attention_on_a_chain(dtype):
    """On a chain the tree mask is causal: the twin, reading vLLM's CPU cache
    through cpu_cache_views, must give what vLLM's own CPU attention op
    gives after vLLM's own cache writer stored the keys and values."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    gen = torch.Generator().manual_seed(5)
    block_size, num_heads, num_kv_heads, head_size = 32, 6, 2, 64
    batch = make_batch(gen, block_size, [6, 1, 17], [70, 44, 33], shape="chain")
    isa = _get_attn_isa(dtype, block_size, head_size)
    if isa == "amx":
        pytest.skip("AMX packs keys in an order cpu_cache_views does not describe")
    kv = torch.zeros(batch["num_blocks"], num_kv_heads, block_size, 2 * head_size, dtype=dtype)
    vllm_keys, vllm_values = kv.view(batch["num_blocks"], num_kv_heads, 2 * block_size,
                                     head_size).chunk(2, dim=2)
    for b, seq_len in enumerate(batch["seq_lens"].tolist()):
        pos = torch.arange(seq_len)
        slots = batch["block_table"][b, pos // block_size].long() * block_size + pos % block_size
        ops.cpu_attn_reshape_and_cache(
            torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype),
            torch.randn(seq_len, num_kv_heads, head_size, generator=gen).to(dtype),
            vllm_keys, vllm_values, slots, isa)
    query = torch.randn(int(batch["query_start_loc"][-1]), num_heads, head_size,
                        generator=gen).to(dtype)
    scale = head_size ** -0.5
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(batch["seq_lens"]), num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_size, seq_lens=batch["seq_lens"], dtype=dtype,
        query_start_loc=batch["query_start_loc"], causal=True, sliding_window_size=-1,
        isa=isa, enable_kv_split=False)
    vllm_out = torch.zeros_like(query)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=vllm_keys, value_cache=vllm_values, output=vllm_out,
        query_start_loc=batch["query_start_loc"], seq_lens=batch["seq_lens"], scale=scale,
        causal=True, alibi_slopes=None, sliding_window=-1, block_table=batch["block_table"],
        softcap=0.0, scheduler_metadata=metadata, s_aux=None)
    key_cache, value_cache = cpu_cache_views(kv)
    ours = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, scale)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), vllm_out.float(), atol=tol, rtol=tol)
    # the layout matters: reading the keys untransposed gives another answer
    plain_keys = vllm_keys.permute(0, 2, 1, 3)
    misread = run(ta.tree_attention_torch, query, plain_keys, value_cache, batch, scale)
    assert (misread.float() - vllm_out.float()).abs().max() > 10 * tol


# ---------------------------------------------------------------- Triton, interpreted
#
# Triton reads TRITON_INTERPRET when it is first imported, and this process
# may have imported it already (vLLM does), so the Triton checks below run in
# a fresh process (tests/kernels_interpreted.py) that sets it first; each
# check is reported here as its own test.

# No bfloat16 here: Triton's interpreter computes tl.dot wrongly on bfloat16
# inputs (plain loads, stores and casts are right), so bfloat16 attention
# waits for a GPU run.
TRITON_CASES = [
    # layout, block_size, heads, kv_heads, head_size, dtype
    ("contiguous", 16, 4, 4, 64, "float32"),
    ("cpu", 16, 8, 2, 64, "float32"),
    ("contiguous", 32, 6, 2, 128, "float32"),
    ("cpu", 32, 4, 1, 64, "float16"),
    ("contiguous", 64, 2, 2, 128, "float16"),
    ("cpu", 64, 8, 8, 64, "float32"),
    ("cpu", 128, 4, 2, 128, "float32"),
    ("contiguous", 128, 16, 2, 80, "float32"),
]


def check_triton_attention(layout, block_size, heads, kv_heads, head_size, dtype):
    dtype = getattr(torch, dtype)
    query, key_cache, value_cache, batch = case(
        10 + block_size + heads, layout, block_size, heads, kv_heads, head_size, dtype,
        query_lens=(9, 1, 20), committed=(block_size + 3, 2 * block_size, 0))
    scale = head_size ** -0.5
    twin = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, scale)
    kernel = run(ta.tree_attention_triton, query, key_cache, value_cache, batch, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(kernel.float(), twin.float(), atol=tol, rtol=tol)


def check_triton_small_tile_and_wrong_mask():
    """Tiles smaller than a cache block, the out argument, and a causal mask
    on a branching tree that the comparison catches."""
    query, key_cache, value_cache, batch = case(20, "cpu", 64, 4, 2, 64,
                                                query_lens=(11, 16), committed=(90, 3))
    twin = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, 0.125)
    out = torch.empty_like(query)
    got = ta.tree_attention_triton(query, key_cache, value_cache, batch["block_table"],
                                   batch["seq_lens"], batch["query_start_loc"],
                                   batch["tree_mask"], 0.125, out=out, tile=16)
    assert got is out
    torch.testing.assert_close(got, twin, atol=1e-5, rtol=1e-5)
    wrong = run(ta.tree_attention_triton, query, key_cache, value_cache, batch, 0.125,
                tree_mask=causal_like(batch))
    assert (wrong - twin).abs().max() > 1e-2


def check_triton_key_splits():
    """Each request's keys split across programs and merged by the second
    kernel: splits that end inside the committed prefix, inside the step's
    tokens, and splits left empty by a short request; rows outside every
    request (padding) keep what ``out`` held."""
    query, key_cache, value_cache, batch = case(22, "cpu", 16, 8, 2, 64,
                                                query_lens=(9, 1, 20), committed=(100, 3, 45))
    pad = 3
    query = torch.cat([query, torch.randn(pad, *query.shape[1:])])
    mask = torch.cat([batch["tree_mask"], torch.zeros(pad, batch["tree_mask"].shape[1],
                                                      dtype=torch.bool)])
    twin = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, 0.125,
               tree_mask=mask)
    for splits in (2, 3, 7):
        out = torch.full_like(query, 7.0)
        ta.tree_attention_triton(query, key_cache, value_cache, batch["block_table"],
                                 batch["seq_lens"], batch["query_start_loc"], mask, 0.125,
                                 out=out, tile=16, splits=splits)
        torch.testing.assert_close(out[:-pad], twin[:-pad], atol=1e-5, rtol=1e-5)
        assert torch.equal(out[-pad:], torch.full_like(out[-pad:], 7.0))


def check_dispatch_takes_the_twin_on_cpu():
    """Even with Triton able to run (interpreted), CPU tensors get the twin."""
    query, key_cache, value_cache, batch = case(21, "contiguous", 16, 4, 2, 64)
    twin = run(ta.tree_attention_torch, query, key_cache, value_cache, batch, 0.125)
    picked = run(ta.tree_attention, query, key_cache, value_cache, batch, 0.125)
    assert torch.equal(picked, twin)


# ---------------------------------------------------------------- KV move

MOVE_CASES = [
    ("contiguous", 16, 2, 64),
    ("cpu", 32, 4, 128),
    ("cpu", 64, 1, 64),
    ("contiguous", 128, 8, 80),
]


@pytest.mark.parametrize("layout,block_size,kv_heads,head_size", MOVE_CASES)
def test_move_kv_twin_matches_reference(layout, block_size, kv_heads, head_size):
    check_move_kv("torch", layout, block_size, kv_heads, head_size)


def test_move_kv_reads_all_sources_first():
    """A path whose destination is another node's source, copied in the
    order a scatter may pick: writing as it reads gives a different cache,
    so the comparisons with move_reference can fail."""
    keys = torch.randn(2, 16, 2, 64)
    values = torch.randn(2, 16, 2, 64)
    src, dst = [16 + 5, 16 + 2, 16 + 0], [16 + 2, 16 + 1, 16 + 0]
    expect = move_reference(keys, src, dst)
    assert not torch.equal(serial_copy(keys, src, dst), expect)
    kv_move.move_kv_torch(keys, values, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(keys, expect)


def check_move_kv_dispatch_and_empty():
    keys, values, src, dst = move_case(40, "cpu", 32, 2, 64)
    expect = move_reference(keys, src, dst)
    kv_move.move_kv(keys, values, torch.tensor(src), torch.tensor(dst))
    assert torch.equal(keys, expect)
    before = keys.clone()
    empty = torch.empty(0, dtype=torch.int32)
    kv_move.move_kv_triton(keys, values, empty, empty)
    assert torch.equal(keys, before)


def test_move_kv_layers_refuses_mixed_layers():
    keys = [torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="share strides and dtype"):
        kv_move.move_kv_layers_triton(keys, keys, torch.tensor([1]), torch.tensor([0]))


def test_move_kv_layers_twin_on_cpu():
    check_move_kv_layers("dispatch")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_move_kv_host_moves_what_the_twin_moves(dtype):
    """The bridge's host move (numpy over each CPU cache's memory) leaves
    every layer's cache as the torch twin does, sources read before a
    destination that is another pair's source is written."""
    gen = torch.Generator().manual_seed(5)
    layers, expect = [], []
    src, dst = [5, 40, 33, 64 + 3], [33, 41, 42, 70]
    for _ in range(3):
        kv = torch.randn(12, 2, 32, 2 * 64, generator=gen).to(dtype)
        key, value = cpu_cache_views(kv)
        layers.append((kv, key, value, kv_move.host_elements(kv),
                       kv_move.host_layout(kv, key, value)))
        k, v = key.clone(), value.clone()
        kv_move.move_kv_torch(k, v, torch.tensor(src), torch.tensor(dst))
        expect.append((k, v))
    kv_move.move_kv_host(layers, src, dst)
    for (_, key, value, _, _), (k, v) in zip(layers, expect):
        assert torch.equal(key, k) and torch.equal(value, v)
    assert kv_move.host_elements(torch.zeros(4, 4).t()) is None


# ---------------------------------------------------------------- the interpreted run

def interpreted_checks() -> dict:
    """Name -> zero-argument check, for tests/kernels_interpreted.py."""
    checks = {f"attention[{'-'.join(map(str, c))}]": (lambda c=c: check_triton_attention(*c))
              for c in TRITON_CASES}
    checks["attention_small_tile_and_wrong_mask"] = check_triton_small_tile_and_wrong_mask
    checks["attention_key_splits"] = check_triton_key_splits
    checks["attention_dispatch"] = check_dispatch_takes_the_twin_on_cpu
    checks.update({f"move_kv[{'-'.join(map(str, c))}]": (lambda c=c: check_move_kv("triton", *c))
                   for c in MOVE_CASES})
    checks["move_kv_dispatch_and_empty"] = check_move_kv_dispatch_and_empty
    checks["move_kv_layers[cpu]"] = check_move_kv_layers
    checks["move_kv_layers[flash]"] = lambda: check_move_kv_layers(layout="flash")
    return checks


@pytest.fixture(scope="module")
def interpreted_results():
    pytest.importorskip("triton")
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels_interpreted"], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(lines[-1])


@pytest.mark.parametrize("name", sorted(interpreted_checks()))
def test_triton_kernel_under_interpreter(interpreted_results, name):
    assert interpreted_results["interpreted"], "Triton did not run in its interpreter"
    assert name in interpreted_results["checks"], f"{name} was not run"
    error = interpreted_results["checks"][name]
    assert error is None, error


def test_kernel_sizes_bench_times_the_twin():
    from vllm_plugins.bench.kernel_sizes import measure_tree_attention

    rows = measure_tree_attention([4, 8], context=40, repeats=2)
    assert [r["nodes"] for r in rows] == [4, 8]
    assert all(r["layer_us"] > 0 and r["step_ms"] == r["layer_us"] * 30 / 1e3 for r in rows)
