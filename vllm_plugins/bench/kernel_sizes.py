"""What a step with a new token count costs in vLLM's CPU linear layers.

vLLM's CPU build runs every unquantized linear layer through ``onednn_mm``
with a handler that builds a oneDNN kernel per input row count (the step's
token count) and keeps 32 of them (``create_onednn_mm(weight, 32)`` in
``vllm.model_executor.layers.utils``). The goodput controller's cost model
has a term for that (``new_shape_s``, docs/draft_length_design.md); this measures
it directly, on the default model's MLP shape:

    python -m vllm_plugins.bench kernel-sizes [--rows 16,32,48,64,112] [--cache 32]

Per row count: the first call's time (kernel built) and the median of later
calls (kernel cached), then one pass over more distinct counts than the cache
holds, twice: the second pass finds only part of them cached.

Then the tree attention twin (``vllm_plugins.kernels.tree_attention``, the
CPU engine's path for tree steps) on the default model's attention shape:
the fastest of repeated calls (other load on the machine only adds to a
call) for one layer and for a step's layers, per tree size
(``--tree-sizes``), for one request with ``--context`` committed tokens.
"""

from __future__ import annotations

import argparse
import time


def _int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 16,32, got {text!r}")
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"row counts must be positive, got {text!r}")
    return out


def measure(rows: list[int], in_features: int = 576, out_features: int = 1536,
            cache: int = 32, repeats: int = 10) -> dict:
    """Microseconds per call: first and cached, per row count; and the mean
    first-call time over two passes of ``cache + 8`` distinct counts."""
    import torch
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features)
    handler = ops.create_onednn_mm(weight.t(), cache)

    def call(m: int, n: int = 1) -> float:
        x = torch.randn(m, in_features)
        start = time.perf_counter()
        for _ in range(n):
            ops.onednn_mm(handler, x, None)
        return 1e6 * (time.perf_counter() - start) / n

    per_size = []
    for m in rows:
        first = call(m)
        cached = sorted(call(m) for _ in range(repeats))[repeats // 2]
        per_size.append({"rows": m, "first_us": first, "cached_us": cached})
    sweep = list(range(max(rows) + 1, max(rows) + 1 + cache + 8))
    passes = [sum(call(m) for m in sweep) / len(sweep) for _ in range(2)]
    return {"per_size": per_size, "sweep_sizes": len(sweep), "cache": cache,
            "sweep_first_pass_us": passes[0], "sweep_second_pass_us": passes[1]}


def measure_tree_attention(sizes: list[int], context: int = 512, heads: int = 9,
                           kv_heads: int = 3, head_size: int = 64, layers: int = 30,
                           block_size: int = 32, repeats: int = 20) -> list[dict]:
    """Fastest microseconds per layer of the tree attention twin, per tree size: a
    binary tree of that many nodes plus its root, over a CPU-layout cache
    with shuffled blocks; the step's cost is that times ``layers``."""
    import torch

    from vllm_plugins.kernels.cache_layout import cpu_cache_views
    from vllm_plugins.kernels.tree_attention import tree_attention_torch
    from vllm_plugins.tree.draft import ancestor_mask

    torch.manual_seed(0)
    out = []
    for n in sizes:
        parents = [(i - 1) // 2 for i in range(n)]  # node 0 under the root
        mask = ancestor_mask(parents)  # root and nodes: the step's n + 1 tokens
        seq_len = context + n + 1
        num_blocks = -(-seq_len // block_size)
        kv = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size)
        key_cache, value_cache = cpu_cache_views(kv)
        args = (torch.randn(n + 1, heads, head_size), key_cache, value_cache,
                torch.randperm(num_blocks, dtype=torch.int32).view(1, -1),
                torch.tensor([seq_len], dtype=torch.int32),
                torch.tensor([0, n + 1], dtype=torch.int32), mask, head_size ** -0.5)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            tree_attention_torch(*args)
            times.append(1e6 * (time.perf_counter() - start))
        layer_us = min(times[1:])  # the first call may allocate
        out.append({"nodes": n, "layer_us": layer_us, "step_ms": layer_us * layers / 1e3})
    return out


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m vllm_plugins.bench kernel-sizes",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=_int_list, default=[16, 32, 48, 64, 112])
    ap.add_argument("--cache", type=int, default=32,
                    help="kernels kept per handler (vLLM uses 32)")
    ap.add_argument("--tree-sizes", type=_int_list, default=[8, 16, 32, 64],
                    help="tree node counts for the tree attention twin")
    ap.add_argument("--context", type=int, default=512,
                    help="committed tokens before the tree")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = measure(args.rows, cache=args.cache)
    print("| rows | first call (us) | cached (us) |")
    print("|---:|---:|---:|")
    for r in out["per_size"]:
        print(f"| {r['rows']} | {r['first_us']:.0f} | {r['cached_us']:.0f} |")
    print(f"\n{out['sweep_sizes']} distinct row counts, cache {out['cache']}: mean call "
          f"{out['sweep_first_pass_us']:.0f} us on the first pass, "
          f"{out['sweep_second_pass_us']:.0f} us on the second")
    print(f"\nTree attention twin, one request, {args.context} committed tokens, "
          "9 heads over 3 kv heads of 64, 30 layers:")
    print("| tree nodes | per layer (us) | per step (ms) |")
    print("|---:|---:|---:|")
    for r in measure_tree_attention(args.tree_sizes, context=args.context):
        print(f"| {r['nodes']} | {r['layer_us']:.0f} | {r['step_ms']:.1f} |")
    return 0
