"""Token Recycling's device tables: what a step of learning plus drafting
costs, without vLLM.

For each batch size, synthetic steps (random verified rows, the target's
top-k, verified and accepted counts) go through ``learn`` then ``propose``
on tables of the default model's size, warmed by a few steps and a seeded
prompt per request. Reported per batch size, in milliseconds per step:

- ``host``: the calling thread's CPU time (``time.thread_time``) of learn
  plus propose, eager, the median step: on a GPU the cost of launching the
  ops, on the CPU all the work. ``learn`` and ``propose``: their medians.
- ``wall``: eager wall time per step (the device's queue drained at the end).
- ``graph``: one CUDA graph of learn plus propose, replayed (CUDA only).
- ``topk``: ``torch.topk`` over the step's verified rows' logits, which the
  bridge runs before learning (one kernel on a GPU), timed apart.
- ``route``: V2's device route's step (``DeviceRecyclingDrafter.device_step``,
  learn and draft from V2's tensors: int32 input ids and logits offsets,
  the top-1 as ``[rows, 1]``), host time as ``host``; ``route_calls``: its
  torch calls, views included (each costs a step about as much as a small
  kernel). With ``--cool`` a 64 MiB sweep runs before each timed step, as
  the target's forward does in an engine: the step's calls then cost what
  they cost there (several times their cost back to back).
- ``compiled`` (a CPU only): the same step as one compiled call, what the
  route runs where the tables are CPU tensors
  (``token_recycling_device_compiled``), host time as ``route``.

On CUDA every learn and propose runs under
``torch.cuda.set_sync_debug_mode("error")``: an op that waits for the device
raises, so a clean run shows the step never reads back to the host.
Imports torch and the tables only, never vLLM.

    python -m vllm_plugins.bench tr-device --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vllm_plugins.bench.cli import _int_list
from vllm_plugins.proposers.token_recycling_device import DeviceRecyclingTables


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench tr-device",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 64, 256])
    p.add_argument("--vocab", type=int, default=49152, help="default: SmolLM2's")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--context-order", type=int, default=3)
    p.add_argument("--context-slots", type=int, default=1 << 20)
    p.add_argument("--draft", type=int, default=6, help="tokens drafted per request")
    p.add_argument("--steps", type=int, default=50, help="timed steps per batch size")
    p.add_argument("--cool", action="store_true",
                   help="evict the caches before each timed step (see route)")
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    return p.parse_args(argv)


class Steps:
    """Synthetic steps for ``r`` requests: a few input sets, cycled."""

    def __init__(self, args, r: int, device, sets: int = 4, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        n, k, v = args.draft + 1, args.topk, args.vocab
        self.inputs = []
        for _ in range(sets):
            verified = torch.randint(0, v, (r, n), generator=g)
            ids = torch.randint(0, v, (r, n, k), generator=g)
            lps = torch.rand(r, n, k, generator=g).log().sort(2, descending=True).values
            nv = torch.randint(1, n + 1, (r,), generator=g)
            na = (torch.rand(r, generator=g) * nv).long().clamp(max=nv - 1)
            last = torch.randint(0, v, (r,), generator=g)
            self.inputs.append([x.to(device) for x in (verified, ids, lps, nv, na, last)])
        self.slots = torch.arange(r, device=device)
        self.prompts = torch.randint(0, v, (r, 64), generator=g).to(device)
        self.logits = torch.randn(r * n, v, generator=g).to(device)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _NoSyncs:
    """``set_sync_debug_mode("error")`` on CUDA while inside."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __enter__(self):
        if self.cuda:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.set_sync_debug_mode(0)


def measure(args, r: int, device) -> dict:
    t = DeviceRecyclingTables(args.vocab, args.context_order, args.context_slots, r, 0.02,
                              device, compiled=False)
    s = Steps(args, r, device)
    with torch.inference_mode(), _NoSyncs(device):
        t.seed(s.slots, s.prompts, torch.full((r,), 64, device=device))
        for inp in s.inputs * 2:  # warm: tables filled, allocator warm
            t.learn(s.slots, *inp[:5])
            t.propose(s.slots, inp[5], args.draft)
    _sync(device)
    learn_s, propose_s = [], []
    with torch.inference_mode():
        wall = time.perf_counter()
        with _NoSyncs(device):
            for i in range(args.steps):
                inp = s.inputs[i % len(s.inputs)]
                c0 = time.thread_time()
                t.learn(s.slots, *inp[:5])
                c1 = time.thread_time()
                t.propose(s.slots, inp[5], args.draft)
                c2 = time.thread_time()
                learn_s.append(c1 - c0)
                propose_s.append(c2 - c1)
        _sync(device)
        wall = time.perf_counter() - wall
        row = {"batch": r, "learn_ms": 1e3 * statistics.median(learn_s),
               "propose_ms": 1e3 * statistics.median(propose_s),
               "host_ms": 1e3 * statistics.median(map(sum, zip(learn_s, propose_s))),
               "wall_ms": 1e3 * wall / args.steps,
               "topk_ms": _time_topk(s.logits, args.topk, args.steps, device)}
        if device.type == "cuda":
            row["graph_ms"] = _time_graph(t, s, args, device)
        row["route_ms"], row["route_calls"] = _time_route(t, s, args, device)
        if device.type == "cpu":
            compiled = DeviceRecyclingTables(args.vocab, args.context_order,
                                             args.context_slots, r, 0.02, device)
            compiled.seed(s.slots, s.prompts, torch.full((r,), 64, device=device))
            row["compiled_ms"], _ = _time_route(compiled, s, args, device)
    return row


