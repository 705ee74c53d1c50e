"""Helpers for tests: tiny models that load fast in HF transformers and vLLM.

``tiny_llama(path)`` writes a randomly initialised Llama with the default
model's tokenizer (SmolLM2's, vocab 49152), so token ids, chat template and
special tokens match the real model while every forward pass is cheap. Its
outputs are noise: use it for shapes, plumbing and exactness checks (greedy
output with and without speculation must match), never for acceptance rates.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from vllm_plugins.default_model import default_model_path

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)
_MARKER = "vllm_plugins_tiny.json"


def tiny_llama(
    path: str | Path,
    *,
    num_layers: int = 4,
    hidden_size: int = 64,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    initializer_range: float = 0.2,
    tie_word_embeddings: bool = False,
) -> str:
    """Write a tiny random Llama to ``path`` and return ``path`` as a string.

    The head size (``hidden_size // num_heads``, 32 by default) must be one that
    vLLM's attention backends support: 32, 64, 80, 96, 112, 128, ... on CPU.
    Same arguments and seed give the same weights; a folder already written
    with the same arguments is reused as is.

    ``tie_word_embeddings`` with a small ``initializer_range`` (0.05) gives a
    model that mostly repeats its last token and now and then switches: drafts
    are accepted in runs and rejected at the switches, which an exactness test
    needs (the default's noise output leaves n-gram methods nothing to draft).
    """
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    path = Path(path)
    spec = {
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "seed": seed,
        "initializer_range": initializer_range,
        "tie_word_embeddings": tie_word_embeddings,
    }
    marker = path / _MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == spec:
                return str(path)
        except ValueError:
            pass
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(
            f"tiny_llama: hidden_size={hidden_size} must divide by num_heads={num_heads}, "
            f"and num_heads by num_kv_heads={num_kv_heads}"
        )

    source = Path(default_model_path())
    base = AutoConfig.from_pretrained(source)
    config = LlamaConfig(
        vocab_size=base.vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=base.rms_norm_eps,
        bos_token_id=base.bos_token_id,
        eos_token_id=base.eos_token_id,
        pad_token_id=base.pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        dtype="float32",
    )
    # Random weights with a std large enough that logits are not all equal.
    config.initializer_range = initializer_range
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()

    path.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    marker.write_text(json.dumps(spec, indent=2) + "\n")
    return str(path)
