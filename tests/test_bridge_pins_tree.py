"""Pins what a tree step's attention relies on in vLLM's CPU backend beyond
the patched forward (tests/test_bridge_pins.py has the patches' own pins)."""

import inspect

from tests.test_bridge_pins import params


def test_cpu_attention_metadata_can_be_cut_to_some_requests():
    # bridge/v1/tree_step.py subset_metadata: vLLM's CPU attention over the
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


def test_cpu_backend_picks_each_groups_isa_as_the_start_up_check_predicts():
    # bridge/v1/runner.py start_up_isa: the K/V layout check runs at start-up,
    # before the cache exists, on the ISA the metadata builder will give
    # each layer (layer.isa, which the cache writer and the first step's
    # check read): _get_attn_isa(model dtype, block size, head size, cache dtype).
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionMetadataBuilder, _get_attn_isa)

    assert params(_get_attn_isa) == ["dtype", "block_size", "head_size", "kv_cache_dtype"]
    init = " ".join(inspect.getsource(CPUAttentionMetadataBuilder.__init__).split())
    for line in ("self.dtype = vllm_config.model_config.dtype",
                 "self.block_size = kv_cache_spec.block_size",
                 "self.head_dim = kv_cache_spec.head_size",
                 "self.kv_cache_dtype = vllm_config.cache_config.cache_dtype",
                 "self.isa = _get_attn_isa( self.dtype, self.block_size, self.head_dim, "
                 "self.kv_cache_dtype, )",
                 "self._set_isa_to_layers(layer_names)"):
        assert line in init, line
    assert "layer.isa = self.isa" in inspect.getsource(
        CPUAttentionMetadataBuilder._set_isa_to_layers)
