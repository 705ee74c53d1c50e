"""Engines side by side in one process, driven step by step.

Driving ``LLMEngine.step()`` ourselves gives, per request, the number of
target forwards that produced its tokens, so MAT (output tokens per target
forward) is exact and the same for every method, vLLM's included.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

METHOD_CONFIGS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 5,
              "prompt_lookup_max": 5, "prompt_lookup_min": 2},
    "suffix": {"method": "suffix", "num_speculative_tokens": 6},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 6,
                        "draft_length": "fixed"},
    "token_recycling+goodput": {"method": "token_recycling",
                                "num_speculative_tokens": 6,
                                "draft_length": "goodput"},
    "hybrid": {"method": "hybrid"},
    # vLLM's own n-gram lookup through our bridge, with and without the
    # controller: the pair isolates what the draft-length decision is worth.
    "ngram_adaptive": {"method": "ngram_adaptive", "num_speculative_tokens": 5,
                       "draft_length": "fixed"},
    "ngram+goodput": {"method": "ngram_adaptive", "num_speculative_tokens": 5,
                      "draft_length": "goodput"},
}


def suffix_available() -> bool:
    try:
        import arctic_inference  # noqa: F401
    except ImportError:
        return False
    return True


# What a benchmark's output stays readable with: vLLM's errors only (each
# engine start logs pages of INFO lines and repeats the same warnings as the
# engine before it); no C++ warnings from torch; no deprecation notices.
QUIET_ENVIRONMENT = {
    "VLLM_LOGGING_LEVEL": "ERROR",
    "TORCH_CPP_LOG_LEVEL": "ERROR",
    "PYTHONWARNINGS": "ignore::FutureWarning,ignore::DeprecationWarning",
}


def numba_threads_as_the_engines() -> None:
    """Numba's thread count made the engines' own, before numba is imported.

    Under numba's OpenMP layer numba's thread count is torch's too. vLLM's
    ``ngram`` proposer launches numba's threads at numba's default count
    (every CPU of the host) and sets that count back after each proposal,
    so with engines in this process every later forward, of every engine,
    would run on that many threads over the cores the engines are bound to:
    steps that verify several tokens slow down most. The engines' count is
    ``OMP_NUM_THREADS``, else the cores of a single-rank
    ``VLLM_CPU_OMP_THREADS_BIND`` ("0", "0-3", "0,2"). A count the caller
    set is kept."""
    threads = os.environ.get("OMP_NUM_THREADS")
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if not threads and bind and all(c.isdigit() or c in ",-" for c in bind):
        cores = set()
        for part in bind.split(","):
            lo, _, hi = part.partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
        threads = str(len(cores))
    if threads:
        os.environ.setdefault("NUMBA_NUM_THREADS", threads)


def quiet_vllm() -> None:
    """Keeps a benchmark's output to its progress bar and tables.

    Call before vLLM is imported: vLLM reads its logging level once, at
    import, and engine processes inherit the environment. A variable the
    caller already set is left as it is.
    """
    import warnings

    for name, value in QUIET_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    if os.environ["PYTHONWARNINGS"] == QUIET_ENVIRONMENT["PYTHONWARNINGS"]:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)


def add_extra_methods(configs: dict, methods: list[str], extra: list[str]) -> None:
    """``--extra NAME=JSON`` items: each NAME's speculative config into
    ``configs`` and NAME onto ``methods``; a malformed item stops the run
    naming it."""
    import json

    for item in extra:
        name, sep, spec = item.partition("=")
        if not sep:
            raise SystemExit(f"--extra wants NAME=JSON, got {item!r}")
        configs[name] = json.loads(spec)
        methods.append(name)


def chosen_methods(names: str, extra: list[str], known: dict) -> tuple[list[str], dict]:
    """The methods of a comma list plus each ``--extra NAME=JSON``, and the
    configs by name (``known`` and the extra ones); ``suffix`` is left out,
    with a note, where arctic-inference is not installed."""
    methods = [m for m in names.split(",") if m]
    configs = dict(known)
    add_extra_methods(configs, methods, extra)
    if "suffix" in methods and not suffix_available():
        print("suffix: arctic-inference is not installed; skipping that method")
        methods.remove("suffix")
    return methods, configs


def build_engine(model: str, spec: dict | None, *, max_num_seqs: int = 16,
                 max_model_len: int = 2048, enforce_eager: bool = True,
                 seed: int = 0, kv_cache_mib: int = 512):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    llm = LLM(model=model, dtype="float32", max_model_len=max_model_len,
              max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
              speculative_config=dict(spec) if spec else None, seed=seed,
              kv_cache_memory_bytes=kv_cache_mib * 2**20,
              disable_log_stats=False, use_tqdm_on_load=False)
    if spec:
        # Drafted / accepted counts for vLLM's own drafters too (ours always
        # count); an engine that is not asked keeps nothing of ours.
        llm.llm_engine.collective_rpc("vllm_plugins_count_steps")
    return llm


@dataclass
class RequestResult:
    token_ids: list[int]
    forwards: int


def run_batch(llm, prompts: list[list[int]], params, in_flight: int | None = None
              ) -> tuple[list[RequestResult], float]:
    """Generate ``prompts``; returns per-request results (in prompt order) and
    seconds.

    By default all prompts start at once and the batch drains as requests
    finish (a static batch: its last steps run fewer requests). With
    ``in_flight`` = B, at most B requests run and each one that finishes is
    replaced at once from the queue, as a server at concurrency B keeps its
    batch full: then a request that speculation finishes early makes room
    for the next, where in a static batch it only shrinks the batch.
    """
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    tokens = {r: [] for r in ids}
    forwards = {r: 0 for r in ids}
    queue = list(zip(ids, prompts))[::-1]
    limit = len(queue) if in_flight is None else max(int(in_flight), 1)
    running = 0

    def admit():
        nonlocal running
        while queue and running < limit:
            rid, p = queue.pop()
            engine.add_request(rid, {"prompt_token_ids": p}, params)
            running += 1

    start = time.perf_counter()
    while True:
        if not engine.has_unfinished_requests():
            running = 0
        admit()
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            new = out.outputs[0].token_ids if out.outputs else []
            if new:
                tokens[out.request_id].extend(new)
                forwards[out.request_id] += 1
            if out.finished:
                running -= 1
    seconds = time.perf_counter() - start
    return [RequestResult(tokens[r], forwards[r]) for r in ids], seconds


def engine_stats(llm) -> dict:
    return llm.llm_engine.collective_rpc("vllm_plugins_stats")[0]


def model_runner(llm):
    """The model runner of an in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    executor = llm.llm_engine.engine_core.engine_core.model_executor
    return executor.driver_worker.worker.model_runner


def resolve_model(model: str | None) -> str:
    """``--model`` when given, else the embedded default model, so that every
    benchmark runs as it comes, with no download and no path to pass."""
    if model is not None:
        return model
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


def acceptance_between(before: dict, after: dict) -> dict:
    """Per method, accepted / drafted tokens between two ``engine_stats``
    snapshots ({method: stats}); None where nothing was drafted.

    The engine's counts run from its start, warm-up included: only the
    difference describes the measured runs.
    """
    out = {}
    for m, now in after.items():
        d = now.get("drafted", 0) - before[m].get("drafted", 0)
        a = now.get("accepted", 0) - before[m].get("accepted", 0)
        out[m] = a / d if d else None
    return out


def shutdown_all(engines) -> None:
    """Stop each engine's core process now rather than at interpreter exit,
    so idle engines hold no CPU or memory while a benchmark finishes up; a
    failed shutdown costs nothing measured, so it is ignored."""
    for llm in engines:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001
            pass
