"""Our host time per engine step, component by component, beside vLLM
``suffix``'s own.

Each method's engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``),
one engine at a time, on static batches of ``--batch-sizes`` requests. While
it runs, the functions of each component are wrapped here (nothing of the
package carries a timer) and their CPU time is summed per component, each
call's own time only: a wrapped call inside another counts to its own
component, not to its caller's. The bridge's patched runner methods count as
"bridge hooks" for their own code, and vLLM's originals they wrap, like the
rest of ``LLMEngine.step``, count to vLLM (forward, sampler, scheduler): so a
step's time splits into vLLM's and ours without a gap.

Time is the calling thread's CPU time (``time.thread_time``), so other work
on a shared host stretches wall time, not this; the engine is bound to one
core (``VLLM_CPU_OMP_THREADS_BIND``, default "1"), so torch's work on a step
runs on that thread too. Each wrapped call adds about a microsecond of
timer reads to its caller (printed as "timer cost a call").

On Model Runner V2 (``python -m vllm_plugins.bench --runner v2
host-profile``) the V2 route's functions are timed the same way (sampler
taps and speculator as the bridge, its top-k and ``StepContext`` apart);
V2's samplers, whose Triton kernels a CPU interprets, count to vLLM.

A wrapped function that no longer exists (a rename) stops the command
before any engine starts, naming it.

    python -m vllm_plugins.bench host-profile --batch-sizes 1,8,64 --max-tokens 64
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import json
import os
import time
from collections import defaultdict

from vllm_plugins.bench.cli import _int_list

# A method's speculative_config as a new user writes it (each method's own
# defaults), and vLLM's suffix decoding as the benchmarks run it.
METHODS = {
    "token_recycling": {"method": "token_recycling"},
    "token_recycling_tree": {"method": "token_recycling", "draft_shape": "tree",
                             "num_speculative_tokens": 16},
    "hybrid": {"method": "hybrid"},
    "stand": {"method": "stand"},
    "ngram_adaptive": {"method": "ngram_adaptive"},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
}

VLLM = "vLLM (engine, forward, sampler)"
STEPS = "engine steps"   # LLMEngine.step calls, counted around vLLM's timing
ENGINE_STEP = "vllm.v1.engine.llm_engine:LLMEngine.step"
BRIDGE = "bridge hooks"
TREE_ATTENTION = "tree attention rows (in the forward)"
SUFFIX = "vLLM suffix proposer"
# Components that are not ours to cut: the target's own work.
NOT_OURS = (VLLM, TREE_ATTENTION)
TOPK = "top-k stash"
DEVICE_ROUTE = "device route step"   # Model Runner V2's device route only

# The bridge's patches that run in every step (vllm_plugins.bridge.patches):
# each wrapper's own code is ours, the vLLM function it wraps is vLLM's.
STEP_PATCHES = ("runner.step_clock", "runner.verified_topk", "runner.propose",
                "tree.depth_positions", "tree.forward_plan", "tree.cpu_attention", "verify.bonus_rows",
                "verify.target_rows", "verify.bonus_min_tokens",
                "grammar.send_held_specs", "grammar.worker_compiles_held_specs",
                "grammar.end_on_matcher_errors",
                "worker.step_reports")

# (component, "module:Qualname") of each function timed as that component.
FUNCTIONS = (
    (VLLM, ENGINE_STEP),
    (TOPK, "vllm_plugins.bridge.v1.step:stash_topk"),
    ("StepContext", "vllm_plugins.bridge.v1.step:build_context"),
    ("drafts out (checks, tree record, probs)", "vllm_plugins.bridge.v1.step:record_trees"),
    ("drafts out (checks, tree record, probs)", "vllm_plugins.bridge.v1.step:set_draft_probs"),
    ("tree planning (bridge)", "vllm_plugins.bridge.v1.tree_step:plan"),
    ("tree planning (bridge)", "vllm_plugins.bridge.v1.tree_step:depth_positions"),
    ("tree planning (bridge)", "vllm_plugins.bridge.v1.tree_step:plan_attention"),
    (TREE_ATTENTION, "vllm_plugins.bridge.v1.tree_step:attend"),
    ("tree acceptance", "vllm_plugins.bridge.v1.runner:tree_sample"),
    ("tree acceptance", "vllm_plugins.bridge.v1.tree_step:accept"),
    ("tree acceptance", "vllm_plugins.bridge.v1.tree_step:write_output"),
    ("tree acceptance", "vllm_plugins.bridge.v1.tree_step:trees_output"),
    ("K/V move", "vllm_plugins.bridge.v1.tree_step:kv_moves"),
    ("K/V move", "vllm_plugins.bridge.v1.tree_step:move_accepted_kv"),
    ("proposer step (own)", "vllm_plugins.proposers.base:PluginProposer.step"),
    ("proposer step (own)", "vllm_plugins.proposers.base:PluginProposer._step"),
    ("proposer step (own)", "vllm_plugins.proposers.stand:StandProposer.step"),
    ("drafting (own)", "vllm_plugins.proposers.token_recycling:TokenRecyclingProposer.draft"),
    ("drafting (own)", "vllm_plugins.proposers.hybrid:HybridProposer.draft"),
    ("drafting (own)", "vllm_plugins.proposers.stand:StandProposer.draft"),
    ("drafting (own)", "vllm_plugins.proposers.ngram_adaptive:NgramAdaptiveProposer.draft"),
    ("Token Recycling learn", "vllm_plugins.proposers.token_recycling:"
                              "TokenRecyclingProposer.learn"),
    ("learn what was sent", "vllm_plugins.proposers.token_recycling:"
                            "TokenRecyclingProposer.proposed"),
    ("learn what was sent", "vllm_plugins.proposers.hybrid:HybridProposer.proposed"),
    ("merge", "vllm_plugins.proposers.sources.merge:Merger.merge_step"),
    ("merge: outcomes", "vllm_plugins.proposers.hybrid:HybridProposer._learn_outcomes"),
    ("merge: outcomes", "vllm_plugins.proposers.sources.calibrate:SourceCalibrator.learn"),
    (SUFFIX, "vllm.v1.spec_decode.suffix_decoding:SuffixDecodingProposer.propose"),
    # Model Runner V2: its samplers are vLLM's (their Triton kernels
    # interpreted on a CPU), our taps on them and our speculator the bridge.
    (VLLM, "vllm.v1.worker.gpu.sample.sampler:Sampler.__call__"),
    (VLLM, "vllm.v1.worker.gpu.spec_decode.rejection_sampler:RejectionSampler.__call__"),
    (BRIDGE, "vllm_plugins.bridge.v2.taps:SamplerTap.__call__"),
    (BRIDGE, "vllm_plugins.bridge.v2.taps:SamplerTap.add_request"),
    (BRIDGE, "vllm_plugins.bridge.v2.drafter_base:V2Drafter.propose"),
    (BRIDGE, "vllm_plugins.bridge.v2.speculator:PluginSpeculator.draft"),
    (TOPK, "vllm_plugins.bridge.v2.speculator:PluginSpeculator.observe_logits"),
    # The device route: its top-1 (the top-k's share) and its step of tensor ops.
    (TOPK, "vllm_plugins.bridge.v2.device_speculator:DeviceSpeculator.observe_logits"),
    (DEVICE_ROUTE, "vllm_plugins.bridge.v2.device_speculator:DeviceSpeculator.draft"),
    # The speculator calls the name it imported: that is the one to time.
    ("StepContext", "vllm_plugins.bridge.v2.speculator:build_context"),
    ("drafts out (checks, tree record, probs)",
     "vllm_plugins.bridge.v2.speculator:PluginSpeculator._checked_chains"),
    ("drafts out (checks, tree record, probs)",
     "vllm_plugins.bridge.v2.speculator:PluginSpeculator._draft_logits"),
)
# Every draft-length controller's step methods, as one component.
CONTROLLER = "controller (and tree shaping)"
CONTROLLER_MODULES = ("controllers", "goodput", "tree_goodput")
CONTROLLER_METHODS = ("observe", "max_length", "shape")
# Each draft source's step methods, as "source <name>".
SOURCE_MODULES = ("recycling", "suffix", "lookup", "stand")
SOURCE_METHODS = ("learn", "propose", "sent")


class Profile:
    """Own CPU seconds and calls per component; ``on`` only while measuring."""

    def __init__(self, clock=time.thread_time):
        self.clock = clock
        self.own: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._children: list[float] = []
        self.on = False
        self._undo: list = []

    def timed(self, label: str, fn):
        prof, clock = self, self.clock

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if not prof.on:
                return fn(*args, **kwargs)
            prof._children.append(0.0)
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                prof.own[label] += dt - prof._children.pop()
                prof.calls[label] += 1
                if prof._children:
                    prof._children[-1] += dt

        return run

    def reset(self) -> None:
        self.own.clear()
        self.calls.clear()

    # ------------------------------------------------------------ install
    def install(self) -> None:
        """Wraps every component's functions; raises naming the first that
        is missing (nothing stays wrapped then)."""
        try:
            for label, target in FUNCTIONS:
                self._wrap_attribute(label, *resolve(target))
            for owner in controller_classes():
                for name in CONTROLLER_METHODS:
                    if name in vars(owner):
                        self._wrap_attribute(CONTROLLER, owner, name)
            for owner, label in source_classes():
                for name in SOURCE_METHODS:
                    if name in vars(owner):
                        self._wrap_attribute(label, owner, name)
            for name in STEP_PATCHES:
                self._wrap_patch(name)
            self._wrap_attribute(STEPS, *resolve(ENGINE_STEP))
        except BaseException:
            self.uninstall()
            raise

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap_attribute(self, label, owner, name) -> None:
        original = vars(owner)[name]
        setattr(owner, name, self.timed(label, original))
        self._undo.append(lambda: setattr(owner, name, original))

    def _wrap_patch(self, name: str) -> None:
        from vllm_plugins.bridge.patches import PATCHES

        patch = next((p for p in PATCHES if p.name == name), None)
        if patch is None:
            raise RuntimeError(f"host-profile: the bridge has no patch {name!r}")
        if not patch.is_applied():
            raise RuntimeError(f"host-profile: patch {name!r} is not applied "
                               f"({patch.target})")
        cell = original_cell(patch.replacement())
        original = cell.cell_contents
        cell.cell_contents = self.timed(VLLM, original)
        self._undo.append(lambda: setattr(cell, "cell_contents", original))
        if patch.per_instance:   # timed on the objects it goes onto from now on
            from vllm_plugins.bridge.patching import rebuild

            self._undo.append(rebuild(patch, lambda fn: self.timed(BRIDGE, fn)))
        else:
            self._wrap_attribute(BRIDGE, *patch.owner_and_attr())


def resolve(target: str):
    """(owner, attribute) of ``module:Qualname``, the attribute defined on
    that owner itself; RuntimeError naming a missing one."""
    module, _, qualname = target.partition(":")
    *path, name = qualname.split(".")
    try:
        owner = importlib.import_module(module)
        for part in path:
            owner = getattr(owner, part)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(f"host-profile: cannot find {target} ({e})") from None
    if name not in vars(owner):
        raise RuntimeError(f"host-profile: {target} is missing: a timed function was "
                           f"renamed or moved; update FUNCTIONS in {__name__}")
    return owner, name


def source_classes() -> list[tuple[type, str]]:
    """(class, "source <name>") of each built-in draft source."""
    from vllm_plugins.proposers.sources.base import DraftSource

    out = []
    for m in SOURCE_MODULES:
        module = importlib.import_module(f"vllm_plugins.proposers.sources.{m}")
        found = [c for _, c in inspect.getmembers(module, inspect.isclass)
                 if issubclass(c, DraftSource) and c is not DraftSource
                 and c.__module__ == module.__name__]
        if not found:
            raise RuntimeError(f"host-profile: no draft source class in {module.__name__}")
        out += [(c, f"source {c.name}") for c in found]
    return out


def controller_classes() -> list[type]:
    """Every draft-length controller class of the package."""
    from vllm_plugins.proposers.draft_length.controllers import DraftLengthController

    for m in CONTROLLER_MODULES:
        importlib.import_module(f"vllm_plugins.proposers.draft_length.{m}")
    out, todo = [], [DraftLengthController]
    while todo:
        c = todo.pop()
        out.append(c)
        todo += c.__subclasses__()
    if not any(n in vars(c) for c in out for n in CONTROLLER_METHODS):
        raise RuntimeError("host-profile: no controller defines "
                           f"{CONTROLLER_METHODS}; update CONTROLLER_METHODS in {__name__}")
    return list(dict.fromkeys(out))


def original_cell(wrapper):
    """The closure cell holding the vLLM function a patch's wrapper calls
    (``functools.wraps`` names it ``__wrapped__``), searched in the
    wrapper's closure and in those of the functions it closes over."""
    fn = wrapper.fget if isinstance(wrapper, property) else wrapper
    wrapped = getattr(fn, "__wrapped__", None)
    seen, todo = set(), [fn]
    while wrapped is not None and todo:
        f = todo.pop()
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if value is wrapped:
                return cell
            if inspect.isfunction(value):
                todo.append(value)
    raise RuntimeError(f"host-profile: cannot find the vLLM function that "
                       f"{getattr(fn, '__qualname__', fn)} wraps")


