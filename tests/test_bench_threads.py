"""Benchmarks that keep engines in their own process keep torch's thread count.

vLLM's ``ngram`` proposer sets numba's thread count around each proposal;
under numba's OpenMP layer that count is torch's too. Here vLLM's own
``NgramProposer.batch_propose`` runs in a fresh process whose torch uses one
thread, as a CPU engine bound to one core does: with the benchmark's
environment (``numba_threads_as_the_engines``) torch still has one thread
after it, with numba's default it has the host's count (the control).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_plugins.bench.engines import numba_threads_as_the_engines

pytest.importorskip("vllm")

PROPOSE = """
import types
import numpy as np
import torch
torch.set_num_threads(1)
torch.get_num_threads()  # torch's OpenMP state set up, as in a running engine
from vllm.v1.spec_decode.ngram_proposer import NgramProposer
stub = types.SimpleNamespace(
    num_tokens_threshold=8192, num_numba_thread_available=1, min_n=2, max_n=5,
    max_model_len=64, valid_ngram_draft=np.zeros((1, 3), np.int32),
    valid_ngram_num_drafts=np.zeros(1, np.int32))
tokens = np.zeros((1, 64), np.int32)
tokens[0, :8] = [1, 2, 3, 1, 2, 3, 1, 2]
drafts = NgramProposer.batch_propose(stub, 1, [0], np.array([8], np.int32), tokens, 3)
assert drafts == [[3, 1, 2]], drafts
print(torch.get_num_threads())
"""


def _threads_after_propose(*envs: dict) -> list[int]:
    """torch's thread count after the proposal, one fresh process per
    environment (run side by side)."""
    runs = [subprocess.Popen([sys.executable, "-c", PROPOSE], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for env in envs]
    counts = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        counts.append(int(out.strip().splitlines()[-1]))
    return counts


def _bench_env(monkeypatch, **variables) -> dict:
    for name in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND", "NUMBA_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    numba_threads_as_the_engines()
    return dict(os.environ)


@pytest.mark.parametrize("variables, want", [
    ({"OMP_NUM_THREADS": "1"}, "1"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0"}, "1"),
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-3,6"}, "5"),
    ({"OMP_NUM_THREADS": "2", "NUMBA_NUM_THREADS": "1"}, "1"),    # the caller's kept
    ({"VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}, None),            # tensor parallel: not one count
    ({}, None),
])
def test_numba_threads_follow_the_engines(monkeypatch, variables, want):
    assert _bench_env(monkeypatch, **variables).get("NUMBA_NUM_THREADS") == want


@pytest.mark.slow  # two fresh processes that import vLLM and compile its numba loop
def test_vllms_ngram_proposal_leaves_torch_on_the_engines_threads(monkeypatch):
    bench = _bench_env(monkeypatch, OMP_NUM_THREADS="1")
    control = _bench_env(monkeypatch)  # numba's default: the host's CPUs
    with_bench, with_default = _threads_after_propose(bench, control)
    assert with_bench == 1
    if len(os.sched_getaffinity(0)) > 1:  # the control needs a default above one
        assert with_default > 1
