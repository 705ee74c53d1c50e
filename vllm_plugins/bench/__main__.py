"""The one benchmark command: ``python -m vllm_plugins.bench <what> ...``
(also installed as ``vllm-plugins-bench``).

Each subcommand measures what a section of docs/benchmarks.md reports, and
keeps its own options (``python -m vllm_plugins.bench <what> --help``).
Subcommands are loaded only when run, so listing them starts no engine and
imports neither vLLM nor torch.
"""

from __future__ import annotations

import sys


def _methods():
    from vllm_plugins.bench import cli
    return cli


def _stand():
    from vllm_plugins.bench import stand_bench
    return stand_bench


def _layer_skip():
    from vllm_plugins.bench import layer_skip_bench
    return layer_skip_bench


def _grammar():
    from vllm_plugins.bench import grammar_bench
    return grammar_bench


def _grammar_compile_ttft():
    from vllm_plugins.bench import grammar_compile_ttft
    return grammar_compile_ttft


def _step_costs():
    from vllm_plugins.bench import step_costs
    return step_costs


def _tree_profile():
    from vllm_plugins.bench import tree_profile
    return tree_profile


def _host_profile():
    from vllm_plugins.bench import host_profile
    return host_profile


def _vocab_cost():
    from vllm_plugins.bench import vocab_cost
    return vocab_cost


def _proposer_cost():
    from vllm_plugins.bench import proposer_cost
    return proposer_cost


def _kernel_sizes():
    from vllm_plugins.bench import kernel_sizes
    return kernel_sizes


def _tree_kernels_gpu():
    from vllm_plugins.bench import tree_kernels_gpu
    return tree_kernels_gpu


def _tr_device():
    from vllm_plugins.bench import tr_device
    return tr_device


# name -> (loader of the module whose parse_args and main it runs, what it measures)
SUBCOMMANDS = {
    "methods": (_methods, "speculative methods side by side on Spec-Bench dev: "
                          "MAT, speed, draft-length controllers (--quick: the demo)"),
    "stand": (_stand, "STAND under test-time scaling: n samples per prompt"),
    "layer-skip": (_layer_skip, "SWIFT and DEL beside Token Recycling, per category"),
    "grammar": (_grammar, "grammar-forced drafts, native structured output against "
                          "our grammar processor (--modes), the processor's cost "
                          "(--processor)"),
    "grammar-compile-ttft": (_grammar_compile_ttft, "a plain request's time to first "
                                                    "token while a large schema compiles"),
    "step-costs": (_step_costs, "a verification step's time by token count, chain "
                                "against tree"),
    "tree-profile": (_tree_profile, "where a tree step's time goes, part by part, against "
                                    "a chain step of the same tokens"),
    "host-profile": (_host_profile, "our host CPU time per engine step by component "
                                    "(bridge, sources, merge, controller, tree), beside "
                                    "vLLM suffix's"),
    "vocab-cost": (_vocab_cost, "what Token Recycling adds to a step against vLLM ngram "
                                "on a 262k vocabulary"),
    "proposer-cost": (_proposer_cost, "a proposer's own time per step on synthetic steps, "
                                      "methods interleaved"),
    "kernel-sizes": (_kernel_sizes, "a new token count in vLLM's CPU linear layers; "
                                    "the tree attention twin's CPU time"),
    "tree-kernels-gpu": (_tree_kernels_gpu, "the tree kernels' cost on a CUDA GPU"),
    "tr-device": (_tr_device, "Token Recycling's device tables: learn plus propose per "
                              "step, eager and in a CUDA graph, no vLLM"),
}

PROG = "python -m vllm_plugins.bench"


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"usage: {PROG} [--runner v1|v2] <what> [options]  ({PROG} <what> --help)",
             "", "what:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def load(name: str):
    """The module that runs subcommand ``name`` (its ``parse_args`` and ``main``)."""
    if name not in SUBCOMMANDS:
        raise SystemExit(f"{PROG}: unknown subcommand {name!r}; one of: "
                         f"{', '.join(SUBCOMMANDS)}")
    return SUBCOMMANDS[name][0]()


RUNNERS = ("v1", "v2")


def choose_runner(name: str) -> None:
    """``--runner v1|v2``: the model runner every engine of the run gets,
    through vLLM's own ``VLLM_USE_V2_MODEL_RUNNER`` (a method V2 cannot
    serve is then refused, not moved to V1). Without CUDA, V2 runs through
    Triton's interpreter (``vllm_plugins.v2_on_cpu``): exact and slow, so
    compare MAT there, not speed. Before vLLM is imported."""
    import os

    if name not in RUNNERS:
        raise SystemExit(f"{PROG}: --runner must be one of {list(RUNNERS)}, got {name!r}")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if name == "v2" else "0"
    if name == "v2":
        import torch

        if not torch.cuda.is_available():
            from vllm_plugins.v2_on_cpu import enable

            enable()
            # Engine processes vLLM spawns import Triton anew, without the
            # stand-in: the engines run in this process instead.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--runner"]:
        if len(argv) < 2:
            raise SystemExit(f"{PROG}: --runner needs v1 or v2")
        choose_runner(argv[1])
        argv = argv[2:]
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    return load(argv[0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
