"""The tools that check the next vLLM release on its source
(scripts/vllm_api_diff.py, scripts/vllm_overlay.py), on small made-up trees."""

from __future__ import annotations

import importlib.util
import io
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


api_diff = load("vllm_api_diff")
overlay = load("vllm_overlay")

OLD = {
    "vllm/__init__.py": "",
    "vllm/config/__init__.py": "from vllm.config.vllm import VllmConfig\n",
    "vllm/config/vllm.py": """
        class VllmConfig:
            '''Old docstring.'''
            @property
            def num_lookahead_tokens(self):
                '''Old.'''
                return 0
        """,
    "vllm/runner.py": """
        class Runner:
            def step(self, x):
                return x + 1

            def sample(self, x):
                return x

        def helper():
            return 1
        """,
}
NEW = {
    **OLD,
    # Docstrings and formatting only: unchanged.
    "vllm/config/vllm.py": """
        class VllmConfig:
            '''New docstring.'''

            @property
            def num_lookahead_tokens(self):
                return (0)
        """,
    # step changed, sample unchanged, helper moved to another module.
    "vllm/runner.py": """
        from .helpers import helper

        class Runner:
            def step(self, x):
                return x + 2

            def sample(self, x):
                return x
        """,
    "vllm/helpers.py": """
        def helper():
            return 1
        """,
}


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root


def write_wheel(path: Path, files: dict[str, str | bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        for rel, data in files.items():
            zf.writestr(rel, textwrap.dedent(data) if isinstance(data, str) else data)
    return path


def statuses(old_tree, new_tree, names):
    out = io.StringIO()
    warned = api_diff.report(old_tree, new_tree, names, show_diff=True, out=out)
    lines = out.getvalue().splitlines()
    # Each line: the status right-aligned in 21 columns, two spaces, the name.
    return warned, {n: next(l[:21].strip() for l in lines if l[23:].startswith(n))
                    for n in names}, out.getvalue()


def test_api_diff_tells_changed_from_unchanged_moved_gone_and_ours(tmp_path):
    old = api_diff.SourceTree(write_tree(tmp_path / "old", OLD))
    new = api_diff.SourceTree(write_wheel(tmp_path / "new.whl", NEW))
    names = ["vllm.config:VllmConfig.num_lookahead_tokens", "vllm.runner:Runner.step",
             "vllm.runner:Runner.sample", "vllm.runner:helper",
             "vllm.runner:Runner.ours_added", "vllm.config:VllmConfig.gone_attr"]
    warned, got, text = statuses(old, new, names)
    assert got == {
        "vllm.config:VllmConfig.num_lookahead_tokens": api_diff.UNCHANGED,
        "vllm.runner:Runner.step": api_diff.CHANGED,
        "vllm.runner:Runner.sample": api_diff.UNCHANGED,
        "vllm.runner:helper": api_diff.MOVED,
        "vllm.runner:Runner.ours_added": api_diff.OURS,
        "vllm.config:VllmConfig.gone_attr": api_diff.OURS,
    }
    assert warned == 2
    assert "-    return x + 1" in text and "+    return x + 2" in text


def test_api_diff_reports_a_name_the_new_release_removed(tmp_path):
    new_files = dict(NEW, **{"vllm/runner.py": "class Runner:\n    pass\n"})
    old = api_diff.SourceTree(write_tree(tmp_path / "old", OLD))
    # The vllm/ folder itself, as a path to an unpacked release.
    new = api_diff.SourceTree(write_tree(tmp_path / "new", new_files) / "vllm")
    warned, got, _ = statuses(old, new, ["vllm.runner:Runner.sample"])
    assert got == {"vllm.runner:Runner.sample": api_diff.GONE} and warned == 1


def test_api_diff_finds_every_bridge_name_in_the_installed_vllm():
    """Every name the bridge lists resolves in the vLLM it runs on, except
    the attributes the bridge adds itself; a typo in the list shows here."""
    from vllm_plugins.bridge.patches import PATCHES

    vllm_dir = api_diff.installed_vllm()
    tree = api_diff.SourceTree(vllm_dir)
    added = {p.target for p in PATCHES if getattr(p, "adds", False)}
    for name in api_diff.bridge_names():
        module, _, qualname = name.partition(":")
        found = api_diff.find(tree, module, qualname)
        assert (found is None) == (name in added), name


def test_overlay_takes_python_from_the_wheel_and_kernels_from_the_install(tmp_path):
    installed = write_tree(tmp_path / "site" / "vllm", {
        "__init__.py": "VERSION = 'old'\n", "removed_in_new.py": "",
        "ops.json": "{}"})
    (installed / "_C.abi3.so").write_bytes(b"cpu kernels")
    (installed / "sub").mkdir()
    (installed / "sub" / "_ext.abi3.so").write_bytes(b"cpu ext")
    wheel = write_wheel(tmp_path / "vllm-9.9.9-py3-none-any.whl", {
        "vllm/__init__.py": "VERSION = 'new'\n", "vllm/ops.json": '{"new": 1}',
        "vllm/_C.abi3.so": b"cuda kernels", "vllm-9.9.9.dist-info/METADATA": "x"})

    out = overlay.build(wheel, tmp_path / "overlay", installed)
    files = {p.relative_to(out / "vllm").as_posix()
             for p in (out / "vllm").rglob("*") if p.is_file()}
    assert files == {"__init__.py", "ops.json", "_C.abi3.so", "sub/_ext.abi3.so"}
    assert (out / "vllm" / "__init__.py").read_text() == "VERSION = 'new'\n"
    assert (out / "vllm" / "_C.abi3.so").read_bytes() == b"cpu kernels"
    assert not (out / "vllm-9.9.9.dist-info").exists()
    # The release's metadata as a CPU build names it (vLLM reads it by name).
    from importlib.metadata import PathDistribution

    dist = PathDistribution(out / "vllm-9.9.9+cpu.dist-info")
    assert (dist.metadata["Name"], dist.version) == ("vllm", "9.9.9+cpu")

    # Up to date: not rebuilt (a file written meanwhile survives).
    (out / "vllm" / "marker").write_text("")
    overlay.build(wheel, tmp_path / "overlay", installed)
    assert (out / "vllm" / "marker").exists()


def test_overlay_refuses_a_wheel_without_vllm(tmp_path):
    installed = write_tree(tmp_path / "site" / "vllm", {"__init__.py": ""})
    wheel = write_wheel(tmp_path / "other.whl", {"other/__init__.py": ""})
    with pytest.raises(SystemExit, match="no vllm/ package"):
        overlay.build(wheel, tmp_path / "overlay", installed)
