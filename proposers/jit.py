"""The one way our per-token loops are compiled.

``njit(cache=True)`` keeps the machine code on disk, so an engine compiles a
loop once per install, not once per process. Numba refuses to decorate a
cached function where it finds no writable cache directory (a read-only
site-packages with no writable home, and no ``NUMBA_CACHE_DIR``); there the
loops compile in each process instead, at ``load_model``.
"""

from __future__ import annotations

from numba import njit


def cached_njit(fn=None, **options):
    """``@cached_njit`` or ``@cached_njit(fastmath=...)``: numba's options
    beside ``cache``."""
    if fn is None:
        return lambda f: cached_njit(f, **options)
    try:
        return njit(cache=True, **options)(fn)
    except RuntimeError:  # "cannot cache function ...: no locator available"
        return njit(**options)(fn)
