import contextlib
import gc
import os

import pytest

from vllm_plugins.bench.engines import numba_threads_as_the_engines

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
    # vLLM's ngram proposer would otherwise leave torch on numba's default
    # count (every core) for the rest of the worker's tests.
    numba_threads_as_the_engines()


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


# Modules that share an engine (SharedEngines) or a reference, each against
# the first module of its group: one worker runs a group's modules one after
# the other (pytest_xdist_make_scheduler), so what they share is built once.
MODULE_GROUPS = {
    # test_e2e_speculative's tests and its plain references (_BASE).
    "tests/test_layer_skip_e2e.py": "tests/test_e2e_speculative.py",
    # The STAND engine (test_stand_e2e.stand_engine).
    "tests/test_structured_sampling_e2e.py": "tests/test_stand_e2e.py",
    # The Token Recycling engine (engine(model_path, RECYCLING)).
    "tests/test_processors_speculation_e2e.py": "tests/test_asap_e2e.py",
}


def module_group(nodeid: str) -> str:
    module = nodeid.split("::", 1)[0]
    return MODULE_GROUPS.get(module, module)


def engine_group(item) -> str:
    return module_group(item.nodeid)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, when installed
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` (scripts/test.sh) with a module group as one unit.
    (xdist's own ``loadgroup`` reads ``xdist_group`` marks through a node
    attribute pytest 9 no longer has: each test would go out alone.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileGroupScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return module_group(nodeid)

    return LoadFileGroupScheduling(config, log)


def pytest_collection_modifyitems(items):
    """Modules with end-to-end tests first, each group's tests kept together:
    scripts/test.sh hands whole groups (MODULE_GROUPS, else modules) to its
    workers in this order, so the long ones start early and the short ones
    fill in at the end."""
    end_to_end = {item.path for item in items if item.get_closest_marker("slow")}
    first = {}
    for i, item in enumerate(items):
        first.setdefault(engine_group(item), (item.path not in end_to_end, i))
    items.sort(key=lambda item: first[engine_group(item)])


class SharedEngines:
    """Engines by configuration, kept between the modules of one group.

    A module fixture asks ``shared_engines.get(build, *args)`` where it would
    call ``build(*args)``; a later module of the same group (MODULE_GROUPS:
    one worker runs a whole group, one module after the other) that asks for
    the same ``build`` and arguments gets the same engine instead of a new
    start. After the group's last test on this worker its engines are shut
    down (``pytest_runtest_teardown``), so a worker holds the session's
    ``base`` engine, the engines of the group it runs and none idle beyond:
    about three CPU engines of up to 3 GB.

    An engine keeps its proposer's state (tables, stores) from one module to
    the next, as a server keeps it from one request to the next: modules
    share only where their checks hold whatever earlier requests taught it."""

    def __init__(self):
        self.engines: dict = {}

    def get(self, build, *args):
        key = (build.__module__, build.__qualname__, repr(args))
        if key not in self.engines:
            self.engines[key] = build(*args)
        return self.engines[key]

    def close(self) -> None:
        while self.engines:
            shutdown(self.engines.popitem()[1])


SHARED = SharedEngines()


@pytest.fixture(scope="session")
def shared_engines():
    yield SHARED
    SHARED.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    """After a group's last test on this worker, its shared engines go."""
    in_process_engines_side_by_side()
    yield
    if SHARED.engines and (nextitem is None or engine_group(nextitem) != engine_group(item)):
        SHARED.close()


@pytest.fixture(scope="session")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def base(model_path):
    """The reference engine (no speculation), shared by the e2e modules that
    compare a speculative engine's tokens with vLLM's own: one engine start
    for all of them. max_model_len 2048 fits the grammar tests' schema
    prompts; max_num_seqs 64 runs their sampled references (hundreds of
    seeded requests of a few tokens) 64 at a time, about twice as fast as 8
    at a time, with the same tokens (each request draws from its own seed)."""
    from vllm_plugins.bench.engines import build_engine

    llm = build_engine(model_path, None, max_num_seqs=64, max_model_len=2048)
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
