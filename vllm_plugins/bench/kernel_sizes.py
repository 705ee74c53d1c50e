"""What a step with a new token count costs in vLLM's CPU linear layers.

vLLM's CPU build runs every unquantized linear layer through ``onednn_mm``
with a handler that builds a oneDNN kernel per input row count (the step's
token count) and keeps 32 of them (``create_onednn_mm(weight, 32)`` in
``vllm.model_executor.layers.utils``). The goodput controller's cost model
has a term for that (``new_shape_s``, docs/draft_length.md); this measures
it directly, on the default model's MLP shape:

    python -m vllm_plugins.bench.kernel_sizes [--rows 16,32,48,64,112] [--cache 32]

Per row count: the first call's time (kernel built) and the median of later
calls (kernel cached), then one pass over more distinct counts than the cache
holds, twice: the second pass finds only part of them cached.
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=_int_list, default=[16, 32, 48, 64, 112])
    ap.add_argument("--cache", type=int, default=32,
                    help="kernels kept per handler (vLLM uses 32)")
    args = ap.parse_args(argv)
    out = measure(args.rows, cache=args.cache)
    print("| rows | first call (us) | cached (us) |")
    print("|---:|---:|---:|")
    for r in out["per_size"]:
        print(f"| {r['rows']} | {r['first_us']:.0f} | {r['cached_us']:.0f} |")
    print(f"\n{out['sweep_sizes']} distinct row counts, cache {out['cache']}: mean call "
          f"{out['sweep_first_pass_us']:.0f} us on the first pass, "
          f"{out['sweep_second_pass_us']:.0f} us on the second")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
