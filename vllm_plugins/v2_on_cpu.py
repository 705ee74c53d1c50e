"""Model Runner V2 on a CPU, for tests and benchmarks only.

vLLM's CPU build enables Triton, and with it Model Runner V2, only when
Triton reports a ``cpu`` backend (``vllm.triton_utils.importing``); PyPI's
Triton has none. ``enable()`` registers a stand-in ``cpu`` entry in
``triton.backends.backends`` and sets ``TRITON_INTERPRET=1``, so V2's Triton
kernels run in Triton's interpreter on CPU tensors: exact, and many times
slower than the V1 runner. Both must happen before Triton or vLLM is
imported, so ``enable()`` refuses to run after either.

Nothing in the installed package calls this: tests/v2_engines.py (a
process of its own) and ``python -m vllm_plugins.bench --runner v2 ...``
turn it on. Engines vLLM starts in processes of their own import Triton
anew, without the stand-in, so V2 engines here run in the calling process.
"""

from __future__ import annotations

import os
import sys


class _StandInDriver:
    """A Triton driver that is never active: the interpreter needs none,
    and vLLM only looks for the ``cpu`` entry's presence."""

    @classmethod
    def is_active(cls) -> bool:
        return False


def enable() -> None:
    """Puts engines this process builds on Model Runner V2 (CPU build)."""
    if "vllm" in sys.modules:
        raise RuntimeError("Model Runner V2 on CPU must be enabled before vLLM is "
                           "imported (vllm.triton_utils reads Triton's backends once)")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Model Runner V2 on CPU must be enabled before Triton is "
                           "imported (Triton reads TRITON_INTERPRET once)")
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend

    backends.setdefault("cpu", Backend(compiler=BaseBackend, driver=_StandInDriver))
    _interpretable_libdevice()


def _interpretable_libdevice() -> None:
    """Triton's interpreter runs ``triton.language`` but not the device
    library's externs, which V2's rejection sampler calls where drafts carry
    probabilities (``tldevice.log1p`` in its residual). The one it needs is
    given in ``triton.language`` terms, for the interpreter only."""
    import triton.language as tl
    from triton.language.extra import libdevice

    def log1p(x):
        return tl.log(1.0 + x)

    libdevice.log1p = log1p

