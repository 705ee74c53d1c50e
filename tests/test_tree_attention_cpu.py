"""The CPU tree attention (``tree_attention_planned``) gives the very bits of
the plain expression: each request's blocks gathered with index_select,
converted to contiguous float32, then baddbmm, softmax and bmm. Its
gathers by runs of consecutive blocks, its reused float32 workspace and the
strided operands it hands the products must not move a single bit, or a
greedy token near a tie could change."""

from __future__ import annotations

import pytest
import torch

from tests.kernel_cases import ancestry, make_caches, random_parents
from vllm_plugins.kernels import tree_attention as ta


def plain_expression(query, key_cache, value_cache, plan, scale, out):
    """Tree attention as it is written most plainly: fresh contiguous float32
    copies of every operand."""
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    keys_by_head = key_cache.permute(2, 3, 0, 1)
    for r in plan.requests:
        query_len = r.last_row - r.first_row
        keys_t = keys_by_head.index_select(2, r.blocks).reshape(num_kv_heads, head_size, -1)
        values = value_cache.index_select(0, r.blocks).reshape(-1, num_kv_heads, head_size)
        q = query[r.first_row:r.last_row].float().reshape(query_len, num_kv_heads, group,
                                                          head_size)
        q = q.permute(1, 2, 0, 3).reshape(num_kv_heads, group * query_len, head_size)
        scores = torch.baddbmm(r.bias.unsqueeze(0), q,
                               keys_t[:, :, :r.seq_len].float().contiguous(), alpha=scale)
        probs = torch.softmax(scores, dim=-1)
        result = torch.bmm(probs, values[:r.seq_len].transpose(0, 1).float().contiguous())
        out[r.first_row:r.last_row] = result.view(num_kv_heads, group, query_len, head_size) \
            .permute(2, 0, 1, 3).reshape(query_len, num_heads, head_size).to(out.dtype)
    return out


def step(gen, blocks_of, query_lens, committed, block_size, num_blocks):
    """(block_table, seq_lens, query_start_loc, tree_mask) with each request's
    blocks as given."""
    seq_lens = [c + q for c, q in zip(committed, query_lens)]
    width = max(len(b) for b in blocks_of) + 1
    table = torch.full((len(blocks_of), width), num_blocks - 1, dtype=torch.int32)
    for i, blocks in enumerate(blocks_of):
        assert len(blocks) == -(-seq_lens[i] // block_size)
        table[i, :len(blocks)] = torch.tensor(blocks)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    mask = torch.zeros(starts[-1], max(query_lens), dtype=torch.bool)
    for i, q in enumerate(query_lens):
        mask[starts[i]:starts[i + 1], :q] = ancestry(random_parents(q, gen))
    return (table, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), mask)


