"""Spec-Bench dev prompts, rendered with the model's chat template."""

from __future__ import annotations

import json
import os
from pathlib import Path


def shared_data(name: str) -> Path:
    """A file or folder of the shared data: $VLLM_PLUGINS_DATA, else the
    nearest shared/data beside the repo."""
    env = os.environ.get("VLLM_PLUGINS_DATA")
    roots = [Path(env)] if env else []
    here = Path(__file__).resolve()
    roots += [p / "shared" / "data" for p in here.parents]
    for root in roots:
        f = root / name
        if f.exists():
            return f
    raise FileNotFoundError(f"{name} not found; set VLLM_PLUGINS_DATA to its folder")


def spec_bench_path() -> Path:
    return shared_data("spec_bench_dev.jsonl")


def load_questions(categories: list[str] | None = None,
                   per_category: int | None = None) -> list[dict]:
    rows = [json.loads(line) for line in spec_bench_path().open()]
    out, counts = [], {}
    for r in rows:
        cat = r["category"]
        if categories and cat not in categories:
            continue
        if per_category is not None and counts.get(cat, 0) >= per_category:
            continue
        counts[cat] = counts.get(cat, 0) + 1
        out.append(r)
    return out


def render(tokenizer, question: dict) -> list[int]:
    """First turn as a chat prompt, as token ids; where the question holds
    its ``first_answer`` (``second_turns``), the second turn after the
    first and its answer."""
    msgs = [{"role": "user", "content": question["turns"][0]}]
    if "first_answer" in question:
        msgs += [{"role": "assistant", "content": question["first_answer"]},
                 {"role": "user", "content": question["turns"][1]}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def disjoint_sets(categories: list[str] | None, counts: list[int | None]
                  ) -> tuple[list[list[dict]], list[dict]]:
    """One question set per entry of ``counts`` (prompts per category; None:
    all that are left), disjoint, in file order, plus the questions left over.

    Proposers that learn across requests (Token Recycling's tables) would
    otherwise meet, at a later batch size, prompts whose greedy output they
    have already seen: their MAT would measure memory, not drafting.
    """
    pool = load_questions(categories)
    by_cat: dict[str, list[dict]] = {}
    for q in pool:
        by_cat.setdefault(q["category"], []).append(q)
    taken = {c: 0 for c in by_cat}
    sets = []
    for n in counts:
        out = []
        for cat, qs in by_cat.items():
            lo = taken[cat]
            hi = len(qs) if n is None else min(len(qs), lo + n)
            out.extend(qs[lo:hi])
            taken[cat] = hi
        sets.append(out)
    left = [q for c, qs in by_cat.items() for q in qs[taken[c]:]]
    return sets, left


def second_turns(questions: list[dict], answer) -> list[dict]:
    """The two-turn questions among ``questions``, each with its
    ``first_answer``: ``answer(questions)`` gives the texts in order (the
    target's own greedy answers, so the second turn reads the conversation
    it would have had)."""
    two = [q for q in questions if len(q["turns"]) >= 2]
    return [{**q, "first_answer": a} for q, a in zip(two, answer(two))]
