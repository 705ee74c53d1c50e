"""The kernels' logical view of vLLM's CPU attention cache.

The kernels read a paged cache as ``[num_blocks, block_size, kv_heads,
head_size]`` with any strides. vLLM's CPU backend keeps one layer's cache as
``[num_blocks, kv_heads, block_size, 2 * head_size]``: per block and head, the
first half holds the keys transposed (``[head_size, block_size]``, what its
``vec``/``vec16`` kernels read) and the second half the values
(``[block_size, head_size]``). Both halves are plain strided views of that
tensor, so the kernels read and write the engine's cache in place.
``tests/test_kernels.py`` checks these views against what vLLM's own cache
writer stores. The backend picks a kernel ISA per attention group
(``vllm.v1.attention.backends.cpu_attn._get_attn_isa``), and each ISA's cache
writer may pack K/V its own way: ``amx`` (bfloat16 on CPUs with AMX tiles)
packs keys in an order no strided view describes, ``neon`` packs bfloat16
for BFMMLA, and ``rvv``, ``vxe`` and ``vsx`` were never checked. So the views
are allowed only on the ISAs in ``VIEWED_ISAS``, each checked against vLLM's
writer for every cache dtype (``tests/test_cache_layouts.py``).
"""

from __future__ import annotations

import torch


def cpu_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key_cache, value_cache), each ``[num_blocks, block_size, kv_heads,
    head_size]``, viewing a CPU backend cache ``[num_blocks, kv_heads,
    block_size, 2 * head_size]`` without copying."""
    if kv_cache.dim() != 4 or kv_cache.shape[3] % 2 or not kv_cache.is_contiguous():
        raise ValueError("kv_cache must be a contiguous [num_blocks, kv_heads, block_size, "
                         f"2 * head_size] tensor, got {tuple(kv_cache.shape)}")
    num_blocks, num_kv_heads, block_size, twice_head = kv_cache.shape
    head_size = twice_head // 2
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, head_size)
    key_half, value_half = halves.chunk(2, dim=2)  # each [blocks, heads, block_size, head]
    block_stride, head_stride = key_half.stride(0), key_half.stride(1)
    key_cache = key_half.as_strided(
        (num_blocks, block_size, num_kv_heads, head_size),
        (block_stride, 1, head_stride, block_size))
    value_cache = value_half.permute(0, 2, 1, 3)
    return key_cache, value_cache


#: vLLM CPU attention ISAs whose K/V layout ``cpu_cache_views`` reads, each
#: tested against vLLM's own cache writer (a positive list: an ISA vLLM adds
#: is refused until it is tested).
VIEWED_ISAS = ("vec", "vec16")


def layout_refusal(isa: str) -> str | None:
    """Why the views cannot read a cache written by ``isa``'s kernels, or None."""
    if isa in VIEWED_ISAS:
        return None
    return (f"tree drafts cannot read the CPU backend's '{isa}' K/V cache layout "
            f"(they read the layouts of {', '.join(VIEWED_ISAS)} only)")
