"""Pins what a tree step's attention relies on in vLLM's CPU backend beyond
the patched forward (tests/test_bridge_pins.py has the patches' own pins)."""

import inspect

from tests.test_bridge_pins import params


def test_cpu_attention_metadata_can_be_cut_to_some_requests():
    # bridge/tree_step.py subset_metadata: vLLM's CPU attention over the
    # other requests of a tree step, with CPUAttentionMetadata replaced
    # field by field and the scheduler metadata the builder would compute.
    import dataclasses

    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionMetadata, CPUAttentionMetadataBuilder)

    fields = {f.name for f in dataclasses.fields(CPUAttentionMetadata)}
    assert {"num_actual_tokens", "max_query_len", "query_start_loc", "max_seq_len",
            "seq_lens", "block_table", "scheduler_metadata", "causal",
            "dynamic_causal"} <= fields
    assert params(ops.cpu_attn_get_scheduler_metadata) == [
        "num_reqs", "num_heads", "num_kv_heads", "head_dim", "seq_lens", "dtype",
        "query_start_loc", "causal", "sliding_window_size", "isa", "enable_kv_split",
        "dynamic_causal", "kv_cache_dtype"]
    build = inspect.getsource(CPUAttentionMetadataBuilder.build)
    for arg in ("num_heads=self.num_heads", "head_dim=self.head_dim", "dtype=self.dtype",
                "sliding_window_size=self.window_size", "isa=self.isa",
                "enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV",
                "kv_cache_dtype=self.kv_cache_dtype"):
        assert arg in build, arg
    assert isinstance(envs.VLLM_CPU_ATTN_SPLIT_KV, bool)
