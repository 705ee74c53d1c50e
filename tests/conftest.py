import gc
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def base(model_path):
    """The reference engine (no speculation), shared by the e2e modules that
    compare a speculative engine's tokens with vLLM's own: one engine start
    for all of them (each start costs ~35 s of CI). max_model_len 2048 fits
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
