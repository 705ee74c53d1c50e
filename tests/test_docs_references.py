"""Every code reference in README.md and docs/ resolves: a cited path exists,
a cited ``path:function``, ``module:name`` or ``module.function`` names a
definition in that file, a cited test name is a test, and a link to another
doc (and its ``#section``) lands on a file and a heading. Reads files and
parses Python with ``ast``; imports nothing of the package, starts no engine.
"""

from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The import package's folders (pyproject.toml's package-dir).
PACKAGE_DIRS = {"vllm_plugins": ROOT / "vllm_plugins",
                "vllm_plugins.proposers": ROOT / "proposers",
                "vllm_plugins.logits_processors": ROOT / "logits_processors",
                "vllm_plugins.kernels": ROOT / "kernels"}
# vllm_plugins' subpackages, which docs cite without the package's name
# (``bridge.f``); a patch's name (``grammar.hold_new_requests``) reads alike.
SUBPACKAGES = ("bridge", "bench", "grammar", "tree", "kernels", "proposers",
               "logits_processors", "cpu", "config", "runner", "verify", "worker")
# Repository paths cited in prose and in code spans.
PATH_RE = re.compile(r"(?<![\w./~-])((?:vllm_plugins|proposers|logits_processors|kernels|tests"
                     r"|scripts|docs|\.ci)/[\w./*-]*\w)")


def code_spans(text: str) -> list[str]:
    """Inline code spans outside fenced blocks."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", text)]   # a span may wrap


def references(text: str) -> list[tuple[str, str]]:
    """(kind, reference) pairs cited in a doc's text."""
    refs = [("path", p) for p in PATH_RE.findall(re.sub(r"https?://\S+", "", text))]
    for span in code_spans(text):
        span = re.sub(r"\(.*$", "", span)                       # f(args) -> f
        if m := re.fullmatch(r"([\w/.-]+\.py):([\w.]+)", span):
            refs.append(("path:name", span))
        elif re.fullmatch(r"vllm_plugins(\.\w+)+:[\w.]+", span):
            refs.append(("module:name", span))
        elif re.fullmatch(r"vllm_plugins(\.\w+)+", span):
            refs.append(("module.name", span))
        elif m := re.fullmatch(r"(tests/[\w/]+\.py)::(\w+)", span):
            refs.append(("test", m.group(2)))
        elif re.fullmatch(r"test_\w+", span):
            refs.append(("test", span))
        elif re.fullmatch(r"[\w/]+/[\w]+\.py", span) and not PATH_RE.fullmatch(span):
            refs.append(("path", span))                         # e.g. bridge/v1/runner.py
        elif (re.fullmatch(rf"(?:{'|'.join(SUBPACKAGES)})(\.\w+)+", span)
              and not re.search(r"\.(md|png|json|jsonl|txt)$", span)):
            refs.append(("short", span))                        # bridge.f or a patch name
    return refs


def links(text: str) -> list[str]:
    """Targets of markdown links and images that are not web addresses."""
    text = re.sub(r"(?ms)^```.*?^```", "", text)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text)
            if not re.match(r"[a-z]+:", t)]


def resolve_path(path: str) -> Path | None:
    """A cited path from the repository root, else (a short form such as
    bridge/v1/runner.py) from vllm_plugins/."""
    for base in (ROOT, ROOT / "vllm_plugins"):
        if "*" in path:                                          # tests/test_x_*.py
            found = sorted(base.glob(path))
            if found:
                return found[0]
        elif (base / path.rstrip("/")).exists():
            return base / path.rstrip("/")
    return None


def module_file(dotted: str) -> tuple[Path | None, list[str]]:
    """The file of the longest module prefix of ``dotted`` and the names after it."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        for pkg, folder in PACKAGE_DIRS.items():
            if prefix == pkg:
                return folder / "__init__.py", parts[n:]
            if prefix.startswith(pkg + "."):
                rel = prefix[len(pkg) + 1:].replace(".", "/")
                for f in (folder / rel / "__init__.py", folder / f"{rel}.py"):
                    if f.exists() and not (pkg == "vllm_plugins" and
                                           rel.split("/")[0] in ("proposers", "logits_processors",
                                                                 "kernels")):
                        return f, parts[n:]
    return None, parts


@lru_cache(maxsize=None)
def definitions(path: Path) -> dict[str, set[str]]:
    """Names a module defines at top level, each with the names its class
    body defines (empty for functions and variables)."""
    tree = ast.parse(path.read_text())
    out: dict[str, set[str]] = {}

    def body_names(body) -> set[str]:
        names = set()
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        return names

    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = body_names(node.body)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        out[n.id] = set()
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = set()
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = set()
    return out


def names_defined(path: Path, names: list[str]) -> bool:
    if not names:
        return True
    defs = definitions(path)
    if names[0] not in defs:
        return False
    return len(names) == 1 or names[1] in defs[names[0]]


@lru_cache(maxsize=None)
def patch_names() -> set[str]:
    """Every string literal of the package's Python: patch names among them."""
    found = set()
    for f in (ROOT / "vllm_plugins").rglob("*.py"):
        found |= set(re.findall(r"[\"']([\w.]+)[\"']", f.read_text()))
    return found