class HostTime:
    """``bench methods --host-time``: each run of a method (its engine in
    this process) timed by a ``Profile``, summed per method until ``take``."""

    def __init__(self):
        import vllm_plugins.bridge as bridge

        bridge.install()
        self.prof = Profile()
        self.prof.install()
        self.own: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.steps: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def timing(self, method: str):
        prof = self.prof
        prof.reset()
        prof.on = True
        try:
            yield
        finally:
            prof.on = False
            for label, seconds in prof.own.items():
                self.own[method][label] += seconds
            self.steps[method] += prof.calls.get(STEPS, 0)

    def take(self) -> dict[str, dict[str, float]]:
        """Per method since the last take, CPU ms a step: ``ours_ms`` (all of
        ours, the top-k stash included), ``topk_ms``, ``vllm_ms``; and
        ``plain_ms``, a step's whole time (ours and vLLM's)."""
        out = {}
        for method, own in self.own.items():
            steps = max(self.steps[method], 1)
            ms = {k: 1e3 * v / steps for k, v in own.items()}
            ours = ours_ms(ms)
            out[method] = {"ours_ms": ours, "topk_ms": ms.get(TOPK, 0.0),
                           "vllm_ms": ms.get(VLLM, 0.0), "steps": steps,
                           "plain_ms": ours + ms.get(VLLM, 0.0)}
        self.own.clear()
        self.steps.clear()
        return out