class _Calls(torch.overrides.TorchFunctionMode):
    """Counts the torch calls (functions, methods, views) made inside."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _time_route(t, s, args, device) -> tuple[float, int]:
    """The device route's step on the tables: host ms (median) and torch
    calls a step; on CUDA every step runs under ``_NoSyncs``, as learn and
    propose do."""
    from vllm_plugins.drafter import DeviceStep
    from vllm_plugins.proposers.token_recycling_device_step import DeviceRecyclingDrafter

    drafter = DeviceRecyclingDrafter(t, seed_from_prompt=True)
    r, n = s.slots.shape[0], args.draft + 1
    cu = torch.arange(0, r * n + 1, n, dtype=torch.int32, device=device)
    positions = torch.arange(r * n, dtype=torch.int32, device=device)
    steps = [DeviceStep(s.slots, cu, verified.view(-1).int(), positions,
                        ids[:, :, :1].reshape(-1, 1), lps[:, :, :1].reshape(-1, 1),
                        (na + 1).int(), last.view(-1, 1), args.draft)
             for verified, ids, lps, _, na, last in s.inputs]
    sweep = torch.zeros(16 << 20, device=device) if args.cool else None
    with _NoSyncs(device):
        for step in steps:
            drafter.device_step(step)
        counted = _Calls()
        with counted:
            drafter.device_step(steps[0])
    times = []
    for i in range(args.steps):
        if sweep is not None:
            sweep.add_(1)
            _sync(device)
        with _NoSyncs(device):
            c0 = time.thread_time()
            drafter.device_step(steps[i % len(steps)])
            times.append(time.thread_time() - c0)
    _sync(device)
    return 1e3 * statistics.median(times), counted.calls


def _time_topk(logits, k: int, steps: int, device) -> float:
    torch.topk(logits, k)
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        torch.topk(logits, k)
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / steps


def _time_graph(t, s, args, device) -> float:
    """Learn plus propose captured once, replayed on new inputs copied into
    the captured ones."""
    static = [x.clone() for x in s.inputs[0]]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream), _NoSyncs(device):
        for _ in range(2):
            t.learn(s.slots, *static[:5])
            t.propose(s.slots, static[5], args.draft)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), _NoSyncs(device):
        t.learn(s.slots, *static[:5])
        t.propose(s.slots, static[5], args.draft)
    _sync(device)
    start = time.perf_counter()
    with _NoSyncs(device):
        for i in range(args.steps):
            for dst, src in zip(static, s.inputs[i % len(s.inputs)]):
                dst.copy_(src, non_blocking=True)
            graph.replay()
    _sync(device)
    return 1e3 * (time.perf_counter() - start) / args.steps


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("tr-device: --device cuda, but torch sees no CUDA device")
    if device.type == "cpu":
        torch.set_num_threads(1)  # a step's own time, not the host's cores
    t = DeviceRecyclingTables(args.vocab, args.context_order, args.context_slots, 1, 0.02,
                              "meta")
    print(f"tr-device on {device}: vocab {args.vocab}, k {args.topk}, context_order "
          f"{args.context_order}, {args.context_slots} slots "
          f"({t.nbytes() / 2**20:.1f} MiB), draft {args.draft}, {args.steps} steps; ms/step")
    cols = ["batch", "host_ms", "learn_ms", "propose_ms", "wall_ms", "graph_ms", "topk_ms",
            "route_ms", "route_calls", "compiled_ms"]
    print(" ".join(f"{c:>10}" for c in cols))
    rows = []
    for r in args.batch_sizes:
        row = measure(args, r, device)
        rows.append(row)
        print(" ".join(f"{row[c]:>10.3f}" if c in row and c not in ("batch", "route_calls") else
                       f"{row.get(c, '-'):>10}" for c in cols), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0
