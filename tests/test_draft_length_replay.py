"""Replay: drafts and draft-length decisions equal those recorded before the
controllers became a package (tests/data/draft_length_replay.json.gz).

The fixture holds, per proposer and policy, every step's drafts, the draft
budget each request was given, the kept lengths, whether the proposer
drafted (a resting step does not) and whether the bridge was asked for the
next step's top-k, plus the controller's final statistics and the
simulator's results. Record it again only for an intended behaviour
change: ``python tests/draft_length_replay.py tests/data/draft_length_replay.json.gz``.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest

from tests import draft_length_replay as replay

FIXTURE = Path(__file__).parent / "data" / "draft_length_replay.json.gz"
# Statistics keys renamed since the recording: old name -> new name.
RENAMED: dict[str, str] = {}
# Statistics keys added since the recording (not compared).
ADDED = frozenset({"trees", "tree_step_s", "tree_token_s"})


@pytest.fixture(scope="module")
def expected() -> dict:
    with gzip.open(FIXTURE, "rt") as f:
        return json.load(f)


def _same(a, b, where: str) -> None:
    if isinstance(a, dict):
        a = {RENAMED.get(k, k): v for k, v in a.items()}
        assert isinstance(b, dict), where
        b = {k: v for k, v in b.items() if k not in ADDED or k in a}
        assert sorted(a) == sorted(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    elif isinstance(a, float) and isinstance(b, float):
        # A fitted cost's last digit follows the host's floating-point
        # summation order (BLAS kernels differ between CPU kinds); the drafts
        # and decisions above are compared exactly.
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15), \
            f"{where}: recorded {a!r}, now {b!r}"
    else:
        assert a == b, f"{where}: recorded {a!r}, now {b!r}"


def _run_names():
    return [f"{m}/{p}" for m in replay.METHODS
            for p in (*replay.POLICIES, *replay.VARIANTS)]


@pytest.mark.parametrize("name", _run_names())
def test_replay_gives_recorded_drafts_and_decisions(expected, name):
    method, policy = name.split("/")
    got = json.loads(json.dumps(replay.run(replay.make_proposer(method, policy))))
    want = expected["runs"][name]
    assert len(got["steps"]) == len(want["steps"])
    for i, (w, g) in enumerate(zip(want["steps"], got["steps"])):
        # The first differing step, whole, is the useful failure message.
        assert w == g, f"{name}: step {i} differs"
    _same(want["stats"], got["stats"], f"{name} stats")


def test_replay_exercises_every_decision_kind(expected):
    """The recording is worth replaying: requests join and finish, drafts
    are kept, cut and refused, goodput rests and wakes."""
    runs = expected["runs"]
    steps = runs["token_recycling/goodput"]["steps"]
    assert {len(s["batch"]) for s in steps} >= {1, 8, 16}
    assert any(not s["drafted"] for s in steps) and any(s["drafted"] for s in steps)
    assert any(s["topk_next"] == 0 for s in steps)
    keeps = [k for s in steps if s["keep"] for k in s["keep"]]
    assert 0 in keeps and max(keeps) >= 3
    for name in ("acceptance", "confidence"):
        budgets = [b for s in runs[f"token_recycling/{name}"]["steps"] for b in s["budgets"]]
        assert min(budgets) < max(budgets)
    assert runs["ngram_adaptive/goodput"]["stats"]["rest_steps"] > 0


def test_simulator_gives_recorded_results(expected):
    _same(expected["simulator"], json.loads(json.dumps(replay.simulator_runs())),
          "simulator")
