"""Build a vLLM source tree from a release wheel plus the installed CPU build's
compiled extensions, so the package's fast suite can run against a vLLM release
that has no CPU wheel.

The overlay folder holds one ``vllm/`` package: every file of the wheel except
its compiled extensions (``*.so``, built for CUDA), and every ``*.so`` of the
installed vLLM (the CPU build's kernels). No Python file of the installed vLLM
is kept, so a module the release removed is missing here too. Put the folder
first on ``PYTHONPATH``; the installed vLLM is left untouched.

    python scripts/vllm_overlay.py WHEEL OUT_DIR

Rebuilds only when the wheel or the installed vLLM changed (a stamp in OUT_DIR).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import zipfile
from pathlib import Path

STAMP = ".vllm-overlay-stamp"


def installed_vllm_dir() -> Path:
    """The installed ``vllm`` package folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def _stamp(wheel: Path, installed: Path) -> str:
    h = hashlib.sha256()
    h.update(f"{wheel.resolve()}:{wheel.stat().st_size}:{wheel.stat().st_mtime_ns}".encode())
    for so in sorted(installed.rglob("*.so")):
        h.update(f"{so.relative_to(installed)}:{so.stat().st_size}".encode())
    version = installed / "_version.py"
    if version.is_file():
        h.update(version.read_bytes())
    return h.hexdigest()


def build(wheel: Path, out: Path, installed: Path | None = None) -> Path:
    """Writes ``out/vllm`` and returns ``out``; reuses it when up to date."""
    installed = installed or installed_vllm_dir()
    stamp = _stamp(wheel, installed)
    if (out / STAMP).is_file() and (out / STAMP).read_text() == stamp:
        return out
    target = out / "vllm"
    if target.exists():
        shutil.rmtree(target)
    (out / STAMP).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist()
                   if n.startswith("vllm/") and not n.endswith((".so", "/"))]
        if not members:
            raise SystemExit(f"{wheel} holds no vllm/ package")
        for name in members:
            dest = out / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(name) as src, open(dest, "wb") as dst:
                shutil.copyfileobj(src, dst)
    for so in installed.rglob("*.so"):
        dest = target / so.relative_to(installed)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(so, dest)
    (out / STAMP).write_text(stamp)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(build(args.wheel, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
