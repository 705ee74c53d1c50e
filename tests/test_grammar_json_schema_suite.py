"""JSON-Schema-Test-Suite (draft 2020-12) against the grammar processor's compiler.

For every schema in the suite (top-level files and ``optional/``, not
``optional/format/``) we compile it exactly as a request's
``extra_args["grammar"]["json_schema"]`` is compiled with
``"json_schema_faithful": true`` (JSON Schema's reading; the default reads
schemas as vLLM's native backend does, see
``tests/test_grammar_native_parity.py``), then run every test
instance, serialized with ``json.dumps``, through an llguidance matcher built
on the default model's tokenizer: accepted = all tokens consumed and the
matcher accepting (EOS allowed) at the end.

* schemas llguidance refuses (unimplemented keywords, remote refs, ...) are
  counted, not tested: such a request is refused at admission;
* a valid instance rejected, or an invalid instance accepted, is a *gap*.
  Known gaps are listed in ``tests/data/grammar_suite_known_gaps.json`` (their causes in
  docs/grammar_design.md); the test fails on any gap not listed there, and if fewer
  schemas compile than recorded.

Regenerate the list (after an llguidance upgrade) and print a per-file summary::

    python tests/test_grammar_json_schema_suite.py --update
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

llguidance = pytest.importorskip("llguidance")

from vllm_plugins.bench.data import shared_data  # noqa: E402
from vllm_plugins.grammar.spec import (  # noqa: E402
    GrammarSpecError,
    compile_grammar_request,
)

HERE = Path(__file__).parent
GAPS_FILE = HERE / "data" / "grammar_suite_known_gaps.json"
SUITE_ROOTS = [
    Path(os.environ["JSON_SCHEMA_TEST_SUITE"]) / "tests" / "draft2020-12"
    if "JSON_SCHEMA_TEST_SUITE" in os.environ
    else shared_data("json-schema-test-suite") / "tests" / "draft2020-12",
    HERE / "data" / "json-schema-test-suite" / "tests" / "draft2020-12",
]


def suite_root() -> Path | None:
    for root in SUITE_ROOTS:
        if root.is_dir():
            return root
    return None


@dataclass
class SuiteResult:
    groups: int = 0
    compiled: int = 0
    valid: int = 0
    invalid: int = 0
    skipped_tests: int = 0
    valid_accepted: int = 0
    # valid instances rejected as json.dumps(...) text (\uXXXX escapes) but
    # accepted as json.dumps(..., ensure_ascii=False) text (raw UTF-8)
    valid_rejected_escapes_only: int = 0
    # likewise: invalid instances accepted only in their \uXXXX-escaped form
    invalid_accepted_escapes_only: int = 0
    invalid_rejected: int = 0
    # file -> ["group :: test", ...]
    valid_rejected: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    invalid_accepted: dict[str, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    not_compiled: collections.Counter = field(default_factory=collections.Counter)  # reason
    per_file: dict[str, list[int]] = field(default_factory=dict)  # file -> [groups, compiled]
    seconds: float = 0.0


def suite_files(root: Path) -> list[Path]:
    return sorted(root.glob("*.json")) + sorted((root / "optional").glob("*.json"))


def run_suite(root: Path, ll_tokenizer) -> SuiteResult:
    res = SuiteResult()
    t0 = time.perf_counter()
    for path in suite_files(root):
        name = path.relative_to(root).as_posix()
        counts = res.per_file.setdefault(name, [0, 0])
        for group in json.loads(path.read_text()):
            res.groups += 1
            counts[0] += 1
            try:
                compiled = compile_grammar_request({"json_schema": group["schema"], "json_schema_faithful": True})
            except GrammarSpecError as e:
                reason = str(e).split(": ", 1)[-1].splitlines()[0]
                res.not_compiled[reason[:90]] += 1
                res.skipped_tests += len(group["tests"])
                continue
            res.compiled += 1
            counts[1] += 1
            template = llguidance.LLMatcher(ll_tokenizer, compiled.grammar, log_level=0)
            for test in group["tests"]:
                m = template.deep_copy()
                text = json.dumps(test["data"])
                accepted = m.consume_tokens(ll_tokenizer.tokenize_str(text)) and m.is_accepting()
                case = f'{group["description"]} :: {test["description"]}'
                if test["valid"]:
                    res.valid += 1
                    if accepted:
                        res.valid_accepted += 1
                    else:
                        res.valid_rejected[name].append(case)
                        utf8 = json.dumps(test["data"], ensure_ascii=False)
                        m = template.deep_copy()
                        if utf8 != text and m.consume_tokens(
                            ll_tokenizer.tokenize_str(utf8)
                        ) and m.is_accepting():
                            res.valid_rejected_escapes_only += 1
                else:
                    res.invalid += 1
                    if accepted:
                        res.invalid_accepted[name].append(case)
                        utf8 = json.dumps(test["data"], ensure_ascii=False)
                        m = template.deep_copy()
                        if utf8 != text and not (m.consume_tokens(
                            ll_tokenizer.tokenize_str(utf8)
                        ) and m.is_accepting()):
                            res.invalid_accepted_escapes_only += 1
                    else:
                        res.invalid_rejected += 1
    res.seconds = time.perf_counter() - t0
    return res


def summary(res: SuiteResult) -> str:
    n_vr = sum(map(len, res.valid_rejected.values()))
    n_ia = sum(map(len, res.invalid_accepted.values()))
    return (
        f"schemas: {res.groups}, compiled by llguidance: {res.compiled} "
        f"({100 * res.compiled / max(res.groups, 1):.1f}%), refused: {res.groups - res.compiled} "
        f"(their {res.skipped_tests} instances not run)\n"
        f"valid instances: {res.valid}, accepted {res.valid_accepted}, rejected {n_vr} "
        f"({res.valid_rejected_escapes_only} of them accepted when serialized with "
        f"ensure_ascii=False)\n"
        f"invalid instances: {res.invalid}, rejected {res.invalid_rejected}, accepted {n_ia} "
        f"({res.invalid_accepted_escapes_only} of them rejected when serialized with "
        f"ensure_ascii=False)\n"
        f"time: {res.seconds:.2f} s"
    )


def load_known() -> dict:
    return json.loads(GAPS_FILE.read_text())


def record(res: SuiteResult) -> dict:
    return {
        "about": "JSON-Schema-Test-Suite draft2020-12 gaps of llguidance's JSON-Schema "
        "compiler as used by GrammarLogitsProcessor; see tests/test_grammar_json_schema_suite.py",
        "llguidance": llguidance.__version__,
        "min_compiled_schemas": res.compiled,
        "valid_rejected": {k: sorted(v) for k, v in sorted(res.valid_rejected.items())},
        "invalid_accepted": {k: sorted(v) for k, v in sorted(res.invalid_accepted.items())},
    }


def new_gaps(found: dict[str, list[str]], known: dict[str, list[str]]) -> list[str]:
    return [f"{f}: {c}" for f, cases in found.items() for c in cases if c not in set(known.get(f, ()))]


def refusal_categories(reasons: collections.Counter) -> collections.Counter:
    """llguidance's refusal messages, grouped for the docs."""
    out: collections.Counter = collections.Counter()
    for reason, n in reasons.items():
        if reason.startswith("Unimplemented keys:"):
            for key in json.loads(reason.split(":", 1)[1]):
                out[f"unimplemented keyword `{key}`"] += n
        elif reason.startswith("Resource '"):
            out["remote `$ref` (the suite's remotes/ are not served)"] += n
        elif reason.startswith("Unknown format"):
            out["unknown `format` (" + reason.split(": ", 1)[1] + ")"] += n
        elif reason.startswith("Expected positive integer"):
            out["integer keyword written as a float (e.g. `maxLength: 2.0`)"] += n
        elif reason.startswith("patternProperty regexes"):
            out["overlapping `patternProperties` regexes"] += n
        elif reason.startswith("Failed to generate regex for float range"):
            out["number bound beyond what the float-range regex supports"] += n
        elif reason.startswith("Unsatisfiable schema"):
            out["unsatisfiable schema (`false`, empty `anyOf`)"] += n
        elif reason.startswith("oneOf constraints"):
            out["`oneOf` whose branches may overlap"] += n
        else:
            out[f"`{reason}`"] += n
    return out


