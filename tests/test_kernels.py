"""Tree attention and the KV move: each Triton kernel against its torch twin
under Triton's interpreter (on CPU), each twin against a plain reference, and
the tree-attention twin against vLLM's own CPU attention op on a chain."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_plugins.kernels import kv_move, tree_attention as ta
from vllm_plugins.kernels.cache_layout import cpu_cache_views


# ---------------------------------------------------------------- helpers

def random_parents(n: int, gen: torch.Generator) -> list[int]:
    return [int(torch.randint(-1, i, (1,), generator=gen)) if i else -1 for i in range(n)]


def chain_parents(n: int) -> list[int]:
    return list(range(-1, n - 1))


def ancestry(parents: list[int]) -> torch.Tensor:
    """[n, n]: row i sees node j when j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
    return mask


def make_caches(layout: str, num_blocks: int, block_size: int, num_kv_heads: int,
                head_size: int, dtype: torch.dtype, gen: torch.Generator,
                device: str = "cpu"):
    """(key_cache, value_cache) as the kernels read them: ``contiguous``
    tensors, the halves of vLLM's CUDA ``flash`` cache ``[2, num_blocks,
    block_size, kv_heads, head_size]``, or views of its ``cpu`` cache."""
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    if layout == "contiguous":
        return (torch.randn(shape, generator=gen).to(device, dtype),
                torch.randn(shape, generator=gen).to(device, dtype))
    if layout == "flash":
        return torch.randn(2, *shape, generator=gen).to(device, dtype).unbind(0)
    kv = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head_size, generator=gen)
    return cpu_cache_views(kv.to(device, dtype))


