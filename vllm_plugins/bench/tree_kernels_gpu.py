"""What a tree step's kernels cost on a GPU, beside what a chain's cost.

Four kinds of table, each timed with ``triton.testing.do_bench`` (median, L2 flushed
between calls) on CUDA tensors:

1. Tree attention for one layer of an 8B Llama-shaped model (32 query heads
   over 8 kv heads of 128, bfloat16, vLLM's flash cache layout with 16-token
   blocks on shuffled block ids), per batch, committed context and tree size
   (a binary tree under the root; every request alike): the Triton kernel at
   its best key tile, its torch twin on a per-step plan (the CPU engine's
   path, here on the GPU), and torch's fused causal attention over the same
   query rows with contiguous K/V (``scaled_dot_product_attention`` with a
   lower-right causal mask): what a chain of as many tokens costs a fused
   kernel that needs no block table, a reference rather than vLLM's own.
2. The kernel per launch configuration (rows per program, warps, key tile)
   and per number of key splits, at a few of those shapes: the tables the
   launch defaults come from.
3. The accepted path's K/V move over 32 layers: the kernel called once per
   layer, the all-layers kernel (what the bridge calls), and the twin.
4. The step's linear layers (the same 8B shapes, 32 distinct layers, and the
   vocabulary projection of every verified row) per token count: how much
   more a step of N tokens costs than one of 1, the curve a cost model reads
   to size trees on this GPU.

    python -m vllm_plugins.bench tree-kernels-gpu [--out kernels_gpu.json]
"""

from __future__ import annotations

import argparse
import json
import traceback

import torch

HEADS, KV_HEADS, HEAD_SIZE, LAYERS = 32, 8, 128, 32
HIDDEN, INTERMEDIATE, VOCAB = 4096, 14336, 128256
BLOCK_SIZE = 16


