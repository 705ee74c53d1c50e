"""Layers run one way: only the bridge touches vLLM's internals, and nothing
below the bridge imports it.

The bridge (``vllm_plugins/bridge/``) patches vLLM and calls the proposers,
logits processors and kernels; they must not call back into it, or a change
to one vLLM internal would reach code that is meant to stand apart from vLLM
(and import cycles follow). Above the bridge are only the entry point
(``vllm_plugins/__init__.py``, which installs it) and the benchmarks. Below it,
vLLM is imported only through its public surface. Imports are read from the
source (``ast``), at every depth (inside functions and ``TYPE_CHECKING``
blocks too), so a lazy import counts as much as a top-level one.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BRIDGE = "vllm_plugins.bridge"
# Modules that sit above the bridge: they may import it and vLLM at will.
ABOVE = ("vllm_plugins", "vllm_plugins.bench")
# What code below the bridge may import from vLLM: names from its top level
# (``from vllm import SamplingParams``) and these modules (with submodules).
VLLM_PUBLIC = (
    "vllm.config",
    "vllm.logger",
    "vllm.sampling_params",
    "vllm.tokenizers",
    # The interfaces a logits-processor plugin implements, V1 and V2 runner.
    "vllm.v1.sample.logits_processor.interface",
    "vllm.v1.worker.gpu.sample.logits_processor.interface",
)
# Module below the bridge -> the vLLM internal it may import, and why.
VLLM_EXCEPTIONS = {
    ("vllm_plugins.proposers.ngram_adaptive", "vllm.v1.spec_decode.ngram_proposer"):
        "the method is vLLM's own n-gram lookup under our draft-length policy; "
        "the function is pinned (tests/test_bridge_pins.py::test_ngram_lookup_function) "
        "and listed in the bridge's RELIED_ON",
    ("vllm_plugins.logits_processors.awrs_draw", "vllm.v1.sample.sampler"):
        "AWRS replays the sampler's draw of a row (greedy_sample); pinned by "
        "tests/test_bridge_pins_processors.py::test_sampler_draws_as_awrs_replays_them",
    ("vllm_plugins.logits_processors.awrs_choice", "vllm.v1.sample.ops.topk_topp_sampler"):
        "AWRS applies vLLM's own top-k / top-p to a masked row; same pin",
}


def modules() -> dict[str, Path]:
    """Every module of the package, by its installed name, through
    pyproject's folder mapping (``vllm_plugins.proposers`` is ``proposers/``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    out = {}
    for package, folder in config["tool"]["setuptools"]["package-dir"].items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join([package, *parts])
            # A folder mapped on its own is found under its own name only.
            out.setdefault(name, path)
    return out


def imports(module: str, path: Path) -> list[str]:
    """Every module name ``module`` imports (``from a import b`` gives both
    ``a`` and ``a.b``: b may be a submodule), relative imports resolved."""
    is_pkg = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = ".".join(parts[:len(parts) - node.level + is_pkg])
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            found += [base] + [f"{base}.{a.name}" for a in node.names]
    return found


def below_bridge() -> dict[str, Path]:
    return {m: p for m, p in modules().items()
            if not (m == BRIDGE or m.startswith(BRIDGE + ".")
                    or m == ABOVE[0] or m == ABOVE[1] or m.startswith(ABOVE[1] + "."))}


def is_under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def vllm_import_allowed(module: str, name: str) -> bool:
    if name == "vllm":
        return True
    if any(is_under(name, p) for p in VLLM_PUBLIC):
        return True
    head, _, last = name.rpartition(".")
    if head == "vllm" and last[:1].isupper():
        return True  # from vllm import SamplingParams, LLM, ...
    return any(m == module and is_under(name, v) for m, v in VLLM_EXCEPTIONS)


def test_the_rule_sees_every_layer():
    found = below_bridge()
    for package in ("vllm_plugins.proposers", "vllm_plugins.logits_processors",
                    "vllm_plugins.kernels", "vllm_plugins.tree", "vllm_plugins.grammar"):
        assert any(is_under(m, package) for m in found), package
    assert "vllm_plugins.self_draft" in found and "vllm_plugins.registry" in found
    assert not any(is_under(m, BRIDGE) for m in found)


@pytest.mark.parametrize("module", sorted(below_bridge()))
def test_nothing_below_the_bridge_imports_it(module):
    bad = [n for n in imports(module, below_bridge()[module]) if is_under(n, BRIDGE)]
    assert not bad, f"{module} imports the bridge: {sorted(set(bad))}"


@pytest.mark.parametrize("module", sorted(below_bridge()))
def test_only_the_bridge_imports_vllm_internals(module):
    bad = [n for n in imports(module, below_bridge()[module])
           if is_under(n, "vllm") and not vllm_import_allowed(module, n)]
    assert not bad, (f"{module} imports vLLM internals {sorted(set(bad))}; only "
                     "vllm_plugins/bridge/ may (as a named Patch or a RELIED_ON name)")


def test_the_vllm_exceptions_are_still_needed():
    mods = modules()
    for (module, name), why in VLLM_EXCEPTIONS.items():
        assert module in mods, f"exception for a module that is gone: {module}"
        assert any(is_under(n, name) for n in imports(module, mods[module])), (
            f"{module} no longer imports {name}: drop its exception ({why})")