def make_batch(gen: torch.Generator, block_size: int, query_lens: list[int],
               committed: list[int], shape: str = "tree"):
    """Block tables over shuffled blocks (non-contiguous, with spare columns),
    seq_lens, query_start_loc and each request's mask over its step tokens."""
    num_reqs = len(query_lens)
    seq_lens = [c + q for c, q in zip(committed, query_lens)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 2
    num_blocks = sum(blocks_per_req) + 3
    order = torch.randperm(num_blocks, generator=gen)
    block_table = torch.full((num_reqs, max_blocks), num_blocks - 1, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_table[b, :n] = order[used:used + n]
        used += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    tree_mask = torch.zeros(starts[-1], max(query_lens), dtype=torch.bool)
    parents = []
    for b, q in enumerate(query_lens):
        p = random_parents(q, gen) if shape == "tree" else chain_parents(q)
        parents.append(p)
        tree_mask[starts[b]:starts[b + 1], :q] = ancestry(p)
    return {
        "num_blocks": num_blocks,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32),
        "tree_mask": tree_mask,
        "parents": parents,
    }


def dense_reference(query, key_cache, value_cache, batch, scale):
    """Plain attention in float64: gather each request's sequence position by
    position, build its full [query_len, seq_len] mask, repeat kv heads."""
    out = torch.zeros(query.shape, dtype=torch.float64)
    block_size = key_cache.shape[1]
    group = query.shape[1] // key_cache.shape[2]
    starts = batch["query_start_loc"].tolist()
    for b, seq_len in enumerate(batch["seq_lens"].tolist()):
        q0, q1 = starts[b], starts[b + 1]
        n = q1 - q0
        table = batch["block_table"][b]
        keys = torch.stack([key_cache[table[p // block_size], p % block_size]
                            for p in range(seq_len)]).double()
        values = torch.stack([value_cache[table[p // block_size], p % block_size]
                              for p in range(seq_len)]).double()
        keys = keys.repeat_interleave(group, dim=1)      # [S, Hq, D]
        values = values.repeat_interleave(group, dim=1)
        mask = torch.ones(n, seq_len, dtype=torch.bool)
        mask[:, seq_len - n:] = batch["tree_mask"][q0:q1, :n]
        scores = torch.einsum("thd,shd->hts", query[q0:q1].double(), keys) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        out[q0:q1] = torch.einsum("hts,shd->thd", torch.softmax(scores, -1), values)
    return out


def case(seed: int, layout: str, block_size: int, num_heads: int, num_kv_heads: int,
         head_size: int, dtype=torch.float32, shape: str = "tree",
         query_lens=(7, 1, 13), committed=(40, 75, 0), device: str = "cpu"):
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(gen, block_size, list(query_lens), list(committed), shape)
    key_cache, value_cache = make_caches(layout, batch["num_blocks"], block_size,
                                         num_kv_heads, head_size, dtype, gen, device)
    query = torch.randn(int(batch["query_start_loc"][-1]), num_heads, head_size,
                        generator=gen).to(device, dtype)
    if device != "cpu":
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in batch.items()}
    return query, key_cache, value_cache, batch


def run(fn, query, key_cache, value_cache, batch, scale, tree_mask=None):
    mask = batch["tree_mask"] if tree_mask is None else tree_mask
    return fn(query, key_cache, value_cache, batch["block_table"], batch["seq_lens"],
              batch["query_start_loc"], mask, scale)


def causal_like(batch) -> torch.Tensor:
    """The chain mask over the same step tokens: the wrong mask for a tree."""
    mask = torch.zeros_like(batch["tree_mask"])
    starts = batch["query_start_loc"].tolist()
    for b in range(len(starts) - 1):
        n = starts[b + 1] - starts[b]
        mask[starts[b]:starts[b + 1], :n] = torch.ones(n, n, dtype=torch.bool,
                                                      device=mask.device).tril()
    return mask


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

def accepted_path_slots(gen, block_size, committed, parents, block_table_row):
    """Slots of the deepest root-down path's nodes and the chain slots they move to."""
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        depth[i] = 1 if p < 0 else depth[p] + 1
    node = max(range(len(parents)), key=lambda i: (depth[i], i))  # the deepest, last
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    path.reverse()

    def slot(pos):
        return int(block_table_row[pos // block_size]) * block_size + pos % block_size
    src = [slot(committed + n) for n in path]
    dst = [slot(committed + depth) for depth in range(len(path))]
    return src, dst


def move_reference(cache: torch.Tensor, src, dst) -> torch.Tensor:
    """Read every source from a copy, then write: the contract."""
    block_size = cache.shape[1]
    snapshot = cache.clone()
    out = cache.clone()
    for s, d in zip(src, dst):
        out[d // block_size, d % block_size] = snapshot[s // block_size, s % block_size]
    return out


def move_case(seed, layout, block_size, kv_heads, head_size, dtype=torch.float32,
              device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    batch = make_batch(gen, block_size, [24, 5, 17], [block_size - 3, 50, 0])
    src, dst = [], []
    starts = batch["query_start_loc"].tolist()
    for b, parents in enumerate(batch["parents"]):
        committed = int(batch["seq_lens"][b]) - (starts[b + 1] - starts[b])
        s, d = accepted_path_slots(gen, block_size, committed, parents, batch["block_table"][b])
        src += s
        dst += d
    keys, values = make_caches(layout, batch["num_blocks"], block_size, kv_heads, head_size,
                               dtype, gen, device)
    # Pairs in an order where a kernel that writes as it reads (no staging)
    # overwrites sources it has not read yet, even when run serially: the
    # first of some random orders that does.
    expect = move_reference(keys, src, dst)
    for _ in range(100):
        order = torch.randperm(len(src), generator=gen).tolist()
        shuffled_src, shuffled_dst = [src[i] for i in order], [dst[i] for i in order]
        if not torch.equal(serial_copy(keys, shuffled_src, shuffled_dst), expect):
            return keys, values, shuffled_src, shuffled_dst
    raise AssertionError("no order of the moves clobbers a source: the case tests nothing")


def serial_copy(cache: torch.Tensor, src, dst) -> torch.Tensor:
    """The wrong way: each row written right after it is read."""
    block_size = cache.shape[1]
    out = cache.clone()
    for s, d in zip(src, dst):
        out[d // block_size, d % block_size] = out[s // block_size, s % block_size]
    return out


MOVE_CASES = [
    ("contiguous", 16, 2, 64),
    ("cpu", 32, 4, 128),
    ("cpu", 64, 1, 64),
    ("contiguous", 128, 8, 80),
]


def check_move_kv(impl, layout, block_size, kv_heads, head_size, dtype=torch.float32,
                  device="cpu"):
    keys, values, src, dst = move_case(30 + block_size, layout, block_size, kv_heads, head_size,
                                       dtype, device)
    expect_k, expect_v = move_reference(keys, src, dst), move_reference(values, src, dst)
    fn = kv_move.move_kv_torch if impl == "torch" else kv_move.move_kv_triton
    fn(keys, values, torch.tensor(src, dtype=torch.int32, device=device),
       torch.tensor(dst, dtype=torch.int64, device=device))
    assert torch.equal(keys, expect_k) and torch.equal(values, expect_v)


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


def check_move_kv_layers(impl="triton", layout="cpu", dtype=torch.float32, device="cpu"):
    """Every layer moved by one pair of launches: each layer's caches end as
    the reference leaves them (the layers hold different data)."""
    keys, values, expect = [], [], []
    for layer in range(3):
        k, v, src, dst = move_case(70, layout, 32, 2, 64, dtype, device)
        k.add_(layer)
        v.sub_(layer)
        keys.append(k)
        values.append(v)
        expect.append((move_reference(k, src, dst), move_reference(v, src, dst)))
    fn = kv_move.move_kv_layers if impl == "dispatch" else kv_move.move_kv_layers_triton
    fn(keys, values, torch.tensor(src, device=device), torch.tensor(dst, device=device))
    for k, v, (ek, ev) in zip(keys, values, expect):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_move_kv_layers_refuses_mixed_layers():
    keys = [torch.zeros(2, 16, 2, 64), torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match="share strides and dtype"):
        kv_move.move_kv_layers_triton(keys, keys, torch.tensor([1]), torch.tensor([0]))


def test_move_kv_layers_twin_on_cpu():
    check_move_kv_layers("dispatch")


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
