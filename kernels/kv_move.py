"""Move the accepted path's K/V from node slots into chain slots.

A tree step writes node ``i``'s K/V at the slot of position ``committed + i``;
after acceptance the path's nodes must sit where chain decoding would have
put them (positions ``committed, committed + 1, ...``), so the cache is what
plain decoding leaves. A destination can be another path node's source
(nodes 0, 2, 5 move to positions 0, 1, 2: position 2 is node 2's source), so
every source is read before any destination is written.

Slots are ``block * block_size + offset`` in one layer's
``[num_blocks, block_size, kv_heads, head_size]`` caches (any strides), all
non-negative; destinations are distinct.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_plugins.kernels.triton_support import jit, next_power_of_2, triton, triton_usable

if triton is not None:
    import triton.language as tl
else:
    tl = None


def _check(key_cache, value_cache, src_slots, dst_slots) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"kv_heads, head_size], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    if src_slots.shape != dst_slots.shape or src_slots.dim() != 1:
        raise ValueError(f"src_slots and dst_slots must be 1-D of one length, got "
                         f"{tuple(src_slots.shape)} and {tuple(dst_slots.shape)}")


def move_kv_torch(key_cache: torch.Tensor, value_cache: torch.Tensor,
                  src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """The CPU path: gather every source row (a copy), then write them all."""
    _check(key_cache, value_cache, src_slots, dst_slots)
    if src_slots.numel() == 0:
        return
    block_size = key_cache.shape[1]
    src = src_slots.long()
    dst = dst_slots.long()
    src_block, src_offset = src // block_size, src % block_size
    dst_block, dst_offset = dst // block_size, dst % block_size
    for cache in (key_cache, value_cache):
        rows = cache[src_block, src_offset]  # advanced indexing copies
        cache[dst_block, dst_offset] = rows


def _copy_head_row_fn(
    src_k, src_v, dst_k, dst_v, src_index_ptr, dst_index_ptr,
    src_block_size, dst_block_size,
    s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
    d_kb, d_ko, d_kh, d_kd, d_vb, d_vo, d_vh, d_vd,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """The program's row (axis 0) and kv head (axis 1): its key and value
    from slot ``src_index[row]`` of the source caches to slot
    ``dst_index[row]`` of the destination caches."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    d = tl.arange(0, HEAD_PAD)
    d_ok = d < HEAD_SIZE
    src = tl.load(src_index_ptr + row).to(tl.int64)
    dst = tl.load(dst_index_ptr + row).to(tl.int64)
    sb, so = src // src_block_size, src % src_block_size
    db, do = dst // dst_block_size, dst % dst_block_size
    k = tl.load(src_k + sb * s_kb + so * s_ko + head * s_kh + d * s_kd, mask=d_ok)
    v = tl.load(src_v + sb * s_vb + so * s_vo + head * s_vh + d * s_vd, mask=d_ok)
    tl.store(dst_k + db * d_kb + do * d_ko + head * d_kh + d * d_kd, k, mask=d_ok)
    tl.store(dst_v + db * d_vb + do * d_vo + head * d_vh + d * d_vd, v, mask=d_ok)


_copy_head_row = jit(_copy_head_row_fn)


