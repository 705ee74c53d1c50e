"""Many state arrays as one argument of a compiled call.

After a forward has evicted the caches, entering a compiled call costs by
its arguments: numba types and unboxes each from its Python object, and a
call taking thirty-odd arrays costs about five times one taking a few
(some 27 us against 6 us on a 2-core EPYC). A controller's state and a
merger's or tree builder's buffers live as long as their owner, so they
travel as one int64 table of their addresses and shapes, made when the
arrays are (re)made, and the kernel reads each through ``vec`` or ``mat``
with the dtype its layout declares.

The table holds raw addresses: an ``ArrayTable`` keeps its arrays alive,
and its owner makes a new one whenever it replaces any of them.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from vllm_plugins.proposers.jit import cached_njit

#: A table row: the array's address, its first and second dimension (1 for a vector).
ADDRESS, ROWS, COLS = 0, 1, 2


class ArrayTable:
    """``arrays`` (None: absent, never read) checked against ``layout``, one
    (dtype, dimensions) per array, as the kernel reads them."""

    __slots__ = ("arrays", "table")

    def __init__(self, arrays: Sequence[np.ndarray | None], layout: Sequence[tuple]):
        if len(arrays) != len(layout):
            raise ValueError(f"{len(arrays)} arrays for a layout of {len(layout)}")
        table = np.zeros((len(arrays), 3), np.int64)
        for i, (a, (dtype, ndim)) in enumerate(zip(arrays, layout)):
            if a is None:
                continue
            if (not isinstance(a, np.ndarray) or a.dtype != np.dtype(dtype) or a.ndim != ndim
                    or not a.flags.c_contiguous):
                got = (f"{a.dtype}, {a.ndim} dimensions, C-contiguous {a.flags.c_contiguous}"
                       if isinstance(a, np.ndarray) else type(a).__name__)
                raise ValueError(f"array {i}: the kernel reads {np.dtype(dtype)} in {ndim} "
                                 f"dimensions (C-contiguous); got {got}")
            table[i] = a.ctypes.data, a.shape[0], a.shape[1] if ndim == 2 else 1
        self.arrays = tuple(arrays)   # alive as long as the table
        self.table = table

    def __reduce__(self):
        # A copy's addresses would still be the originals' arrays.
        raise TypeError("an ArrayTable holds its arrays' addresses and is not copied; "
                        "build one over the copied arrays")


@intrinsic
def _pointer(typingctx, address):
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(address), codegen


@cached_njit(inline="always")
def vec(table, i, dtype):
    """Row ``i`` of ``table`` as the vector it points at."""
    return carray(_pointer(table[i, ADDRESS]), (table[i, ROWS],), dtype)


@cached_njit(inline="always")
def mat(table, i, dtype):
    """Row ``i`` of ``table`` as the matrix it points at."""
    return carray(_pointer(table[i, ADDRESS]), (table[i, ROWS], table[i, COLS]), dtype)