def ours_ms(ms: dict[str, float]) -> float:
    """All of ours in a step's per-component milliseconds."""
    return sum(v for k, v in ms.items() if k not in NOT_OURS and k != STEPS)


def timer_cost(prof: Profile, calls: int = 20000) -> float:
    """Seconds of timer reads one wrapped call adds."""
    def noop():
        return None

    timed = prof.timed("timer", noop)
    prof.on = True
    t0 = prof.clock()
    for _ in range(calls):
        noop()
    bare = prof.clock() - t0
    t0 = prof.clock()
    for _ in range(calls):
        timed()
    cost = (prof.clock() - t0 - bare) / calls
    prof.on = False
    prof.reset()
    return cost


def labels() -> list[str]:
    """Every component, in the table's order."""
    out = [BRIDGE, CONTROLLER]
    for label, _ in FUNCTIONS:
        if label not in out:
            out.append(label)
    out += [label for _, label in source_classes()]
    return out


def measure(engine, prompts, params, batch: int, prof: Profile) -> dict:
    """One row: CPU ms a step per component over ``prompts`` run ``batch``
    at a time, with steps, MAT and tokens."""
    from vllm_plugins.bench.engines import run_batch

    prof.reset()
    tokens = forwards = 0
    prof.on = True
    try:
        for i in range(0, len(prompts), batch):
            results, _ = run_batch(engine, prompts[i:i + batch], params)
            tokens += sum(len(r.token_ids) for r in results)
            forwards += sum(r.forwards for r in results)
    finally:
        prof.on = False
    steps = prof.calls.get(STEPS, 0)
    ms = {k: 1e3 * v / max(steps, 1) for k, v in prof.own.items()}
    ours = ours_ms(ms)
    return {"batch": batch, "steps": steps, "tokens": tokens,
            "MAT": tokens / max(forwards, 1), "ms_per_step": ms, "ours_ms": ours,
            "calls_per_step": {k: v / max(steps, 1) for k, v in prof.calls.items()}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m vllm_plugins.bench host-profile",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma list of {list(METHODS)}")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=JSON",
                   help="add a method: a name and its speculative_config as JSON")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 8, 64])
    p.add_argument("--prompts", type=int, default=4,
                   help="measured prompts per batch size, at least one full batch "
                        "(rounded up to whole batches; distinct prompts)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", default=None, help="a JSON file for the rows")
    args = p.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m and m not in METHODS]
    if unknown:
        p.error(f"--methods: unknown {unknown}; known {list(METHODS)}")
    if args.prompts < 1 or args.max_tokens < 1:
        p.error("--prompts and --max-tokens must be positive")
    return args