def _move_rows_kernel_fn(
    src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_index_ptr, dst_index_ptr,
    src_block_size, dst_block_size,
    s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
    d_kb, d_ko, d_kh, d_kd, d_vb, d_vo, d_vh, d_vd,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """One program per (row, kv head): copy one head's key and value row from
    ``src[src_index[row]]`` to ``dst[dst_index[row]]``; both sides are paged
    ``[blocks, block_size, heads, head_size]`` tensors (a staging buffer is
    one with block size 1)."""
    _copy_head_row(
        src_k_ptr, src_v_ptr, dst_k_ptr, dst_v_ptr, src_index_ptr, dst_index_ptr,
        src_block_size, dst_block_size,
        s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
        d_kb, d_ko, d_kh, d_kd, d_vb, d_vo, d_vh, d_vd, HEAD_SIZE, HEAD_PAD)


_move_rows_kernel = jit(_move_rows_kernel_fn)


def move_kv_triton(key_cache: torch.Tensor, value_cache: torch.Tensor,
                   src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Two launches of one copy kernel on the same stream: sources into a
    staging buffer, then the buffer into the destinations, so no program can
    overwrite a source another has not read yet."""
    _check(key_cache, value_cache, src_slots, dst_slots)
    count = src_slots.numel()
    if count == 0:
        return
    _, block_size, num_kv_heads, head_size = key_cache.shape
    staged_k = key_cache.new_empty(count, 1, num_kv_heads, head_size)
    staged_v = value_cache.new_empty(count, 1, num_kv_heads, head_size)
    rows = torch.arange(count, dtype=torch.int32, device=src_slots.device)
    head_pad = next_power_of_2(head_size)
    for src_k, src_v, dst_k, dst_v, src_index, dst_index, src_bs, dst_bs in (
            (key_cache, value_cache, staged_k, staged_v, src_slots, rows, block_size, 1),
            (staged_k, staged_v, key_cache, value_cache, rows, dst_slots, 1, block_size)):
        _move_rows_kernel[(count, num_kv_heads)](
            src_k, src_v, dst_k, dst_v, src_index, dst_index, src_bs, dst_bs,
            *src_k.stride(), *src_v.stride(), *dst_k.stride(), *dst_v.stride(),
            HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        )


def _move_layer_rows_kernel_fn(
    src_ptrs, dst_ptrs, src_index_ptr, dst_index_ptr, dtype_ptr,
    src_block_size, dst_block_size,
    s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
    d_kb, d_ko, d_kh, d_kd, d_vb, d_vo, d_vh, d_vd,
    HEAD_SIZE: tl.constexpr, HEAD_PAD: tl.constexpr,
):
    """One program per (row, kv head, layer): like ``_move_rows_kernel_fn``,
    with each layer's key and value base addresses read from the int64
    tables ``src_ptrs`` and ``dst_ptrs`` (``[layers, 2]``), so one launch
    serves every layer; ``dtype_ptr`` only names the element type."""
    layer = tl.program_id(2)
    ty = tl.pointer_type(dtype_ptr.dtype.element_ty)
    _copy_head_row(
        tl.load(src_ptrs + layer * 2).to(ty), tl.load(src_ptrs + layer * 2 + 1).to(ty),
        tl.load(dst_ptrs + layer * 2).to(ty), tl.load(dst_ptrs + layer * 2 + 1).to(ty),
        src_index_ptr, dst_index_ptr, src_block_size, dst_block_size,
        s_kb, s_ko, s_kh, s_kd, s_vb, s_vo, s_vh, s_vd,
        d_kb, d_ko, d_kh, d_kd, d_vb, d_vo, d_vh, d_vd, HEAD_SIZE, HEAD_PAD)


_move_layer_rows_kernel = jit(_move_layer_rows_kernel_fn)


def move_kv_layers_triton(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                          src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """``move_kv_triton`` for every layer at once: two launches in all
    (sources into a staging buffer, then into the destinations) instead of
    two per layer, whose host-side cost a step would otherwise pay once per
    layer. Every layer's key cache must have the first one's shape, strides
    and dtype, and likewise its value cache."""
    if not key_caches:
        return
    first_k, first_v = key_caches[0], value_caches[0]
    for k, v in zip(key_caches, value_caches):
        _check(k, v, src_slots, dst_slots)
        if k.shape != first_k.shape or k.stride() != first_k.stride() \
                or v.stride() != first_v.stride() or k.dtype != first_k.dtype \
                or v.dtype != first_k.dtype:
            raise ValueError("every layer's key and value caches must share strides and "
                             f"dtype, got {k.stride()} {v.stride()} {k.dtype} {v.dtype} "
                             f"against {first_k.stride()} {first_v.stride()} {first_k.dtype}")
    count = src_slots.numel()
    if count == 0:
        return
    layers = len(key_caches)
    _, block_size, num_kv_heads, head_size = first_k.shape
    device = first_k.device
    staged = first_k.new_empty(layers, 2, count, 1, num_kv_heads, head_size)
    cache_ptrs = torch.tensor([[k.data_ptr(), v.data_ptr()]
                               for k, v in zip(key_caches, value_caches)], dtype=torch.int64)
    staged_ptrs = torch.tensor([[staged[i, 0].data_ptr(), staged[i, 1].data_ptr()]
                                for i in range(layers)], dtype=torch.int64)
    cache_ptrs = cache_ptrs.to(device, non_blocking=True)
    staged_ptrs = staged_ptrs.to(device, non_blocking=True)
    rows = torch.arange(count, dtype=torch.int32, device=device)
    staged_strides = staged[0, 0].stride() * 2  # keys' and values' (the same)
    cache_strides = first_k.stride() + first_v.stride()
    head_pad = next_power_of_2(head_size)
    for src_ptrs, dst_ptrs, src_index, dst_index, src_bs, dst_bs, src_st, dst_st in (
            (cache_ptrs, staged_ptrs, src_slots, rows, block_size, 1, cache_strides,
             staged_strides),
            (staged_ptrs, cache_ptrs, rows, dst_slots, 1, block_size, staged_strides,
             cache_strides)):
        _move_layer_rows_kernel[(count, num_kv_heads, layers)](
            src_ptrs, dst_ptrs, src_index, dst_index, first_k, src_bs, dst_bs,
            *src_st, *dst_st, HEAD_SIZE=head_size, HEAD_PAD=head_pad,
        )


def move_kv_layers(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                   src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Every layer's move: one pair of launches on CUDA with Triton, else the
    twin layer by layer."""
    if key_caches and key_caches[0].is_cuda and triton_usable(key_caches[0]):
        move_kv_layers_triton(key_caches, value_caches, src_slots, dst_slots)
        return
    for key_cache, value_cache in zip(key_caches, value_caches):
        move_kv_torch(key_cache, value_cache, src_slots, dst_slots)


# Integer dtypes by element size: a host cache's elements are moved as bits.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def host_elements(cache: torch.Tensor):
    """A contiguous CPU cache tensor's elements as a flat numpy array of
    integers of their size (its memory, viewed; numpy has no bfloat16), or
    None where it cannot be viewed so."""
    bits = _BITS.get(cache.element_size())
    if bits is None or not cache.is_cpu or not cache.is_contiguous():
        return None
    return cache.view(bits).numpy().reshape(-1)


def host_layout(base: torch.Tensor, key_cache: torch.Tensor,
                value_cache: torch.Tensor) -> tuple:
    """What ``_slot_layout`` reads of a layer's views: layers alike share
    it."""
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("key_cache and value_cache must both be [num_blocks, block_size, "
                         f"kv_heads, head_size], got {tuple(key_cache.shape)} and "
                         f"{tuple(value_cache.shape)}")
    return (tuple(key_cache.shape), key_cache.stride(), value_cache.stride(),
            key_cache.storage_offset() - base.storage_offset(),
            value_cache.storage_offset() - base.storage_offset())


class HostLayers:
    """``move_kv_host``'s layers, prepared once: grouped by layout (layers
    alike share where a slot's elements sit), each group's element arrays
    in one tuple that one compiled call walks. A runner's caches live as
    long as its engine, so the bridge keeps this: a tree step's move is
    then one call per layout, not numpy index operations per layer."""

    def __init__(self, layers):
        groups: dict = {}
        for *_, flat, layout in layers:
            groups.setdefault(layout, []).append(flat)
        self.groups = [(_slot_layout(layout), tuple(flats)) for layout, flats in groups.items()]

    def warm_up(self) -> None:
        """Compile (or load from numba's cache) the move for these layers'
        count and element size, moving nothing: before a runner's first tree
        step rather than inside it."""
        none = np.zeros(0, np.int64)
        move = compiled_move()
        for (block_size, kv_heads, head_size, strides, starts), flats in self.groups:
            move(flats, none, none, block_size, kv_heads, head_size, strides, starts,
                 np.empty(0, flats[0].dtype))


def _slot_layout(layout: tuple) -> tuple:
    """``host_layout``'s tuple as ``_move_slots`` reads it: (block_size,
    kv_heads, head_size, element strides [2, 4] of the key and value views,
    their first elements [2] within the base)."""
    shape, key_stride, value_stride, key_start, value_start = layout
    return (shape[1], shape[2], shape[3], np.array([key_stride, value_stride], np.int64),
            np.array([key_start, value_start], np.int64))


def move_kv_host(layers, src_slots, dst_slots) -> None:
    """``move_kv_layers`` on CPU caches as moves of their memory: per layer
    every source element is read, then every destination written (a
    destination may be another pair's source). ``layers``: a ``HostLayers``,
    or (base, key_cache, value_cache, ``host_elements(base)``,
    ``host_layout`` of them) per layer, the caches views of base."""
    src_slots = np.asarray(src_slots, np.int64)
    dst_slots = np.asarray(dst_slots, np.int64)
    if src_slots.shape != dst_slots.shape or src_slots.ndim != 1:
        raise ValueError(f"src_slots and dst_slots must be 1-D of one length, got "
                         f"{src_slots.shape} and {dst_slots.shape}")
    if len(src_slots) == 0:
        return
    if not isinstance(layers, HostLayers):
        layers = HostLayers(layers)
    move = compiled_move()
    for (block_size, kv_heads, head_size, strides, starts), flats in layers.groups:
        buffer = np.empty(len(src_slots) * 2 * kv_heads * head_size, flats[0].dtype)
        move(flats, src_slots, dst_slots, block_size, kv_heads, head_size, strides, starts,
             buffer)


@functools.cache
def compiled_move():
    """``_move_slots`` compiled (or loaded from numba's cache), at first use:
    the bridge imports this module in every vLLM process, where numba must
    not load before the bridge's patches are on (and not at all in a process
    whose vLLM the bridge steps aside from)."""
    from vllm_plugins.proposers.jit import cached_njit

    return cached_njit(_move_slots)


def _move_slots(flats, src, dst, block_size, kv_heads, head_size, strides, starts, buffer):
    """Each array of ``flats``: the key and value elements of ``src`` slots
    to ``dst`` slots (``_slot_layout``), all read into ``buffer`` before any
    is written."""
    for flat in flats:
        for write in range(2):
            slots = dst if write else src
            j = 0
            for i in range(slots.shape[0]):
                block, offset = divmod(slots[i], block_size)
                for c in range(2):
                    row = starts[c] + block * strides[c, 0] + offset * strides[c, 1]
                    for h in range(kv_heads):
                        at = row + h * strides[c, 2]
                        step = strides[c, 3]
                        if write:
                            for d in range(head_size):
                                flat[at + d * step] = buffer[j + d]
                        else:
                            for d in range(head_size):
                                buffer[j + d] = flat[at + d * step]
                        j += head_size


def move_kv(key_cache: torch.Tensor, value_cache: torch.Tensor,
            src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """The Triton kernel for CUDA caches when Triton is installed, else the
    torch twin."""
    fn = move_kv_triton if key_cache.is_cuda and triton_usable(key_cache) else move_kv_torch
    fn(key_cache, value_cache, src_slots, dst_slots)