def _bench(fn) -> float:
    """Median milliseconds of ``fn`` (L2 flushed before each call)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=10, rep=40, return_mode="median"))


def attention_inputs(num_reqs: int, nodes: int, context: int, gen: torch.Generator,
                     dtype=torch.bfloat16, device="cuda") -> dict:
    """One step of ``num_reqs`` requests, each ``context`` committed tokens
    and a binary tree of ``nodes`` nodes under its root (``nodes + 1`` step
    tokens), over a flash-layout cache with shuffled blocks."""
    from vllm_plugins.tree.draft import ancestor_mask

    query_len = nodes + 1
    seq_len = context + query_len
    blocks_per_req = -(-seq_len // BLOCK_SIZE)
    num_blocks = num_reqs * blocks_per_req
    cache = torch.randn(2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen,
                        device=device, dtype=dtype)
    block_table = torch.randperm(num_blocks, generator=gen, device=device) \
        .to(torch.int32).view(num_reqs, blocks_per_req)
    mask = ancestor_mask([(i - 1) // 2 for i in range(nodes)]).to(device)
    return {
        "query": torch.randn(num_reqs * query_len, HEADS, HEAD_SIZE, generator=gen,
                             device=device, dtype=dtype),
        "key_cache": cache[0], "value_cache": cache[1], "block_table": block_table,
        "seq_lens": torch.full((num_reqs,), seq_len, dtype=torch.int32, device=device),
        "query_start_loc": torch.arange(0, num_reqs * query_len + 1, query_len,
                                        dtype=torch.int32, device=device),
        "tree_mask": mask.repeat(num_reqs, 1),
        "query_len": query_len, "seq_len": seq_len,
    }


def time_attention(num_reqs: int, nodes: int, context: int, gen: torch.Generator,
                   tiles=(32, 64)) -> dict:
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.functional import scaled_dot_product_attention

    from vllm_plugins.kernels import tree_attention as ta

    x = attention_inputs(num_reqs, nodes, context, gen)
    args = [x[k] for k in ("query", "key_cache", "value_cache", "block_table", "seq_lens",
                           "query_start_loc", "tree_mask")]
    scale = HEAD_SIZE ** -0.5
    out = torch.empty_like(x["query"])
    kernel, unsplit = {}, {}
    for tile in tiles:
        kernel[tile] = _bench(lambda: ta.tree_attention_triton(
            *args, scale, out, max_query_len=x["query_len"], max_seq_len=x["seq_len"],
            tile=tile))
        unsplit[tile] = _bench(lambda: ta.tree_attention_triton(
            *args, scale, out, max_query_len=x["query_len"], tile=tile, splits=1))
    best_tile = min(kernel, key=kernel.get)
    splits = ta.auto_splits(num_reqs, x["query_len"], HEADS // KV_HEADS, KV_HEADS,
                            x["seq_len"], best_tile, x["query"].device)
    plan = ta.plan_tree_attention(x["block_table"], x["seq_lens"], x["query_start_loc"],
                                  x["tree_mask"], BLOCK_SIZE, HEADS // KV_HEADS)
    twin = _bench(lambda: ta.tree_attention_planned(x["query"], x["key_cache"],
                                                    x["value_cache"], plan, scale, out))
    # The same rows as a causal chain, K/V contiguous per request.
    q, s = x["query_len"], x["seq_len"]
    query = x["query"].view(num_reqs, q, HEADS, HEAD_SIZE).transpose(1, 2)
    key = torch.randn(num_reqs, KV_HEADS, s, HEAD_SIZE, generator=gen, device="cuda",
                      dtype=query.dtype)
    value = torch.randn_like(key)
    bias = causal_lower_right(q, s)
    fused = _bench(lambda: scaled_dot_product_attention(query, key, value, attn_mask=bias,
                                                        scale=scale, enable_gqa=True))
    return {"batch": num_reqs, "context": context, "nodes": nodes,
            "kernel_us": 1e3 * kernel[best_tile], "tile": best_tile, "splits": splits,
            "kernel_by_tile_us": {t: 1e3 * v for t, v in kernel.items()},
            "unsplit_by_tile_us": {t: 1e3 * v for t, v in unsplit.items()},
            "twin_us": 1e3 * twin, "fused_chain_us": 1e3 * fused}


def sweep_launch(num_reqs: int, nodes: int, context: int, gen: torch.Generator,
                 configs) -> list[dict]:
    """The kernel per launch configuration (rows per program, warps, key
    tile, splits), everything else as in ``time_attention``."""
    from vllm_plugins.kernels import tree_attention as ta

    x = attention_inputs(num_reqs, nodes, context, gen)
    args = [x[k] for k in ("query", "key_cache", "value_cache", "block_table", "seq_lens",
                           "query_start_loc", "tree_mask")]
    out = torch.empty_like(x["query"])
    rows = []
    for config in configs:
        us = 1e3 * _bench(lambda: ta.tree_attention_triton(
            *args, HEAD_SIZE ** -0.5, out, max_query_len=x["query_len"],
            max_seq_len=x["seq_len"], **config))
        rows.append({"batch": num_reqs, "context": context, "nodes": nodes, **config,
                     "us": us})
    return rows


def time_kv_move(path_len: int, context: int, gen: torch.Generator) -> dict:
    """One request's accepted path of ``path_len`` nodes, each moved from a
    deeper node slot, in every layer: the kernel called per layer (as the
    CPU engine calls the twin), the all-layers kernel, and the twin."""
    from vllm_plugins.kernels import kv_move

    blocks = -(-(context + 128) // BLOCK_SIZE)
    caches = [torch.randn(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_SIZE, generator=gen,
                          device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
    keys, values = [c[0] for c in caches], [c[1] for c in caches]
    src = torch.arange(path_len, device="cuda") * 2 + context + 1
    dst = torch.arange(path_len, device="cuda") + context
    out = {}
    for name, fn in (("kernel", kv_move.move_kv_triton), ("twin", kv_move.move_kv_torch)):
        def step():
            for cache in caches:
                fn(cache[0], cache[1], src, dst)
        out[f"{name}_us"] = 1e3 * _bench(step)
    out["all_layers_us"] = 1e3 * _bench(lambda: kv_move.move_kv_layers_triton(
        keys, values, src, dst))
    return {"path": path_len, "layers": LAYERS, **out}


def time_linear(tokens: list[int], gen: torch.Generator) -> list[dict]:
    """The step's matrix products per token count, bfloat16: per layer the
    fused QKV, output, fused gate/up and down projections, then the
    vocabulary projection of every row (vLLM computes the logits of each
    verified token)."""
    kv = KV_HEADS * HEAD_SIZE
    shapes = [(HIDDEN, HIDDEN + 2 * kv), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE),
              (INTERMEDIATE, HIDDEN)]
    layers = [[torch.randn(k, n, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
               for k, n in shapes] for _ in range(LAYERS)]
    lm_head = torch.randn(HIDDEN, VOCAB, generator=gen, device="cuda",
                          dtype=torch.bfloat16) * 0.02
    rows = []
    for m in tokens:
        x = torch.randn(m, HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
        wide = torch.randn(m, INTERMEDIATE, generator=gen, device="cuda", dtype=torch.bfloat16)

        def step():
            for qkv, o, gate_up, down in layers:
                x @ qkv
                x @ o
                x @ gate_up
                wide @ down
            x @ lm_head
        rows.append({"tokens": m, "ms": _bench(step)})
    base = rows[0]["ms"]
    for r in rows:
        r["vs_first"] = r["ms"] / base
    del layers, lm_head
    torch.cuda.empty_cache()
    return rows


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8, got {text!r}") from None


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(prog="python -m vllm_plugins.bench tree-kernels-gpu",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=_int_list, default=[1, 8, 32])
    ap.add_argument("--contexts", type=_int_list, default=[512, 2048, 8192])
    ap.add_argument("--nodes", type=_int_list, default=[1, 8, 16, 32, 64, 80])
    ap.add_argument("--tokens", type=_int_list,
                    default=[1, 2, 4, 8, 16, 32, 48, 64, 81, 96, 128, 256])
    ap.add_argument("--tables", type=lambda t: t.split(","),
                    default=["attention", "sweep", "move", "linear"],
                    help="which tables, of attention,sweep,move,linear")
    ap.add_argument("--out", help="write every measurement here as JSON")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("tree_kernels_gpu needs a CUDA device")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        raise SystemExit("tree_kernels_gpu needs Triton") from None
    print(f"{result['device']}, torch {result['torch']}, triton {result['triton']}", flush=True)

    sections = {"attention": _attention_table, "sweep": _sweep_tables, "move": _move_table,
                "linear": _linear_table}
    for name in args.tables:
        section = sections[name]
        try:
            section(args, gen, result)
        except Exception:  # one table's failure leaves the others to run
            traceback.print_exc()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def _attention_table(args, gen, result) -> None:
    print("\nTree attention, one layer (us): Triton kernel (best tile), twin, fused chain")
    print("| batch | context | nodes | kernel | tile | splits | unsplit | twin | fused chain "
          "| kernel / fused |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    result["attention"] = []
    for b in args.batches:
        for c in args.contexts:
            for n in args.nodes:
                r = time_attention(b, n, c, gen)
                result["attention"].append(r)
                print(f"| {b} | {c} | {n} | {r['kernel_us']:.1f} | {r['tile']} | "
                      f"{r['splits']} | {min(r['unsplit_by_tile_us'].values()):.1f} | "
                      f"{r['twin_us']:.1f} | {r['fused_chain_us']:.1f} | "
                      f"{r['kernel_us'] / r['fused_chain_us']:.2f} |", flush=True)


def _sweep_tables(args, gen, result) -> None:
    print("\nKernel launch configurations (us): rows per program, warps, key tile")
    configs = [{"rows": r, "num_warps": w, "tile": t}
               for r in (64, 128) for w in (4, 8) for t in (32, 64)]
    print("| batch | context | nodes | " + " | ".join(
        f"{c['rows']}/{c['num_warps']}/{c['tile']}" for c in configs) + " |")
    print("|---:|---:|---:|" + "---:|" * len(configs))
    result["launch_sweep"] = []
    for b in (1, 8, 32):
        for c in (2048, 8192):
            for n in (16, 80):
                rows = sweep_launch(b, n, c, gen, configs)
                result["launch_sweep"].extend(rows)
                print(f"| {b} | {c} | {n} | " + " | ".join(f"{r['us']:.1f}" for r in rows)
                      + " |", flush=True)
    print("\nKey splits (us), default launch configuration")
    splits = (1, 2, 4, 8, 16, 32)
    print("| batch | context | nodes | " + " | ".join(map(str, splits)) + " |")
    print("|---:|---:|---:|" + "---:|" * len(splits))
    result["split_sweep"] = []
    for b in (1, 8):
        for c in (512, 2048, 8192):
            for n in (8, 80):
                rows = sweep_launch(b, n, c, gen, [{"splits": k} for k in splits])
                result["split_sweep"].extend(rows)
                print(f"| {b} | {c} | {n} | " + " | ".join(f"{r['us']:.1f}" for r in rows)
                      + " |", flush=True)


def _move_table(args, gen, result) -> None:
    print("\nAccepted-path K/V move, 32 layers (us): kernel per layer, all layers, twin")
    print("| path | kernel per layer | all layers | twin per layer |")
    print("|---:|---:|---:|---:|")
    result["kv_move"] = []
    for p in (1, 4, 8):
        r = time_kv_move(p, 2048, gen)
        result["kv_move"].append(r)
        print(f"| {p} | {r['kernel_us']:.0f} | {r['all_layers_us']:.0f} | "
              f"{r['twin_us']:.0f} |", flush=True)


def _linear_table(args, gen, result) -> None:
    print("\nLinear layers of a step, 32 layers and the vocabulary projection (ms)")
    print("| tokens | ms | vs 1 token |")
    print("|---:|---:|---:|")
    result["linear"] = time_linear(args.tokens, gen)
    for r in result["linear"]:
        print(f"| {r['tokens']} | {r['ms']:.2f} | {r['vs_first']:.2f} |", flush=True)
