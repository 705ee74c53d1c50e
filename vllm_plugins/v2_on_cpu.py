"""Model Runner V2 on a CPU, for tests and benchmarks only.

vLLM's CPU build enables Triton, and with it Model Runner V2, only when
Triton reports a ``cpu`` backend (``vllm.triton_utils.importing``); PyPI's
Triton has none. ``enable()`` registers a stand-in ``cpu`` entry in
``triton.backends.backends`` and sets ``TRITON_INTERPRET=1``, so V2's Triton
kernels run in Triton's interpreter on CPU tensors: exact, and slow (about
17x the V1 runner at batch 8). Both must happen before Triton or vLLM is
imported, so ``enable()`` refuses to run after either.

Nothing in the installed package calls this: a test fixture, a subprocess
that sets ``TRITON_CPU_STAND_IN=1`` before its first import
(``enable_from_env``), or ``python -m vllm_plugins.bench ... --runner v2``
turns it on.
"""

from __future__ import annotations

import os
import sys

# Not VLLM_-prefixed: vLLM warns about every VLLM_ variable it does not know.
ENV = "TRITON_CPU_STAND_IN"


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
    os.environ[ENV] = "1"  # processes started from here (servers, ranks) follow
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


def enable_from_env() -> bool:
    """``enable()`` where ``VLLM_PLUGINS_V2_ON_CPU=1``; whether it did."""
    if os.environ.get(ENV) != "1":
        return False
    enable()
    return True


def main(argv: list[str] | None = None) -> None:
    """``python -m vllm_plugins.v2_on_cpu -m MODULE ARGS...``: runs MODULE
    (a server, say) as ``python -m`` would, with V2 enabled first."""
    import runpy

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] != "-m":
        raise SystemExit("usage: python -m vllm_plugins.v2_on_cpu -m MODULE [ARGS...]")
    enable()
    sys.argv = [args[1], *args[2:]]
    runpy.run_module(args[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
