"""Random paged caches, block tables, trees and accepted paths for the kernel
tests (tests/test_kernels.py on CPU, tests/test_kernels_cuda.py on a GPU),
with the plain references they are checked against."""

from __future__ import annotations

import torch

from vllm_plugins.kernels import kv_move
from vllm_plugins.kernels.cache_layout import cpu_cache_views


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


def copied_rows(cache: torch.Tensor, src, dst, *, read_first: bool) -> torch.Tensor:
    """The cache after copying slot ``src[i]`` to ``dst[i]`` in order, reading
    every source before any write (``read_first``) or each right before its
    write."""
    block_size = cache.shape[1]
    out = cache.clone()
    read = cache.clone() if read_first else out
    for s, d in zip(src, dst):
        out[d // block_size, d % block_size] = read[s // block_size, s % block_size]
    return out


def move_reference(cache: torch.Tensor, src, dst) -> torch.Tensor:
    """Read every source, then write: the contract."""
    return copied_rows(cache, src, dst, read_first=True)


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
    return copied_rows(cache, src, dst, read_first=False)


def check_move_kv(impl, layout, block_size, kv_heads, head_size, dtype=torch.float32,
                  device="cpu"):
    keys, values, src, dst = move_case(30 + block_size, layout, block_size, kv_heads, head_size,
                                       dtype, device)
    expect_k, expect_v = move_reference(keys, src, dst), move_reference(values, src, dst)
    fn = kv_move.move_kv_torch if impl == "torch" else kv_move.move_kv_triton
    fn(keys, values, torch.tensor(src, dtype=torch.int32, device=device),
       torch.tensor(dst, dtype=torch.int64, device=device))
    assert torch.equal(keys, expect_k) and torch.equal(values, expect_v)


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