@lru_cache(maxsize=None)
def defined_tests() -> set[str]:
    found = set()
    for f in (ROOT / "tests").rglob("*.py"):
        found |= set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", f.read_text(), re.M))
    return found


def heading_anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings."""
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    anchors = set()
    for title in re.findall(r"^#+\s+(.*?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower())
        anchors.add(slug.replace(" ", "-"))
    return anchors


def problem(kind: str, ref: str) -> str | None:
    """Why a reference does not resolve, or None."""
    if kind == "path":
        return None if resolve_path(ref) else "no such file or folder"
    if kind == "path:name":
        path, name = ref.split(":")
        f = resolve_path(path)
        if f is None:
            return "no such file"
        return None if names_defined(f, name.split(".")) else f"{path} defines no {name}"
    if kind in ("module:name", "module.name"):
        f, names = module_file(ref.replace(":", "."))
        if f is None:
            return "no such module"
        return None if names_defined(f, names) else f"{f.relative_to(ROOT)} defines no {'.'.join(names)}"
    if kind == "test":
        return None if ref in defined_tests() else "no test of that name under tests/"
    if kind == "short":
        if ref in patch_names():
            return None
        f, names = module_file("vllm_plugins." + ref)
        if f is not None and names_defined(f, names):
            return None
        return "neither a patch name nor a definition under vllm_plugins/"
    raise AssertionError(kind)


def link_problem(doc: Path, target: str) -> str | None:
    file, _, anchor = target.partition("#")
    path = (doc.parent / file).resolve() if file else doc
    if not path.exists():
        return "no such file"
    if anchor and path.suffix == ".md" and anchor not in heading_anchors(path):
        return f"no heading #{anchor} in {path.name}"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_code_reference_resolves(doc):
    text = doc.read_text()
    bad = [f"{kind} {ref}: {why}" for kind, ref in dict.fromkeys(references(text))
           if (why := problem(kind, ref))]
    bad += [f"link {t}: {why}" for t in dict.fromkeys(links(text))
            if (why := link_problem(doc, t))]
    assert not bad, f"{doc.name}: references that do not resolve:\n" + "\n".join(bad)


def test_the_check_fails_on_a_stale_reference():
    """Each kind of reference the check reads fails when it points nowhere."""
    for stale in ("`vllm_plugins/bridge/no_such_module.py`", "tests/test_no_such_file.py",
                  "tests/test_no_such_*.py", "`bridge/no_such.py`",
                  "`vllm_plugins/bridge/cpu_fixes.py:no_such_function`",
                  "`vllm_plugins.bench.report.no_such_function`",
                  "`vllm_plugins.bench.report.Tally.no_such_method`",
                  "`vllm_plugins.logits_processors.grammar:NoSuchClass`",
                  "`tests/test_bench_report.py::test_no_such_test`",
                  "`test_no_such_test_anywhere`", "`bridge._no_such_function`",
                  "`grammar.no_such_patch`"):
        refs = references(f"see {stale}.")
        assert refs and any(problem(*r) for r in refs), (stale, refs)
    good = ("`vllm_plugins/bench/report.py:ratio_ci`, `vllm_plugins.bench.report.Tally.add`, "
            "`vllm_plugins.logits_processors.grammar:GrammarLogitsProcessor`, "
            "`test_the_check_fails_on_a_stale_reference`, tests/test_docs_*.py, "
            "`bench/report.py`, `bridge.cpu_fixes.replace_expand_batch_to_tokens`, "
            "`cpu.expand_batch_to_tokens`")
    refs = references(good)
    assert {k for k, _ in refs} == {"path", "path:name", "module.name", "module:name", "test",
                                    "short"}
    assert not [r for r in refs if problem(*r)], refs
    doc = ROOT / "docs" / "benchmarks.md"
    assert link_problem(doc, "no_such.md") and link_problem(doc, "#no-such-section")
    assert link_problem(doc, "img/no_such.png")


def test_the_readme_starts_with_what_to_type():
    """The two set-up commands and the serve command come within the README's
    first 40 lines; the test runner's internals live in docs/testing.md."""
    head = (ROOT / "README.md").read_text().splitlines()[:40]
    for command in ("bash scripts/demo.sh", "bash scripts/test.sh", "vllm serve "):
        assert any(line.startswith(command) for line in head), command
    assert not any("MODULE_GROUPS" in line or "xdist" in line for line in head)