def docs_section(res: SuiteResult) -> str:
    """A per-file markdown summary of the suite (printed by --update)."""
    lines = ["| file | schemas | compiled | valid rejected | invalid accepted |", "| --- | ---: | ---: | ---: | ---: |"]
    for name, (groups, compiled) in res.per_file.items():
        vr, ia = len(res.valid_rejected.get(name, ())), len(res.invalid_accepted.get(name, ()))
        lines.append(f"| {name} | {groups} | {compiled} | {vr or ''} | {ia or ''} |")
    lines.append(
        f"| **total** | **{res.groups}** | **{res.compiled}** | "
        f"**{sum(map(len, res.valid_rejected.values()))}** | "
        f"**{sum(map(len, res.invalid_accepted.values()))}** |"
    )
    lines += ["", "Why schemas were refused (a schema can count under several keywords):", ""]
    for reason, n in refusal_categories(res.not_compiled).most_common():
        lines.append(f"- {n}: {reason}")
    for title, gaps in (("Valid instances rejected", res.valid_rejected),
                        ("Invalid instances accepted", res.invalid_accepted)):
        lines += ["", f"{title}:", ""]
        for name, cases in sorted(gaps.items()):
            for c in sorted(cases):
                lines.append(f"- `{name}`: {c}")
    return "\n".join(lines)


