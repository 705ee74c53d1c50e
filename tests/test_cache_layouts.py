"""The K/V cache layouts the tree path reads, and the refusal of the others.

``kernels.cache_layout.cpu_cache_views`` reads vLLM's CPU cache in place.
vLLM's cache writer packs K/V per kernel ISA, so the views are allowed only
on the ISAs of ``VIEWED_ISAS``; each is checked here against the writer for
every cache dtype. Any other ISA (``amx``, ``neon``'s BFMMLA packing of
bfloat16, ``rvv``, ``vxe``, ``vsx``, one vLLM adds) is refused at start-up
with one ValueError naming the layout, tested by faking the ISA vLLM
reports.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from vllm_plugins.bridge.v1 import runner as bridge_runner
from vllm_plugins.bridge.v1 import tree_step
from vllm_plugins.kernels.cache_layout import VIEWED_ISAS, cpu_cache_views, layout_refusal

UNVIEWED = ("amx", "neon", "rvv", "vxe", "vsx", "some_new_isa")


def write_with_vllm(isa, dtype, head_size, block_size=32, num_blocks=3, kv_heads=2):
    """(cache, slots, keys, values): random K/V stored at random slots by
    vLLM's own cache writer for ``isa``."""
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(len(isa) + head_size)
    kv = torch.zeros(num_blocks, kv_heads, block_size, 2 * head_size, dtype=dtype)
    key_half, value_half = kv.view(num_blocks, kv_heads, 2 * block_size,
                                   head_size).chunk(2, dim=2)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:40]
    keys = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(dtype)
    values = torch.randn(len(slots), kv_heads, head_size, generator=gen).to(dtype)
    ops.cpu_attn_reshape_and_cache(keys, values, key_half, value_half, slots, isa)
    return kv, slots, keys, values


def read_with_views(kv, slots):
    key_cache, value_cache = cpu_cache_views(kv)
    block_size = kv.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    return key_cache[blocks, offsets], value_cache[blocks, offsets]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("isa, head_size", [("vec", 64), ("vec16", 80)])
def test_views_read_what_vllm_writes_for_every_viewed_isa(isa, head_size, dtype):
    assert isa in VIEWED_ISAS
    kv, slots, keys, values = write_with_vllm(isa, dtype, head_size)
    got_keys, got_values = read_with_views(kv, slots)
    assert torch.equal(got_keys, keys) and torch.equal(got_values, values)


def test_every_viewed_isa_is_tested_here():
    assert set(VIEWED_ISAS) == {"vec", "vec16"}


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="vLLM's AMX cache writer runs on CPUs with AMX tiles only")
def test_amx_packs_keys_where_the_views_would_misread_them():
    kv, slots, keys, values = write_with_vllm("amx", torch.bfloat16, 64)
    got_keys, _ = read_with_views(kv, slots)
    assert not torch.equal(got_keys, keys)
    assert layout_refusal("amx")


def attention_model(head_size=64, isa=None):
    """A model with one CPU attention layer, its ISA set (as once the cache
    exists) or not yet (at start-up)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))
    with mock.patch("vllm.v1.attention.backends.cpu_attn.get_current_vllm_config",
                    return_value=config):
        impl = CPUAttentionBackendImpl(2, head_size, 0.1, 1, None, None, "auto")
    model = torch.nn.Module()
    model.attn = torch.nn.Module()
    model.attn.impl = impl
    if isa is not None:
        model.attn.isa = isa
    return model


def runner_of(model, draft_shape):
    options = {"method": "token_recycling"}
    if draft_shape is not None:
        options["draft_shape"] = draft_shape
    return SimpleNamespace(
        uses_mrope=False, get_model=lambda: model,
        vllm_config=SimpleNamespace(
            speculative_config=SimpleNamespace(vllm_plugins_options=options),
            model_config=SimpleNamespace(dtype=torch.bfloat16),
            cache_config=SimpleNamespace(block_size=128, cache_dtype="auto")))


def fake_isa(isa):
    """vLLM's CPU backend reporting ``isa`` for every layer."""
    return mock.patch("vllm.v1.attention.backends.cpu_attn._get_attn_isa",
                      return_value=isa)


@pytest.mark.parametrize("isa", UNVIEWED)
def test_tree_drafts_are_refused_at_start_up_on_a_layout_the_views_do_not_know(isa):
    with fake_isa(isa):
        with pytest.raises(ValueError, match=rf"'{isa}' K/V cache layout") as err:
            bridge_runner.runner_tree_refusal(runner_of(attention_model(), "tree"))
        # One error, naming the option to use instead.
        assert "draft_shape='tree' cannot be served here" in str(err.value)
        assert "draft_shape='chain'" in str(err.value)
        # Without draft_shape='tree', trees are cut to chains: the reason is kept.
        why = bridge_runner.runner_tree_refusal(runner_of(attention_model(), None))
    assert f"'{isa}'" in why


@pytest.mark.parametrize("isa", VIEWED_ISAS)
def test_tree_drafts_are_served_on_the_viewed_layouts(isa):
    with fake_isa(isa):
        assert bridge_runner.runner_tree_refusal(runner_of(attention_model(), "tree")) is None


def test_the_isa_a_layer_reports_once_the_cache_exists_decides():
    # bridge/v1/step.py checks again at the first step, from layer.isa.
    for isa in UNVIEWED:
        assert f"'{isa}'" in tree_step.attention_tree_refusal(attention_model(isa=isa))
    for isa in VIEWED_ISAS:
        assert tree_step.attention_tree_refusal(attention_model(isa=isa)) is None


def test_the_start_up_prediction_is_what_vllms_builder_computes():
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    runner = runner_of(attention_model(), "tree")
    for head_size in (64, 80):
        impl = attention_model(head_size).attn.impl
        assert bridge_runner.start_up_isa(runner.vllm_config)(impl) == _get_attn_isa(
            torch.bfloat16, 128, head_size, "auto")
