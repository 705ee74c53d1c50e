"""Pins the fixes to vLLM's CPU build (vllm_plugins/bridge/cpu_fixes.py):
each shows the vLLM behaviour it corrects, so it fails the day vLLM fixes
it and the patch can go."""

import inspect

import pytest


def test_cpu_expand_batch_to_tokens_fix():
    """Without Triton, vLLM's CPU expand kernel leaves float32 and int32
    outputs uninitialised; our replacement spreads per-request values over
    the draft rows exactly. The first half fails the day vLLM fixes it, and
    the patch can go."""
    import torch
    from vllm.utils import cpu_triton_utils

    from vllm_plugins.bridge.cpu_fixes import replace_expand_batch_to_tokens

    assert hasattr(cpu_triton_utils, "_expand_kernel_impl")
    src = inspect.getsource(cpu_triton_utils._expand_kernel_impl)
    assert "int64" in src or "long()" in src
    expand = replace_expand_batch_to_tokens(None)
    cu = torch.tensor([2, 2, 5], dtype=torch.int32)
    got = expand(torch.tensor([0.8, 0.3, 0.0]), cu, 5, replace_from=0, replace_to=1)
    assert got.dtype == torch.float32
    assert got.tolist() == pytest.approx([0.8, 0.8, 1.0, 1.0, 1.0])
    got = expand(torch.tensor([3, 9, 7], dtype=torch.int32), cu, 5)
    assert got.dtype == torch.int32 and got.tolist() == [3, 3, 7, 7, 7]


def test_cpu_kernel_scan_survives_numba():
    """vLLM's CPU build rebinds Triton kernels at each worker start by
    reading ``vars()`` of every module global; llvmlite's ``ffi.lib`` answers
    ``__dict__`` with a function wrapper. With the builtin ``vars`` the scan
    raises once numba is imported (the first half fails the day vLLM fixes
    it, and the patch can go); with ours it finishes."""
    import llvmlite.binding.ffi  # noqa: F401  (what importing numba loads)
    from vllm.triton_utils import dispatcher

    from vllm_plugins.bridge.cpu_fixes import add_kernel_scan_vars

    assert "vars(value).get(" in inspect.getsource(dispatcher._rebind_kernels)
    ours = dispatcher.__dict__.pop("vars", None)
    try:
        with pytest.raises(AttributeError, match="get"):
            dispatcher._rebind_kernels([])
        dispatcher.vars = add_kernel_scan_vars(None)
        dispatcher._rebind_kernels([])  # nothing to rebind: a scan only
    finally:
        if ours is None:
            dispatcher.__dict__.pop("vars", None)
        else:
            dispatcher.vars = ours


def test_the_bridge_imports_no_numba_before_it_patches_the_scan():
    """Where the plugin steps aside (an unchecked vLLM) it imports the patch
    list but applies none: nothing it imports may load numba, or the scan
    above fails and plain vLLM with it. Compiled loops load at first use."""
    import subprocess
    import sys

    code = ("import sys, vllm_plugins.bridge.patches, vllm_plugins.registry; "
            "print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