@pytest.fixture(scope="module")
def ll_tokenizer():
    from transformers import AutoTokenizer

    from vllm_plugins.default_model import default_model_path
    from vllm_plugins.grammar.runtime import build_ll_tokenizer

    return build_ll_tokenizer(AutoTokenizer.from_pretrained(default_model_path()))


def test_json_schema_test_suite(ll_tokenizer):
    root = suite_root()
    if root is None:
        pytest.skip("JSON-Schema-Test-Suite not found; set JSON_SCHEMA_TEST_SUITE")
    res = run_suite(root, ll_tokenizer)
    print("\n" + summary(res))
    known = load_known()
    assert res.groups > 300 and res.valid > 300, "suite not found where expected"
    assert res.compiled >= known["min_compiled_schemas"], (
        f"llguidance now compiles {res.compiled} schemas, {known['min_compiled_schemas']} recorded"
    )
    new_valid = new_gaps(res.valid_rejected, known["valid_rejected"])
    new_invalid = new_gaps(res.invalid_accepted, known["invalid_accepted"])
    fixed = [
        f"{f}: {c}"
        for kind, found in (("valid_rejected", res.valid_rejected), ("invalid_accepted", res.invalid_accepted))
        for f, cases in known[kind].items()
        for c in cases
        if c not in set(found.get(f, ()))
    ]
    if fixed:
        print(f"{len(fixed)} recorded gap(s) no longer occur (run with --update):", *fixed, sep="\n  ")
    assert not new_valid, "valid instances newly rejected:\n" + "\n".join(new_valid)
    assert not new_invalid, "invalid instances newly accepted:\n" + "\n".join(new_invalid)
    assert res.seconds < 30


if __name__ == "__main__":
    from transformers import AutoTokenizer

    from vllm_plugins.default_model import default_model_path
    from vllm_plugins.grammar.runtime import build_ll_tokenizer

    tok = build_ll_tokenizer(AutoTokenizer.from_pretrained(default_model_path()))
    result = run_suite(suite_root(), tok)
    print(summary(result))
    if "--update" in sys.argv:
        GAPS_FILE.parent.mkdir(exist_ok=True)
        GAPS_FILE.write_text(json.dumps(record(result), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {GAPS_FILE}")
    print()
    print(docs_section(result))
