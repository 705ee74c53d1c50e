"""Whether a Triton kernel can run here.

Triton chooses between compiling and interpreting when a function is wrapped
by ``triton.jit``, its own standard library (``tl.max``, ``tl.sum``) included,
so ``TRITON_INTERPRET=1`` takes effect only if it is set before Triton is
first imported in the process (the kernel tests start a fresh process for
that). Without Triton installed, the torch twins still work.
"""

from __future__ import annotations

try:
    import triton
except ImportError:  # the CPU install may lack Triton; the twins need none
    triton = None


def interpreting() -> bool:
    """True when Triton runs kernels in its numpy interpreter (CPU tensors)."""
    return triton is not None and bool(triton.knobs.runtime.interpret)


def triton_usable(tensor) -> bool:
    """Whether a Triton kernel can run on ``tensor``: a CUDA tensor with
    Triton installed, or any tensor under the interpreter."""
    return triton is not None and (bool(tensor.is_cuda) or interpreting())


def jit(fn):
    """``triton.jit(fn)``, or None without Triton (the kernel is then never
    called: the dispatchers take the twin)."""
    return None if triton is None else triton.jit(fn)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()
