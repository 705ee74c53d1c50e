"""The one benchmark command: it lists every subcommand, and every benchmark
command the docs print parses with that subcommand's own options. No engine
starts: only the argument parsers run."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_plugins.bench.__main__ import RUNNERS, SUBCOMMANDS, load, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENTRY = "-m vllm_plugins.bench"
# What ends a command on a shell line.
SHELL_END = {"|", ";", "&&", "||", ">", ">>", "2>&1", "&"}


def joined(text: str) -> str:
    """``text`` with shell continuations joined, and inline code spans that
    wrap a line joined, outside fenced blocks."""
    parts = re.split(r"(?ms)(^```.*?^```)", text)
    for i in range(0, len(parts), 2):                 # prose between fences
        parts[i] = re.sub(r"`[^`]+`", lambda m: m.group(0).replace("\n", " "), parts[i])
    return re.sub(r"\\\n\s*", " ", "".join(parts))


def doc_commands(text: str) -> list[list[str]]:
    """The argument lists after ``python -m vllm_plugins.bench`` in ``text``
    (fenced blocks and inline code); ``<what>`` and the like name no command."""
    text = joined(text)
    commands = []
    for line in text.splitlines():
        for chunk in re.findall(r"`([^`]*)`", line) or [line]:
            at = chunk.find(ENTRY)
            if at < 0 or chunk[at + len(ENTRY):at + len(ENTRY) + 1] not in ("", " "):
                continue
            words = shlex.split(chunk[at + len(ENTRY):], comments=True)
            cut = next((i for i, w in enumerate(words) if w in SHELL_END), len(words))
            if not (words and words[0].startswith("<")):
                commands.append(words[:cut])
    return commands


def all_doc_commands() -> list[tuple[str, list[str]]]:
    return [(p.name, c) for p in DOCS for c in doc_commands(p.read_text())]


def test_the_command_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    listed = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert re.search(rf"^  {re.escape(name)} ", listed, re.M), name
    assert main([]) == 2                       # no subcommand: the list, and an error


def test_an_unknown_subcommand_names_the_known_ones():
    with pytest.raises(SystemExit, match="unknown subcommand 'mat'.*methods"):
        main(["mat"])


def test_listing_imports_neither_vllm_nor_torch():
    code = ("import sys; from vllm_plugins.bench.__main__ import main; main(['--help']); "
            "heavy = sorted(m for m in ('vllm', 'torch') if m in sys.modules); "
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


@pytest.mark.parametrize("name", list(SUBCOMMANDS))
def test_every_subcommand_has_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        load(name).parse_args(["--help"])
    assert e.value.code == 0
    assert f"python -m vllm_plugins.bench {name}" in capsys.readouterr().out


def test_every_bench_module_with_a_main_is_a_subcommand():
    """One command: a bench module that runs on its own is reached as a
    subcommand, and no module but __main__ is an entry point."""
    import ast

    bench = ROOT / "vllm_plugins" / "bench"
    served = {load(name).__name__.rsplit(".", 1)[1] for name in SUBCOMMANDS}
    for f in sorted(bench.glob("*.py")):
        if f.stem == "__main__":
            continue
        tree = ast.parse(f.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        assert not has_main or f.stem in served, (
            f"vllm_plugins/bench/{f.name} has a main(): add it to SUBCOMMANDS in "
            "vllm_plugins/bench/__main__.py (python -m vllm_plugins.bench <what>)")
        assert "__name__ == \"__main__\"" not in f.read_text(), (
            f"vllm_plugins/bench/{f.name} is an entry point of its own; run it as a subcommand")


def test_docs_print_no_other_benchmark_entry_point():
    """The modules behind the subcommands are not entry points of their own."""
    old = [(p.name, m) for p in DOCS
           for m in re.findall(r"-m\s+vllm_plugins\.bench\.(\w+)", joined(p.read_text()))]
    assert not old, (f"commands through a bench module, not `python -m vllm_plugins.bench "
                     f"<what>` (SUBCOMMANDS in vllm_plugins/bench/__main__.py): {old}")


def test_every_subcommand_backs_a_section_of_benchmarks_md():
    used = {c[0] for name, c in all_doc_commands() if name == "benchmarks.md" and c}
    assert set(SUBCOMMANDS) <= used, (
        "subcommands no docs/benchmarks.md section runs (each backs a measured claim "
        f"there; one that backs none leaves): {sorted(set(SUBCOMMANDS) - used)}")


def test_every_doc_command_parses():
    commands = all_doc_commands()
    assert len(commands) >= len(SUBCOMMANDS)
    for doc, words in commands:
        if words[:1] == ["--runner"]:  # the global option, before the subcommand
            assert words[1] in RUNNERS, (doc, words)
            words = words[2:]
        assert words and words[0] in SUBCOMMANDS, (doc, words)
        try:
            load(words[0]).parse_args(words[1:])
        except SystemExit as e:              # argparse's error exit
            raise AssertionError(f"{doc}: {shlex.join(words)} does not parse") from e


def test_a_wrong_doc_command_fails_to_parse():
    """The check above can fail: a misspelt option is an argparse error."""
    [words] = doc_commands("see `python -m vllm_plugins.bench methods\n--batch-sise 8`.")
    with pytest.raises(SystemExit):
        load(words[0]).parse_args(words[1:])


TRITON_LINE = "Triton is installed, but doesn't include CPU backend. Disabling Triton."


def test_the_demo_drops_vllms_triton_line_and_passes_the_rest_as_it_comes():
    """scripts/demo.sh runs the benchmark's standard error through
    scripts/drop_line.py: vLLM's Triton line (its text as vLLM writes it) goes,
    every other byte comes through, a progress bar's carriage-return updates
    as they are written, even when a chunk ends inside a line."""
    import importlib.util

    import vllm.triton_utils.importing as importing

    spec = importlib.util.spec_from_file_location("drop_line", ROOT / "scripts/drop_line.py")
    drop_line = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drop_line)
    LineDropper = drop_line.LineDropper

    source = Path(importing.__file__).read_text()
    assert "\"Triton is installed, but doesn't include CPU backend. \"" in source
    assert f'TRITON_LINE="{TRITON_LINE}"' in (ROOT / "scripts/demo.sh").read_text()
    assert "scripts/drop_line.py \"$TRITON_LINE\"" in (
        ROOT / "scripts/demo.sh").read_text()

    line = (TRITON_LINE + "\n").encode()
    stream = (b"setup: ok\n" + line + b"bench:  10%|#   | 1/10\r" + line
              + b"bench:  20%|##  | 2/10\r" + b"Triton is installed, but not this\n"
              + line + b"| table |\n" + b"Triton is")
    want = stream.replace(line, b"")
    for size in (1, 7, 64, len(stream)):
        out = []
        dropper = LineDropper(TRITON_LINE.encode(), out.append)
        for at in range(0, len(stream), size):
            dropper.feed(stream[at:at + size])
        dropper.close()
        assert b"".join(out) == want, size
    # A bar's update is out as soon as it is written, not held for a newline.
    out = []
    dropper = LineDropper(TRITON_LINE.encode(), out.append)
    dropper.feed(b"setup: ok\n" + line + b"bench:  10%|#   | 1/10\r")
    assert b"".join(out) == b"setup: ok\nbench:  10%|#   | 1/10\r"
    run = subprocess.run([sys.executable, str(ROOT / "scripts/drop_line.py"), TRITON_LINE],
                         input=stream, capture_output=True, timeout=60)
    assert run.returncode == 0 and run.stdout == want, run.stderr


def test_second_turns_put_the_first_answer_in_the_conversation():
    """``--turn 2``: only two-turn questions, each rendered as its first
    turn, the answer given, then its second turn."""
    from vllm_plugins.bench.data import render, second_turns

    class Chat:
        def apply_chat_template(self, msgs, tokenize, add_generation_prompt):
            return "|".join(f"{m['role']}:{m['content']}" for m in msgs)

        def __call__(self, text, add_special_tokens):
            return {"input_ids": text}

    questions = [{"turns": ["a?"]}, {"turns": ["b?", "c?"]}, {"turns": ["d?", "e?"]}]
    asked = []
    out = second_turns(questions, lambda qs: asked.extend(qs) or ["B", "D"])
    assert asked == questions[1:]
    assert [render(Chat(), q) for q in out] == ["user:b?|assistant:B|user:c?",
                                               "user:d?|assistant:D|user:e?"]
    assert render(Chat(), questions[1]) == "user:b?"


def test_tree_profile_times_attention_with_the_tree_route_still_applied():
    """``tree-profile`` wraps vLLM's CPU attention before the bridge's
    patches: the tree route stays an applied per-instance patch (a tree
    step holds it on the layers), and its replacement is the timed one."""
    import subprocess
    import sys

    code = (
        "from collections import defaultdict\n"
        "from vllm_plugins.bench.tree_profile import ATTENTION_ROUTE, time_attention\n"
        "from vllm_plugins.bridge.patches import named\n"
        "spent = defaultdict(float)\n"
        "time_attention(spent)\n"
        "patch = named(ATTENTION_ROUTE)\n"
        "assert patch.is_applied(), 'the tree route is no longer applied'\n"
        "assert patch.replacement().__qualname__.startswith('timer'), "
        "patch.replacement().__qualname__\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
