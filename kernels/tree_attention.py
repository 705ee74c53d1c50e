"""Paged attention for one step's draft-tree tokens.

vLLM's attention backends know two shapes of a step: causal (a chain) or
none. A tree step needs each token to see its request's committed prefix,
its ancestors among the step's tokens and itself. This module computes
exactly that over vLLM's paged KV cache, in the logical layout
``[num_blocks, block_size, num_kv_heads, head_size]`` with any strides (the
CUDA flash layout's halves, or the CPU backend's head-major cache seen
through a permuted view).

Per request ``b`` the step's tokens are ``query[query_start_loc[b]:
query_start_loc[b + 1]]`` and their K/V already sit in the cache at the
positions ``seq_lens[b] - query_len .. seq_lens[b] - 1``, in node order.
Row ``t`` of ``tree_mask`` says which of those step positions token ``t``
may see; every committed position is always visible.

``tree_attention_torch`` is the CPU path and the reference for the Triton
kernel; ``tree_attention`` picks the kernel on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_plugins.kernels.triton_support import jit, next_power_of_2, triton, triton_usable

if triton is not None:
    import triton.language as tl
else:
    tl = None


def check_inputs(query, key_cache, value_cache, block_table, seq_lens,
                 query_start_loc, tree_mask, out) -> None:
    """One ValueError naming the argument whose shape does not fit."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_size], got {tuple(query.shape)}")
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"kv_heads, head_size], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    num_heads, head_size = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_size:
        raise ValueError(f"key_cache head_size {key_cache.shape[3]} != query's {head_size}")
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads {num_heads} are not a multiple of kv heads {num_kv_heads}")
    num_reqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_reqs + 1 or block_table.shape[0] != num_reqs:
        raise ValueError(f"query_start_loc must hold {num_reqs + 1} entries and block_table "
                         f"{num_reqs} rows, got {query_start_loc.shape[0]} and "
                         f"{block_table.shape[0]}")
    if tree_mask.dim() != 2 or tree_mask.shape[0] < query.shape[0]:
        raise ValueError(f"tree_mask must be [tokens >= {query.shape[0]}, max_query_len], "
                         f"got {tuple(tree_mask.shape)}")
    if tree_mask.dtype != torch.bool:
        raise ValueError(f"tree_mask must be bool, got {tree_mask.dtype}")
    if out is not None and out.shape != query.shape:
        raise ValueError(f"out must have query's shape {tuple(query.shape)}, got {tuple(out.shape)}")


@dataclass
class RequestAttention:
    """One request of a planned step: its query rows, the cache blocks that
    hold its positions, and what each of its rows may see."""

    first_row: int
    last_row: int           # exclusive
    seq_len: int
    blocks: torch.Tensor    # int64 block ids covering its seq_len positions
    bias: torch.Tensor      # float32 [group * query_len, seq_len]
    # Its blocks as runs of consecutive ids, ((index of the run's first
    # block among the request's, its block id, blocks), ...), each run read
    # as one strided view; None when there are too many runs to pay.
    runs: tuple | None = None


@dataclass
class TreeAttentionPlan:
    """What every layer of a step reads the same way: computed once per step
    from the block table, the sequence lengths and the masks, so a layer
    only gathers its own K/V and multiplies."""

    requests: list[RequestAttention]
    # float32 buffers every layer of the step reuses (``Workspace``), made
    # at its first layer, when the cache's head counts are known.
    workspace: object = None


# More runs of consecutive blocks than this and a request's K/V are gathered
# with index_select and then converted: a run is a copy each for K and V.
MAX_RUNS = 4
# A bias entry: a position the row sees, one it does not.
_VISIBLE, _HIDDEN = np.float32(0.0), np.float32(-np.inf)


def block_runs(blocks: list[int]) -> tuple | None:
    """``RequestAttention.runs`` of a request's blocks."""
    runs = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((start, blocks[start], i - start))
            start = i
    return tuple(runs) if len(runs) <= MAX_RUNS else None