def prompt_sets(tokenizer, sizes, prompts) -> tuple[list, dict]:
    """Warm-up prompts and, per batch size, its own measured prompts (the
    dev questions in file order, reused from the start when they run out)."""
    from vllm_plugins.bench.data import load_questions, render

    pool = [render(tokenizer, q) for q in load_questions()]
    at = 0

    def take(n):
        nonlocal at
        out = [pool[(at + i) % len(pool)] for i in range(n)]
        at += n
        return out

    warm = take(2)
    return warm, {b: take(b * -(-prompts // b)) for b in sizes}


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    from vllm_plugins.bench.engines import numba_threads_as_the_engines, quiet_vllm

    numba_threads_as_the_engines()
    quiet_vllm()
    from vllm import SamplingParams

    import vllm_plugins.bridge as bridge
    from vllm_plugins.bench.engines import (build_engine, chosen_methods, resolve_model,
                                           run_batch, shutdown_all)

    bridge.install()
    methods, configs = chosen_methods(args.methods, args.extra, METHODS)
    model = resolve_model(args.model)
    prof = Profile()
    prof.install()   # before any engine: a missing function stops here
    try:
        cost = timer_cost(prof)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                ignore_eos=True)
        rows = []
        for m in methods:
            engine = build_engine(model, configs[m], max_num_seqs=max(args.batch_sizes))
            try:
                warm, sets = prompt_sets(engine.get_tokenizer(), args.batch_sizes,
                                         args.prompts)
                run_batch(engine, warm, params)
                for b in args.batch_sizes:
                    row = measure(engine, sets[b], params, b, prof)
                    row["method"] = m
                    rows.append(row)
                    print(f"{m} batch {b}: {row['steps']} steps, MAT {row['MAT']:.2f}, "
                          f"ours {row['ours_ms']:.2f} CPU ms a step", flush=True)
                    if args.out:   # each row as it comes: a long run stopped keeps them
                        write_rows(args, rows)
            finally:
                shutdown_all([engine])
                del engine
    finally:
        prof.uninstall()
    print(report(rows, methods, args, cost))
    if args.out:
        write_rows(args, rows, cost)
    return 0


def write_rows(args, rows, cost=None) -> None:
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "timer_cost_s": cost, "rows": rows}, f, indent=1)


