"""The wheel a user installs holds every module the package uses.

The suite otherwise runs the editable install, where the source folders are
imported directly: a subpackage missing from the wheel would go unnoticed.
These tests build the wheel from this checkout and (a) compare its files with
the source folders and with every module reachable from the registry and the
entry points, and (b, slow) install it into a fresh virtual environment that
borrows only the already installed vLLM stack, and serve greedy requests from
there, token for token against plain decoding.
"""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from tests.test_layers import imports

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "vllm_plugins"
# Names that must never be installed at the top level (generic, and `kernels`
# is another project's name on PyPI).
FORBIDDEN_TOP_LEVEL = ("kernels", "proposers", "logits_processors")


def package_dirs() -> dict[str, str]:
    """pyproject's mapping: import name -> source folder."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return config["tool"]["setuptools"]["package-dir"]


def source_files() -> list[str]:
    """Tracked and untracked (not ignored) files of the checkout."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def build_wheel(out: Path) -> Path:
    """Builds from a copy of the checkout, so no build folder or egg-info is
    left in the working tree."""
    src = out / "src"
    for rel in source_files():
        dest = src / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes((ROOT / rel).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                    "--no-build-isolation", "--no-index", "-q", "-w", str(out), str(src)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("vllm_plugins-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def wheel_files(wheel) -> set[str]:
    with zipfile.ZipFile(wheel) as zf:
        return set(zf.namelist())


def wheel_entry_points(wheel: Path) -> dict[str, dict[str, str]]:
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.optionxform = str
        parser.read_string(zf.read(name).decode())
    return {s: dict(parser[s]) for s in parser.sections()}


def module_source(module: str) -> Path | None:
    """The source file (or namespace folder) of a vllm_plugins module, found
    through pyproject's folder mapping, without importing anything."""
    dirs = package_dirs()
    owner = max((n for n in dirs if module == n or module.startswith(n + ".")),
                key=len, default=None)
    if owner is None:
        return None
    base = ROOT / dirs[owner] / module[len(owner):].lstrip(".").replace(".", "/")
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return base if base.is_dir() else None


def _imports(module: str) -> set[str]:
    """Every vllm_plugins module ``module`` imports, at any depth of its code
    (imports inside functions included)."""
    source = module_source(module)
    if source is None or source.is_dir():
        return set()
    found: set[str] = set()
    for name in imports(module, source):
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c imports a and a.b
            found.add(".".join(parts[:i]))
    return {m for m in found if module_source(m) is not None}


def reachable_modules(roots: set[str]) -> set[str]:
    seen, todo = set(), list(roots)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(m) - seen)
    return seen


def registry_and_entry_point_roots(wheel: Path) -> set[str]:
    from vllm_plugins.registry import METHODS

    roots = {PACKAGE}
    roots |= {m.class_path.rsplit(".", 1)[0] for m in METHODS.values()}
    for group in wheel_entry_points(wheel).values():
        roots |= {target.split(":")[0].strip() for target in group.values()}
    return roots


def in_wheel(module: str, files: set[str]) -> bool:
    base = module.replace(".", "/")
    return (f"{base}.py" in files or f"{base}/__init__.py" in files
            or any(f.startswith(base + "/") for f in files))  # a namespace package


def test_wheel_holds_every_module_reachable_from_registry_and_entry_points(wheel,
                                                                          wheel_files):
    modules = reachable_modules(registry_and_entry_point_roots(wheel))
    # The walk reaches the self-drafting methods, the bridge and the benchmark.
    assert {"vllm_plugins.proposers.layer_skip.swift", "vllm_plugins.bench.cli",
            "vllm_plugins.logits_processors.grammar"} <= modules
    missing = sorted(m for m in modules if not in_wheel(m, wheel_files))
    assert not missing, f"modules the package imports but the wheel lacks: {missing}"


def test_wheel_holds_every_source_file_under_its_import_name(wheel_files):
    """Each .py and .json under a mapped folder ships at its mapped path, so a
    subpackage added to any folder ships with no list to edit."""
    expected = set()
    for rel in source_files():
        for name, folder in package_dirs().items():
            prefix = folder.rstrip("/") + "/"
            if rel.startswith(prefix) and rel.endswith((".py", ".json")):
                expected.add(name.replace(".", "/") + "/" + rel[len(prefix):])
    assert "vllm_plugins/proposers/layer_skip/swift.py" in expected
    assert not expected - wheel_files, sorted(expected - wheel_files)


def test_wheel_installs_only_vllm_plugins(wheel_files):
    tops = {f.split("/")[0] for f in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {PACKAGE}
    assert not tops & set(FORBIDDEN_TOP_LEVEL)
    assert not any("__pycache__" in f or f.endswith(".pyc") for f in wheel_files)
    assert not any(f.startswith(f"{PACKAGE}/tests/") for f in wheel_files)


def test_wheel_entry_points(wheel):
    eps = wheel_entry_points(wheel)
    assert eps["vllm.general_plugins"] == {"vllm_plugins": "vllm_plugins:register"}
    assert eps["vllm.logits_processors"]["grammar"].startswith(
        "vllm_plugins.logits_processors.")


def test_cuda_extra_matches_the_version_gate():
    from packaging.requirements import Requirement
    from packaging.specifiers import SpecifierSet

    from vllm_plugins import SUPPORTED_VLLM, SUPPORTED_VLLM_SPEC, check_vllm_version

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (req,) = [Requirement(r) for r in config["project"]["optional-dependencies"]["cuda"]
              if Requirement(r).name == "vllm"]
    assert req.specifier == SpecifierSet(SUPPORTED_VLLM_SPEC)
    for major, minor in SUPPORTED_VLLM:
        assert req.specifier.contains(f"{major}.{minor}.0")
        check_vllm_version(f"{major}.{minor}.0")
    assert not req.specifier.contains("0.31.9") and not req.specifier.contains("0.34.0")


# Runs inside the fresh environment: plain decoding, then each method, one
# engine at a time, greedy; prints one JSON line.
SERVE_FROM_WHEEL = r"""
import gc, json, sys
from pathlib import Path

import vllm_plugins
from vllm import SamplingParams
from vllm_plugins.bench.engines import build_engine, engine_stats
from vllm_plugins.default_model import default_model_path

prompts = ["The capital of France is Paris. The capital of France is",
           "Count: one, two, three, four, five, six, seven, eight,"]
params = SamplingParams(temperature=0.0, max_tokens=32)
methods = json.loads(sys.argv[1])
out = {"vllm_plugins": vllm_plugins.__file__, "outputs": {}, "drafted": {}, "errors": {}}
for name, spec in methods.items():
    llm = build_engine(default_model_path(), spec, max_num_seqs=2, max_model_len=512,
                       kv_cache_mib=256)
    out["outputs"][name] = [list(o.outputs[0].token_ids)
                            for o in llm.generate(prompts, params, use_tqdm=False)]
    if spec:
        stats = engine_stats(llm)  # the runner's counters, and the proposer's
        out["drafted"][name] = stats.get("drafted", 0)
        out["errors"][name] = (stats.get("proposer") or {}).get("num_errors")
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
print("RESULT " + json.dumps(out))
"""

WHEEL_METHODS = {
    "plain": None,
    "swift": {"method": "swift", "num_speculative_tokens": 4, "skip_ratio": 0.2,
              "search_rounds": 8},
    "token_recycling": {"method": "token_recycling", "num_speculative_tokens": 4,
                        "draft_length": "fixed"},
}


@pytest.mark.slow
def test_wheel_serves_from_a_fresh_environment(wheel, tmp_path):
    """Installs the wheel (not editable) into a new virtual environment whose
    only link to this one is a .pth line naming its site-packages, for vLLM
    and the other dependencies: that line adds the folder to sys.path without
    running its .pth files, so the editable install's import hook stays out."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    # Installed before the .pth exists, so pip sees an empty environment.
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                    "--no-deps", "--no-index", "-q", str(wheel)], check=True)
    site = subprocess.run([str(python), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "borrowed_stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    # Engine core and worker in processes of their own, as a deployment runs
    # them: each finds the plugin through the wheel's entry points.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    proc = subprocess.run([str(python), "-c", SERVE_FROM_WHEEL, json.dumps(WHEEL_METHODS)],
                          cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=1500)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:] + proc.stderr[-5000:])
    result = json.loads(lines[-1][len("RESULT "):])

    assert Path(result["vllm_plugins"]).is_relative_to(venv), result["vllm_plugins"]
    plain = result["outputs"]["plain"]
    assert all(len(t) == 32 for t in plain)
    for name in ("swift", "token_recycling"):
        assert result["outputs"][name] == plain, name
        assert result["drafted"][name] > 0, (name, result["drafted"])
        assert result["errors"][name] == 0, (name, result["errors"])
