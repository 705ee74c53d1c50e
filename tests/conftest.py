import contextlib
import gc
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Engines a test builds run in the test's own process (vLLM's in-process
# engine core and worker). A CPU engine otherwise starts two processes, each
# importing vLLM anew: about 50 s a start here against about 10 s, and an
# engine-core process that spins on its queue while the worker computes. The
# multi-process route is still what servers (tests/serving.py), tensor
# parallel ranks and the packaging test run.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def bind_worker_to_its_core() -> None:
    """scripts/test.sh runs one pytest-xdist worker per core. vLLM's CPU
    engine binds its threads to core 0 unless told otherwise, so without this
    every worker's engines would share one core and run at half speed."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ...
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(cores[int(worker[2:]) % len(cores)]))
    os.environ.setdefault("OMP_NUM_THREADS", "1")


bind_worker_to_its_core()


def in_process_engines_side_by_side() -> None:
    """Makes vLLM's in-process engine fit a test process that keeps several
    engines at once and changes environment variables between them.

    - ``EngineCore.shutdown`` destroys the process's distributed groups
      (``cleanup_dist_env_and_memory``), which every other in-process engine
      still uses (world size 1: vLLM reuses the groups a first engine set
      up); the next step of the session's ``base`` engine would fail in
      ``get_pp_group``. Here a shutdown frees the engine's memory, resets
      vLLM's environment cache and leaves the groups.
    - ``EngineCore.__init__`` turns on vLLM's cache of environment variables
      for the whole process, so a variable a later test sets (a tensor
      parallel engine's cores, ``VLLM_USE_V2_MODEL_RUNNER``) would read as it
      was. Here the cache stays off.

    Only once vLLM's engine module is loaded: no engine exists before, and a
    run of unit tests does not import vLLM for this."""
    import sys

    core = sys.modules.get("vllm.v1.engine.core")
    if core is None:
        return
    from vllm import envs

    envs.disable_envs_cache()
    if getattr(core.cleanup_dist_env_and_memory, "keeps_groups", False):
        return

    def free_memory_keep_groups(shutdown_ray: bool = False) -> None:
        envs.disable_envs_cache()
        gc.unfreeze()
        gc.collect()

    free_memory_keep_groups.keeps_groups = True
    core.cleanup_dist_env_and_memory = free_memory_keep_groups
    core.enable_envs_cache = lambda: None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    in_process_engines_side_by_side()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item):
    in_process_engines_side_by_side()


@contextlib.contextmanager
def engine_cores(cores: str):
    """Engines started inside bind to ``cores`` (vLLM's syntax, e.g. "0|1"
    for two tensor parallel ranks); the worker's own binding comes back after."""
    before = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cores
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        else:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = before


def pytest_collection_modifyitems(items):
    """Modules with end-to-end tests first, each module's tests kept together:
    scripts/test.sh hands whole modules to its workers in this order, so the
    long ones start early and the short ones fill in at the end."""
    end_to_end = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in end_to_end)


@pytest.fixture(scope="session")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def base(model_path):
    """The reference engine (no speculation), shared by the e2e modules that
    compare a speculative engine's tokens with vLLM's own: one engine start
    for all of them. max_model_len 2048 fits
    the grammar tests' schema prompts."""
    from vllm_plugins.bench.engines import build_engine

    llm = build_engine(model_path, None, max_num_seqs=8, max_model_len=2048)
    yield llm
    shutdown(llm)


def shutdown(llm) -> None:
    """Free an engine's processes now, not at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