def report(rows, methods, args, cost) -> str:
    """One markdown table per batch size: components by method."""
    order = labels()
    lines = [f"Thread CPU ms per engine step (own time of each component), "
             f"{args.max_tokens} tokens a request, at least {args.prompts} prompts a batch size; "
             f"timer cost a call {cost * 1e6:.2f} us; "
             f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"]
    for b in args.batch_sizes:
        got = {r["method"]: r for r in rows if r["batch"] == b}
        cols = [m for m in methods if m in got]
        lines += ["", f"Batch {b}:", "",
                  "| component | " + " | ".join(cols) + " |",
                  "|---|" + "---:|" * len(cols)]
        for label in order:
            if label in NOT_OURS:
                continue
            cells = [got[m]["ms_per_step"].get(label, 0.0) for m in cols]
            lines.append(f"| {label} | " + " | ".join(_cell(c) for c in cells) + " |")
        lines.append("| **ours, all** | " + " | ".join(
            f"**{got[m]['ours_ms']:.3f}**" for m in cols) + " |")
        for label in NOT_OURS:
            lines.append(f"| {label} | " + " | ".join(
                _cell(got[m]["ms_per_step"].get(label, 0.0)) for m in cols) + " |")
        lines.append("| ours / vLLM's | " + " | ".join(
            f"{got[m]['ours_ms'] / max(got[m]['ms_per_step'].get(VLLM, 0.0), 1e-9):.3f}"
            for m in cols) + " |")
        lines.append("| steps | " + " | ".join(str(got[m]["steps"]) for m in cols) + " |")
        lines.append("| MAT | " + " | ".join(f"{got[m]['MAT']:.2f}" for m in cols) + " |")
    return "\n".join(lines)


def _cell(ms: float) -> str:
    return "" if ms == 0 else f"{ms:.3f}"
