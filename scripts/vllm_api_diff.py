"""Which vLLM functions and classes the bridge touches differ between two vLLM
source trees: the early warning for the next vLLM release.

The names come from the bridge itself (``vllm_plugins.bridge.patches.vllm_names()``,
``module:qualname``). Each is looked up in both trees by reading the source
(nothing of either vLLM is imported), following ``from x import y`` re-exports,
and its definition is compared as a syntax tree without docstrings, so only a
change of code counts, not of comments, docstrings or line numbers.

    python scripts/vllm_api_diff.py NEW [--old OLD] [--diff]

NEW and OLD are a vLLM wheel, a folder holding ``vllm/`` or the ``vllm/`` folder
itself; OLD defaults to the installed vLLM. Exit status 1 when a name changed,
moved or is gone in NEW.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

UNCHANGED, CHANGED, MOVED, GONE, ADDED, OURS = (
    "unchanged", "changed", "moved", "gone", "new only", "ours (absent in both)")
WARN = {CHANGED, MOVED, GONE}


class SourceTree:
    """The ``vllm`` package's Python sources in a wheel or a folder."""

    def __init__(self, where: Path):
        self.where = where
        self._zip = zipfile.ZipFile(where) if where.is_file() else None
        if self._zip is None:
            self._root = where.parent if where.name == "vllm" else where
            if not (self._root / "vllm" / "__init__.py").is_file():
                raise SystemExit(f"{where}: no vllm/ package here")
        self._modules: dict[str, tuple[str, ast.Module] | None] = {}

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            try:
                return self._zip.read(rel).decode()
            except KeyError:
                return None
        path = self._root / rel
        return path.read_text() if path.is_file() else None

    def module(self, name: str) -> tuple[str, ast.Module] | None:
        """(file path inside the tree, parsed module) or None."""
        if name not in self._modules:
            base = name.replace(".", "/")
            found = None
            for rel in (f"{base}.py", f"{base}/__init__.py"):
                text = self._read(rel)
                if text is not None:
                    found = (rel, ast.parse(text, rel))
                    break
            self._modules[name] = found
        return self._modules[name]


@dataclass
class Found:
    file: str
    node: ast.AST


def _top_level(body: list[ast.stmt]):
    """Statements of a module or class body, looking into if/try blocks
    (definitions guarded by a version or platform check)."""
    for stmt in body:
        if isinstance(stmt, ast.If):
            yield from _top_level(stmt.body)
            yield from _top_level(stmt.orelse)
        elif isinstance(stmt, ast.Try):
            for part in (stmt.body, stmt.orelse, stmt.finalbody,
                         *(h.body for h in stmt.handlers)):
                yield from _top_level(part)
        else:
            yield stmt


def _binds(stmt: ast.stmt, name: str) -> bool:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return stmt.name == name
    if isinstance(stmt, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == name for t in stmt.targets)
    if isinstance(stmt, ast.AnnAssign):
        return isinstance(stmt.target, ast.Name) and stmt.target.id == name
    return False


def _import_source(stmt: ast.stmt, name: str, module: str, is_pkg: bool) -> str | None:
    """The dotted ``module.attr`` a ``from x import attr as name`` binds."""
    if not isinstance(stmt, ast.ImportFrom):
        return None
    for alias in stmt.names:
        if (alias.asname or alias.name) == name:
            if stmt.level:
                parts = module.split(".")
                keep = len(parts) - stmt.level + (1 if is_pkg else 0)
                base = ".".join(parts[:keep])
                src = f"{base}.{stmt.module}" if stmt.module else base
            else:
                src = stmt.module
            return f"{src}.{alias.name}"
    return None


def find(tree: SourceTree, module: str, qualname: str, depth: int = 0) -> Found | None:
    """The definition ``module:qualname`` names, following re-exports."""
    parsed = tree.module(module)
    if parsed is None or depth > 8:
        return None
    rel, mod = parsed
    first, *rest = qualname.split(".")
    node, source = None, None
    for stmt in _top_level(mod.body):
        if _binds(stmt, first):
            node, source = stmt, None
        else:
            src = _import_source(stmt, first, module, rel.endswith("__init__.py"))
            if src is not None:
                node, source = None, src
    if source is not None:
        src_module, attr = source.rsplit(".", 1)
        if tree.module(source) is not None and not rest:
            return None  # a submodule, not a function or class
        return find(tree, src_module, ".".join([attr, *rest]), depth + 1)
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return None
        matches = [s for s in _top_level(node.body) if _binds(s, part)]
        node = matches[-1] if matches else None
    return Found(rel, node) if node is not None else None


def _without_docstrings(node: ast.AST) -> ast.AST:
    node = ast.parse(ast.unparse(node)).body[0]  # a copy
    for n in ast.walk(node):
        body = getattr(n, "body", None)
        if (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            n.body = body[1:] or [ast.Pass()]
    return node


def compare(old: Found | None, new: Found | None) -> str:
    if old is None and new is None:
        return OURS
    if new is None:
        return GONE
    if old is None:
        return ADDED
    same = (ast.dump(_without_docstrings(old.node))
            == ast.dump(_without_docstrings(new.node)))
    if not same:
        return CHANGED
    return UNCHANGED if old.file == new.file else MOVED


def code_diff(name: str, old: Found, new: Found) -> str:
    a = ast.unparse(_without_docstrings(old.node)).splitlines()
    b = ast.unparse(_without_docstrings(new.node)).splitlines()
    return "\n".join(difflib.unified_diff(a, b, f"old {old.file} {name}",
                                          f"new {new.file} {name}", lineterm=""))


def installed_vllm() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no installed vllm; pass --old")
    return Path(next(iter(spec.submodule_search_locations)))


def bridge_names() -> list[str]:
    from vllm_plugins.bridge.patches import vllm_names

    return vllm_names()


def report(old: SourceTree, new: SourceTree, names: list[str], show_diff: bool,
           out=sys.stdout) -> int:
    """Prints one line per name; returns how many changed, moved or are gone."""
    warned = 0
    width = max(len(n) for n in names)
    for name in names:
        module, _, qualname = name.partition(":")
        a, b = find(old, module, qualname), find(new, module, qualname)
        status = compare(a, b)
        where = "" if b is None else f"  ({b.file})"
        print(f"{status:>21}  {name:<{width}}{where}", file=out)
        if status in WARN:
            warned += 1
            if show_diff and status == CHANGED:
                print(code_diff(name, a, b), file=out)
    return warned


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("new", type=Path, help="vLLM wheel or source folder to check")
    p.add_argument("--old", type=Path, default=None,
                   help="the vLLM the bridge runs on now (default: installed)")
    p.add_argument("--names", default=None,
                   help="comma list of module:qualname (default: the bridge's own)")
    p.add_argument("--diff", action="store_true", help="print changed code")
    args = p.parse_args(argv)
    names = args.names.split(",") if args.names else bridge_names()
    old = SourceTree(args.old or installed_vllm())
    new = SourceTree(args.new)
    print(f"vLLM internals the bridge touches: {old.where} -> {new.where}")
    warned = report(old, new, names, args.diff)
    print(f"{warned} of {len(names)} changed, moved or gone")
    return 1 if warned else 0


if __name__ == "__main__":
    sys.exit(main())
