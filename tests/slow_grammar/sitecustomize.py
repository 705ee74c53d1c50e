"""Test-only: slow grammar validation in the API server of a server started
with this folder first on ``PYTHONPATH`` and ``VLLM_PLUGINS_TEST_SLOW_GRAMMAR``
set to a number of seconds.

In the server's front-end process (the one no multiprocessing parent
started: engine core and workers compile as usual), a grammar whose spec
contains ``SLOW_MARKER`` takes that much longer to compile (a sleep, which
like llguidance's compile holds no GIL), so that
``tests/test_grammar_server.py`` can tell validation on the event loop from
validation off it by a margin no machine's speed can close. Every other
grammar compiles as usual.
"""

import os

SLOW_MARKER = "vllm-plugins-slow"
_DELAY = float(os.environ.get("VLLM_PLUGINS_TEST_SLOW_GRAMMAR") or 0)

if _DELAY > 0:
    import json
    import multiprocessing
    import time

    from vllm_plugins.grammar import spec as _spec

    _compile = _spec._compile_uncached

    def _slow_compile(raw):
        try:
            slow = SLOW_MARKER in json.dumps(raw)
        except (TypeError, ValueError, RecursionError):
            slow = False
        if slow and multiprocessing.parent_process() is None:
            time.sleep(_DELAY)
        return _compile(raw)

    _spec._compile_uncached = _slow_compile
