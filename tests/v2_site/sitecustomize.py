"""Model Runner V2 on this CPU in every process of a server started with
this directory on ``PYTHONPATH``: the API server, its engine core and its
workers each import this first (``vllm_plugins.v2_on_cpu``: Triton's
stand-in ``cpu`` backend must be there before vLLM is imported)."""

from vllm_plugins.v2_on_cpu import enable

enable()