def plan_tree_attention(block_table: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, tree_mask: torch.Tensor,
                        block_size: int, group: int) -> TreeAttentionPlan:
    """Per request: its blocks, and an additive bias (0 visible, -inf not)
    over its rows (query heads of a kv head, then tokens) and its positions:
    every committed position visible, the step's positions by
    ``tree_mask``."""
    starts = query_start_loc.tolist()
    out = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[b], starts[b + 1]
        if q1 > q0:
            out.append(request_attention(q0, seq_len, block_table[b], tree_mask[q0:q1, :q1 - q0],
                                         block_size, group))
    return TreeAttentionPlan(out)


def request_attention(first_row: int, seq_len: int, block_table_row: torch.Tensor,
                      mask: torch.Tensor | np.ndarray, block_size: int,
                      group: int) -> RequestAttention:
    """One request's part of a plan: its step tokens are rows ``first_row``
    on of the query, and ``mask`` [query_len, query_len] (a tensor, or a
    host array) says which of them each sees."""
    query_len = mask.shape[0]
    # Built in numpy, one tensor at the end: each torch call costs tens of
    # microseconds on a CPU whose caches a forward has just evicted.
    if isinstance(mask, torch.Tensor):
        mask = mask.cpu().numpy()
    bias = np.zeros((group, query_len, seq_len), dtype=np.float32)
    bias[:, :, seq_len - query_len:] = np.where(mask, _VISIBLE, _HIDDEN)
    bias = torch.from_numpy(bias.reshape(group * query_len, seq_len))
    if not block_table_row.is_cpu:
        bias = bias.to(block_table_row.device)
    num_blocks = -(-seq_len // block_size)
    blocks = block_table_row[:num_blocks].long()
    return RequestAttention(first_row, first_row + query_len, seq_len, blocks, bias,
                            block_runs(blocks.tolist()))


class Workspace:
    """float32 buffers that every layer of a step reuses, sized for its
    largest request, and each request's views of them, made once: a layer
    then converts its K/V and query straight into them and multiplies into
    them, with no allocation and few views of its own. Requests run one
    after another, so they share the buffers."""

    def __init__(self, plan: TreeAttentionPlan, num_kv_heads: int, head_size: int,
                 block_size: int, device: torch.device):
        self.shape = (num_kv_heads, head_size, block_size, device)
        positions = max(r.blocks.numel() for r in plan.requests) * block_size
        rows = max(r.bias.shape[0] for r in plan.requests)
        seq = max(r.seq_len for r in plan.requests)

        def buffer(n):
            return torch.empty(n, dtype=torch.float32, device=device)

        kv = num_kv_heads * head_size * positions
        rows_d = num_kv_heads * rows * head_size
        buffers = (buffer(kv), buffer(kv), buffer(rows_d), buffer(num_kv_heads * rows * seq),
                   buffer(rows_d))
        self.views = [RequestViews(r, num_kv_heads, head_size, block_size, *buffers)
                      for r in plan.requests]


class RequestViews:
    """One request's views of the workspace. K and V are held whole blocks
    at a time, ``[kv_heads, D, blocks, block_size]`` and ``[kv_heads, blocks,
    block_size, D]``, so a run of consecutive cache blocks is one copy; the
    products read their first seq_len positions through strided views, and
    softmax runs in place on the scores. That gives the bits of the plain
    form on fresh contiguous copies (MKL's sums do not depend on the
    operands' strides): tests/test_tree_attention_cpu.py compares the two
    bit for bit."""

    def __init__(self, r: RequestAttention, num_kv_heads: int, head_size: int,
                 block_size: int, keys, values, query, scores, result):
        query_len = r.last_row - r.first_row
        rows = r.bias.shape[0]
        group = rows // query_len
        seq = r.seq_len
        num_blocks = r.blocks.numel()
        kv = num_kv_heads * head_size * num_blocks * block_size
        self.key_blocks = keys[:kv].view(num_kv_heads, head_size, num_blocks, block_size)
        self.value_blocks = values[:kv].view(num_kv_heads, num_blocks, block_size, head_size)
        self.keys = self.key_blocks.view(num_kv_heads, head_size, -1)[:, :, :seq]
        self.values = self.value_blocks.view(num_kv_heads, -1, head_size)[:, :seq]
        self.key_runs = [self.key_blocks[:, :, first:first + n] for first, _, n in r.runs or ()]
        self.value_runs = [self.value_blocks[:, first:first + n] for first, _, n in r.runs or ()]
        rows_d = num_kv_heads * rows * head_size
        self.query = query[:rows_d].view(num_kv_heads, rows, head_size)
        # row g * query_len + t of kv head k is query head k * group + g of token t
        self.query_in = self.query.view(num_kv_heads, group, query_len, head_size)
        self.scores = scores[:num_kv_heads * rows * seq].view(num_kv_heads, rows, seq)
        self.result = result[:rows_d].view(num_kv_heads, rows, head_size)
        self.result_by_head = self.result.view(num_kv_heads, group, query_len, head_size)
        self.group, self.query_len = group, query_len
        self.bias = r.bias.unsqueeze(0)


def tree_attention_planned(query: torch.Tensor, key_cache: torch.Tensor,
                           value_cache: torch.Tensor, plan: TreeAttentionPlan,
                           scale: float, out: torch.Tensor) -> torch.Tensor:
    """One layer of a planned step: per request, its blocks' K/V converted
    to float32 as they are gathered, then scores, bias, softmax and values
    as three batched matrix operations over [kv_heads, group * query_len,
    positions] in float32.

    Keys are gathered as ``[kv_heads, head_size, positions]``, the order the
    scores' product reads, from the cache permuted to ``[kv_heads,
    head_size, blocks, block_size]``. On vLLM's CPU cache, which stores each
    block's keys transposed, that is a copy of whole contiguous rows, where
    gathering ``[positions, kv_heads, head_size]`` first transposes every
    block and the product then transposes it back."""
    if not plan.requests:
        return out
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    work = plan.workspace
    if work is None or work.shape != (num_kv_heads, head_size, key_cache.shape[1],
                                      query.device):
        work = plan.workspace = Workspace(plan, num_kv_heads, head_size, key_cache.shape[1],
                                          query.device)
    for r, v in zip(plan.requests, work.views):
        gather(key_cache, value_cache, r, v)
        v.query_in.copy_(by_kv_head(query, r.first_row, v.query_len, v.group))
        torch.baddbmm(v.bias, v.query, v.keys, alpha=scale, out=v.scores)
        torch.softmax(v.scores, dim=-1, out=v.scores)
        torch.bmm(v.scores, v.values, out=v.result)
        by_kv_head(out, r.first_row, v.query_len, v.group).copy_(v.result_by_head)
    return out


# The views below are single as_strided calls: on a per-layer path, slicing,
# permuting and unflattening cost a microsecond or two each.

def by_kv_head(tokens: torch.Tensor, first: int, count: int, group: int) -> torch.Tensor:
    """Rows ``first .. first + count`` of a [tokens, heads, D] tensor as
    [kv_heads, group, count, D] (query head h = kv_head * group + g)."""
    t, h, d = tokens.stride()
    return tokens.as_strided((tokens.shape[1] // group, group, count, tokens.shape[2]),
                             (group * h, h, t, d), tokens.storage_offset() + first * t)


def key_blocks(key_cache: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """Blocks ``block .. block + count`` of [blocks, block_size, kv_heads, D]
    keys as [kv_heads, D, count, block_size]."""
    b, p, h, d = key_cache.stride()
    return key_cache.as_strided((key_cache.shape[2], key_cache.shape[3], count,
                                 key_cache.shape[1]), (h, d, b, p),
                                key_cache.storage_offset() + block * b)


def value_blocks(value_cache: torch.Tensor, block: int, count: int) -> torch.Tensor:
    """Blocks ``block .. block + count`` of [blocks, block_size, kv_heads, D]
    values as [kv_heads, count, block_size, D]."""
    b, p, h, d = value_cache.stride()
    return value_cache.as_strided((value_cache.shape[2], count, value_cache.shape[1],
                                   value_cache.shape[3]), (h, b, p, d),
                                  value_cache.storage_offset() + block * b)


def gather(key_cache: torch.Tensor, value_cache: torch.Tensor, r: RequestAttention,
           v: RequestViews) -> None:
    """The request's K and V blocks into ``v``'s float32 buffers,
    ``[kv_heads, D, blocks, block_size]`` and ``[kv_heads, blocks,
    block_size, D]``: a strided copy a run of consecutive blocks, converting
    as it reads; else one index_select each and a copy."""
    if r.runs is None:
        v.key_blocks.copy_(key_cache.permute(2, 3, 0, 1).index_select(2, r.blocks))
        v.value_blocks.copy_(value_cache.permute(2, 0, 1, 3).index_select(1, r.blocks))
        return
    for (_, block, n), keys, values in zip(r.runs, v.key_runs, v.value_runs):
        keys.copy_(key_blocks(key_cache, block, n))
        values.copy_(value_blocks(value_cache, block, n))


def tree_attention_torch(query: torch.Tensor, key_cache: torch.Tensor,
                         value_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                         tree_mask: torch.Tensor, scale: float,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: ``plan_tree_attention`` then ``tree_attention_planned``
    (an engine plans once per step and runs every layer on the plan).
    Token rows outside every request are left as they are in ``out`` (zero
    when ``out`` is None)."""
    check_inputs(query, key_cache, value_cache, block_table, seq_lens,
                 query_start_loc, tree_mask, out)
    if out is None:
        out = torch.zeros_like(query)
    group = query.shape[1] // key_cache.shape[2]
    plan = plan_tree_attention(block_table, seq_lens, query_start_loc, tree_mask,
                               key_cache.shape[1], group)
    return tree_attention_planned(query, key_cache, value_cache, plan, scale, out)


def _tree_attention_kernel_fn(
    out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, mask_ptr,
    part_acc_ptr, part_max_ptr, part_sum_ptr,
    scale, block_size, num_splits,
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_kb, stride_ko, stride_kh, stride_kd,
    stride_vb, stride_vo, stride_vh, stride_vd,
    stride_bt, stride_mt, stride_mj,
    stride_ps, stride_pt, stride_ph,
    GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr,
):
    """One program per (request, block of BLOCK_Q step tokens, kv head, key
    split): its BLOCK_M rows are those tokens times the kv head's GROUP query
    heads, so every K/V tile is loaded once for all of them. Online softmax
    in float32 over the split's share of the request's positions in tiles of
    TILE, each position's block looked up in the block table (any cache block
    size). With SPLIT, each split leaves its running max, sum and unscaled
    values in the part buffers (float32 ``[splits, tokens, heads(, D)]``)
    for ``_combine_splits``; without, the one split writes ``out``."""
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2) // num_splits
    split = tl.program_id(2) % num_splits
    q_start = tl.load(query_start_ptr + req)
    query_len = tl.load(query_start_ptr + req + 1) - q_start
    if q_block * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + req)
        committed = seq_len - query_len
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TILE) * TILE
        split_start = split * split_len
        split_end = tl.minimum(split_start + split_len, seq_len)

        rows = tl.arange(0, BLOCK_M)
        q_local = q_block * BLOCK_Q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (q_local < query_len)
        token = q_start + q_local
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_SIZE

        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                    + d[None, :] * stride_qd,
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

        for tile_start in range(split_start, split_end, TILE):
            pos = tile_start + tl.arange(0, TILE)
            pos_ok = pos < split_end
            block = tl.load(block_table_ptr + req * stride_bt + pos // block_size,
                            mask=pos_ok, other=0).to(tl.int64)
            offset = pos % block_size
            k = tl.load(k_ptr + block[None, :] * stride_kb + offset[None, :] * stride_ko
                        + kv_head * stride_kh + d[:, None] * stride_kd,
                        mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            step_pos = pos - committed
            in_step = (step_pos >= 0) & pos_ok
            seen = tl.load(mask_ptr + token[:, None] * stride_mt + step_pos[None, :] * stride_mj,
                           mask=row_ok[:, None] & in_step[None, :], other=0)
            allowed = ((pos < committed)[None, :] | (seen != 0)) & pos_ok[None, :]
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vo
                        + kv_head * stride_vh + d[None, :] * stride_vd,
                        mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        if SPLIT:
            part = split * stride_ps + token * stride_pt + head * stride_ph
            tl.store(part_max_ptr + part, m_i, mask=row_ok)
            tl.store(part_sum_ptr + part, l_i, mask=row_ok)
            tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :], acc,
                     mask=row_ok[:, None] & d_ok[None, :])
        else:
            l_i = tl.where(l_i > 0, l_i, 1.0)
            acc = acc / l_i[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                     + d[None, :] * stride_od,
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _combine_splits_fn(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, query_start_ptr, num_reqs, num_splits,
    stride_ot, stride_oh, stride_od, stride_ps, stride_pt, stride_ph,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One program per (token, head): the splits' partial softmaxes merged
    (each rescaled to the largest running max), for tokens inside a request."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    first = tl.load(query_start_ptr)
    last = tl.load(query_start_ptr + num_reqs)
    if (token >= first) & (token < last):
        sp = tl.arange(0, SPLITS_PAD)
        sp_ok = sp < num_splits
        d = tl.arange(0, HEAD_PAD)
        d_ok = d < HEAD_SIZE
        part = sp * stride_ps + token * stride_pt + head * stride_ph
        m = tl.load(part_max_ptr + part, mask=sp_ok, other=-1.0e30)
        l = tl.load(part_sum_ptr + part, mask=sp_ok, other=0.0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + d[None, :],
                      mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
        weight = tl.exp(m - tl.max(m, 0))
        total = tl.sum(weight * l, 0)
        total = tl.where(total > 0, total, 1.0)
        result = tl.sum(weight[:, None] * acc, 0) / total
        tl.store(out_ptr + token * stride_ot + head * stride_oh + d * stride_od,
                 result.to(out_ptr.dtype.element_ty), mask=d_ok)


_tree_attention_kernel = jit(_tree_attention_kernel_fn)
_combine_splits = jit(_combine_splits_fn)

# Programs per multiprocessor that the automatic key split aims for, and
# the fewest key tiles a split keeps: a split's merge is a second launch,
# which short contexts do not repay (docs/benchmarks.md, tree kernels on a
# GPU).
_PROGRAMS_PER_SM = 4
_MIN_TILES_PER_SPLIT = 16
_sm_counts: dict = {}


def _multiprocessors(device: torch.device) -> int:
    if device not in _sm_counts:
        _sm_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _sm_counts[device]


def launch_shape(max_query_len: int, group: int, rows: int | None = None,
                 num_warps: int | None = None) -> tuple[int, int, int | None]:
    """(step tokens, rows, warps) per program. Rows are the tokens of one
    block times the group's query heads: at least 16 (tl.dot's smallest
    tile), at most ``rows``. By default 128 rows on 8 warps once the step's
    rows fill them (each K/V tile is then loaded once for twice the rows;
    docs/benchmarks.md has the launch table), else 64 on Triton's default
    warps."""
    if rows is None:
        rows = 128 if max_query_len * group > 64 else 64
        if num_warps is None and rows == 128:
            num_warps = 8
    block_q = max(1, min(next_power_of_2(max_query_len), max(rows // group, 1)))
    return block_q, max(16, next_power_of_2(block_q * group)), num_warps


def auto_splits(num_reqs: int, max_query_len: int, group: int, num_kv_heads: int,
                max_seq_len: int, tile: int, device: torch.device,
                rows: int | None = None) -> int:
    """How many ways to split each request's keys: enough programs to fill
    the GPU a few times over (a batch-1 step has few tokens and kv heads, so
    one program per head would leave most multiprocessors idle over a long
    context), each split long enough to pay for the merge. One on the CPU."""
    if device.type != "cuda":
        return 1
    block_q = launch_shape(max_query_len, group, rows)[0]
    programs = num_reqs * -(-max_query_len // block_q) * num_kv_heads
    wanted = -(-_PROGRAMS_PER_SM * _multiprocessors(device) // max(programs, 1))
    return max(1, min(wanted, max_seq_len // (_MIN_TILES_PER_SPLIT * tile)))


def tree_attention_triton(query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                          tree_mask: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None, *,
                          max_query_len: int | None = None, max_seq_len: int | None = None,
                          tile: int = 32, splits: int | None = None,
                          rows: int | None = None, num_warps: int | None = None,
                          num_stages: int | None = None) -> torch.Tensor:
    """The Triton kernel; same contract as ``tree_attention_torch``.
    ``max_query_len`` and ``max_seq_len`` (the step's longest request and
    sequence) save a device sync each when the caller knows them; ``tile``
    is the number of key positions per iteration (a power of two >= 16);
    ``splits`` the number of ways each request's keys are split across
    programs (None: ``auto_splits``), merged by a second kernel; ``rows``
    the most query rows (tokens times the group's heads) a program holds
    and ``num_warps`` its warps (None: ``launch_shape``); ``num_stages``
    goes to Triton (None: its default)."""
    check_inputs(query, key_cache, value_cache, block_table, seq_lens,
                 query_start_loc, tree_mask, out)
    if tile < 16 or tile & (tile - 1):
        raise ValueError(f"tile must be a power of two >= 16, got {tile}")
    if splits is not None and splits < 1:
        raise ValueError(f"splits must be at least 1, got {splits}")
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.zeros_like(query)
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if num_reqs else 0
    if num_reqs == 0 or max_query_len == 0:
        return out
    block_q, block_m, num_warps = launch_shape(max_query_len, group, rows, num_warps)
    head_pad = max(16, next_power_of_2(head_size))
    q_blocks = -(-max_query_len // block_q)
    if splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        splits = auto_splits(num_reqs, max_query_len, group, num_kv_heads, max_seq_len, tile,
                             query.device, rows)
    if splits > 1:
        part_acc = torch.empty(splits, num_tokens, num_heads, head_pad, dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
    else:  # never read: the kernel writes out directly
        part_acc = part_max = part_sum = out
    mask_bytes = tree_mask.view(torch.uint8)
    _tree_attention_kernel[(num_reqs, q_blocks, num_kv_heads * splits)](
        out, query, key_cache, value_cache, block_table, seq_lens, query_start_loc, mask_bytes,
        part_acc, part_max, part_sum,
        float(scale), block_size, splits,
        *query.stride(), *out.stride(), *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), *mask_bytes.stride(), *part_max.stride()[:3],
        GROUP=group, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile,
        IEEE=query.dtype == torch.float32, SPLIT=splits > 1,
        **{k: v for k, v in (("num_warps", num_warps), ("num_stages", num_stages))
           if v is not None},
    )
    if splits > 1:
        _combine_splits[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, num_reqs, splits,
            *out.stride(), *part_max.stride(),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad, SPLITS_PAD=next_power_of_2(splits),
        )
    return out


def tree_attention(query: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, block_table: torch.Tensor,
                   seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                   tree_mask: torch.Tensor, scale: float,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel for CUDA tensors when Triton is installed, else the
    torch twin (the CPU engine's path)."""
    fn = tree_attention_triton if query.is_cuda and triton_usable(query) else tree_attention_torch
    return fn(query, key_cache, value_cache, block_table, seq_lens, query_start_loc,
              tree_mask, scale, out)