def qkv_query(gen, tokens, heads, kv_heads, head_size, dtype):
    """A query as vLLM's attention gets it: a view of the qkv projection."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_size, generator=gen).to(dtype)
    return qkv[:, :heads * head_size].view(tokens, heads, head_size)


BLOCKS = {
    # blocks of each request (block_size 16, 40 blocks in the cache)
    "consecutive": ([[3, 4, 5]], [17], [30]),
    "one block, partial": ([[9]], [5], [4]),
    "runs": ([[7, 8, 2, 3, 20], [11, 12, 13, 30]], [9, 16], [60, 45]),
    "many runs (index_select)": ([[1, 3, 5, 7, 9, 11, 13]], [13], [90]),
    "a batch": ([[2, 3], [30, 31, 32, 0], [10], [17, 5, 6, 25, 36, 12]], [6, 3, 2, 17],
                [20, 50, 14, 70]),
}


@pytest.mark.parametrize("layout", ["cpu", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("blocks", list(BLOCKS))
def test_planned_gives_the_plain_expressions_bits(layout, dtype, blocks):
    gen = torch.Generator().manual_seed(len(blocks) + (dtype == torch.float32))
    heads, kv_heads, head_size, block_size, num_blocks = 9, 3, 64, 16, 40
    blocks_of, query_lens, committed = BLOCKS[blocks]
    table, seq_lens, starts, mask = step(gen, blocks_of, query_lens, committed, block_size,
                                         num_blocks)
    plan = ta.plan_tree_attention(table, seq_lens, starts, mask, block_size, heads // kv_heads)
    reference_plan = ta.plan_tree_attention(table, seq_lens, starts, mask, block_size,
                                            heads // kv_heads)
    for _ in range(3):  # layers: one plan, its workspace reused
        keys, values = make_caches(layout, num_blocks, block_size, kv_heads, head_size, dtype,
                                   gen)
        query = qkv_query(gen, int(starts[-1]), heads, kv_heads, head_size, dtype)
        got = ta.tree_attention_planned(query, keys, values, plan, 0.125,
                                        torch.zeros_like(query))
        want = plain_expression(query, keys, values, reference_plan, 0.125,
                                torch.zeros_like(query))
        assert torch.equal(got, want)


def test_long_contexts_give_the_plain_expressions_bits():
    """vLLM's CPU block size and contexts of thousands of positions, where
    the products' blocking differs most from short ones."""
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 128, 128, 48
    for committed, query_len, blocks in ((3000, 33, list(range(10, 34))),
                                         (1000, 17, [40, 41, 42, 2, 3, 4, 5, 6]),
                                         (127, 2, [7, 8])):
        table, seq_lens, starts, mask = step(gen, [blocks], [query_len], [committed],
                                             block_size, num_blocks)
        plan = ta.plan_tree_attention(table, seq_lens, starts, mask, block_size, 4)
        keys, values = make_caches("cpu", num_blocks, block_size, kv_heads, head_size,
                                   torch.bfloat16, gen)
        query = qkv_query(gen, query_len, heads, kv_heads, head_size, torch.bfloat16)
        got = ta.tree_attention_planned(query, keys, values, plan, head_size ** -0.5,
                                        torch.zeros_like(query))
        want = plain_expression(query, keys, values, plan, head_size ** -0.5,
                                torch.zeros_like(query))
        assert torch.equal(got, want)


def test_a_plan_serves_layers_of_another_shape():
    """A plan's workspace is made for the first layer's head counts; a layer
    with others gets a workspace of its own shape."""
    gen = torch.Generator().manual_seed(5)
    table, seq_lens, starts, mask = step(gen, [[4, 5]], [6], [20], 16, 8)
    plan = ta.plan_tree_attention(table, seq_lens, starts, mask, 16, 2)
    for kv_heads, head_size in ((2, 32), (1, 64), (2, 32)):
        keys, values = make_caches("cpu", 8, 16, kv_heads, head_size, torch.float32, gen)
        query = torch.randn(6, 2 * kv_heads, head_size, generator=gen)
        got = ta.tree_attention_planned(query, keys, values, plan, 0.3, torch.zeros_like(query))
        want = plain_expression(query, keys, values, plan, 0.3, torch.zeros_like(query))
        assert torch.equal(got, want)


def test_rows_outside_every_request_are_left_alone():
    gen = torch.Generator().manual_seed(6)
    table, seq_lens, starts, mask = step(gen, [[1, 2]], [5], [20], 16, 8)
    plan = ta.plan_tree_attention(table, seq_lens, starts + 3, torch.cat([mask[:3], mask]), 16, 2)
    keys, values = make_caches("cpu", 8, 16, 2, 32, torch.float32, gen)
    query = torch.randn(8, 4, 32, generator=gen)
    out = torch.full_like(query, 7.0)
    ta.tree_attention_planned(query, keys, values, plan, 0.3, out)
    assert torch.equal(out[:3], torch.full_like(out[:3], 7.0))
    assert not torch.equal(out[3:], torch.full_like(out[3:], 7.0))


def test_block_runs():
    assert ta.block_runs([4, 5, 6]) == ((0, 4, 3),)
    assert ta.block_runs([4, 5, 9, 2, 3]) == ((0, 4, 2), (2, 9, 1), (3, 2, 2))
    assert ta.block_runs([7]) == ((0, 7, 1),)
    assert ta.block_runs(list(range(0, 2 * (ta.MAX_RUNS + 1), 2))) is None
