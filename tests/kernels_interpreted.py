"""Runs the Triton kernel checks of tests/test_kernels.py under Triton's
interpreter, on CPU tensors, and prints one JSON line: whether the kernels
really were interpreted, and each check's error (None when it passed).

Triton reads TRITON_INTERPRET when it is first imported, so this runs as its
own process with the variable set before anything imports Triton:

    TRITON_INTERPRET=1 python -m tests.kernels_interpreted
"""

from __future__ import annotations

import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"


def main() -> int:
    if "triton" in sys.modules:
        raise RuntimeError("Triton was imported before TRITON_INTERPRET was set")
    from triton.runtime.interpreter import InterpretedFunction

    from tests import test_kernels
    from vllm_plugins.kernels import kv_move, tree_attention

    interpreted = (isinstance(tree_attention._tree_attention_kernel, InterpretedFunction)
                   and isinstance(kv_move._move_rows_kernel, InterpretedFunction))
    results = {}
    for name, check in test_kernels.interpreted_checks().items():
        try:
            check()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc(limit=4)
    print(json.dumps({"interpreted": interpreted, "checks": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
