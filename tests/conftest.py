import gc
import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def model_path():
    from vllm_plugins.default_model import default_model_path

    return default_model_path()


def shutdown(llm) -> None:
    """Free an engine's processes now, not at interpreter exit."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
