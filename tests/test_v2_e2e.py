"""Our methods on Model Runner V2, vLLM's default runner, end to end.

The engines run in a process of their own with V2 switched on for this CPU
(tests/v2_engines.py, ``vllm_plugins.v2_on_cpu``): V2's Triton kernels run
in Triton's interpreter, so outputs are short and the model is the tiny one
where exactness alone is checked. The reference is plain decoding on V2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.v2_engines import (CHOSEN_K_SPECS, SAMPLED_N, STEP_K_SPECS, V1_METHODS,
                              V2_METHODS)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def run_scenario(name: str, tmp_path) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-m", "tests.v2_engines", name, str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("V2_ENGINES_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1].split(" ", 1)[1])


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    return run_scenario("greedy", tmp_path_factory.mktemp("v2"))


def test_plain_decoding_runs_on_v2(greedy):
    assert greedy["plain"]["runner"] == "v2"


@pytest.mark.parametrize("method", sorted(V2_METHODS))
def test_greedy_output_on_v2_is_plain_decodings(greedy, method):
    got = greedy[method]
    assert got["runner"] == "v2", got["runner"]
    assert got["tokens"] == greedy["plain"]["tokens"]
    stats = got["stats"]
    assert stats["proposer"]["num_errors"] == 0
    assert stats["malformed_drafts"] == 0


def test_the_grammar_processor_constrains_output_on_v2(greedy):
    """The last request of each engine asks our grammar processor for a
    JSON object; on a random model the output is the grammar's doing."""
    text = greedy["plain"]["grammar_text"]
    assert text.lstrip().startswith("{"), text
    assert greedy["token_recycling"]["grammar_text"] == text


def test_drafts_are_verified_and_accepted_on_v2(greedy):
    stats = greedy["token_recycling"]["stats"]
    # Forwards: one per step; drafts accepted make it fewer than tokens.
    assert stats["accepted"] > 0 and stats["steps"] < stats["tokens"]
    # The device route counts nothing on the host: vLLM's own count shows it.
    for method in V2_METHODS:
        assert greedy[method]["vllm_accepted"] > 0, method


@pytest.mark.parametrize("method", sorted(V1_METHODS))
def test_what_v2_cannot_serve_falls_back_to_v1(greedy, method):
    assert greedy[method]["runner"] == "v1"
    assert greedy[method]["tokens"] == greedy["plain"]["tokens"]


@pytest.fixture(scope="module")
def step_k(tmp_path_factory):
    return run_scenario("step_k", tmp_path_factory.mktemp("v2"))


@pytest.mark.parametrize("method", sorted(STEP_K_SPECS))
def test_the_steps_k_by_batch_size_keeps_plain_decodings_output_on_v2(step_k, method):
    """vLLM's ``num_speculative_tokens_per_batch_size`` through our method's
    speculative config: V2 verifies 1 draft a request while the batch is
    larger than one and 2 once it is one, and the output is plain V2's."""
    got = step_k[method]
    assert step_k["plain"]["runner"] == "v2" and got["runner"] == "v2"
    assert got["tokens"] == step_k["plain"]["tokens"]
    # Both ks were verified (a draft a request at most 2, not always 2).
    assert got["drafts"] < got["draft_tokens"] < 2 * got["drafts"]
    assert got["stats"]["proposer"]["num_errors"] == 0
    assert got["stats"]["malformed_drafts"] == 0


@pytest.mark.parametrize("method", sorted(CHOSEN_K_SPECS))
def test_the_steps_k_chosen_by_our_controller_keeps_plain_decodings_output_on_v2(
        step_k, method):
    """``goodput`` chooses V2's batch-wide k (``bridge/v2/step_k.py``; on
    the device route, the engine core): the scheduler verified more than
    one k, as chosen, and the output is plain V2's."""
    got = step_k[method]
    assert got["runner"] == "v2"
    assert got["tokens"] == step_k["plain"]["tokens"]
    k = CHOSEN_K_SPECS[method]["num_speculative_tokens"]
    if CHOSEN_K_SPECS[method].get("tables") != "device":
        chosen = got["stats"]["proposer"]["draft_length"]["step_k_histogram"]
        assert sum(1 for n in chosen if n) > 1, chosen
    # vLLM verified fewer than k drafts a request on some steps.
    assert 0 < got["drafts"] and got["draft_tokens"] < k * got["drafts"]
    assert got["stats"]["proposer"]["num_errors"] == 0


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    return run_scenario("preempted", tmp_path_factory.mktemp("v2"))


@pytest.mark.parametrize("method", ["token_recycling", "token_recycling_device"])
def test_preemption_and_an_abort_on_v2_keep_plain_decodings_output(preempted, method):
    from tests.v2_engines import PREEMPT_SPECS

    assert method in PREEMPT_SPECS
    plain, got = preempted["plain"], preempted[method]
    assert plain["preemptions"] > 0 and got["preemptions"] > 0, "no preemption: no teeth"
    assert got["runner"] == "v2"
    assert got["tokens"] == plain["tokens"]
    assert got["stats"]["steps"] > 0


def goodness_of_fit_pvalue(counts, probs, min_expected=5.0) -> float:
    """Chi-square of observed counts against exact probabilities; cells
    expected fewer than ``min_expected`` times are pooled."""
    import numpy as np
    import torch

    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    return run_scenario("draft_logits", tmp_path_factory.mktemp("v2"))


def test_draft_probabilities_reach_v2s_rejection_sampler_exactly(verified):
    """Drafts drawn from p, their rows handed over as the V2 drafter hands
    STAND's (``draft_logits_block``), verified by V2's own kernels: the
    output follows the target."""
    honest = verified["honest"]
    assert honest["accepted"] > 0.2 * sum(honest["counts"])  # drafts were verified
    p = goodness_of_fit_pvalue(honest["counts"], verified["target"])
    assert p > 1e-3, p


def test_the_same_check_catches_rows_that_misstate_the_draft(verified):
    p = goodness_of_fit_pvalue(verified["dishonest"]["counts"], verified["target"])
    assert p < 1e-6, p


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    return run_scenario("sampled", tmp_path_factory.mktemp("v2"))


def sampled_pvalue(sampled, arm) -> float:
    """Two-sample homogeneity of an arm's samples (whole outputs, as
    tuples) with plain V2's."""
    from tests.test_stand_e2e import homogeneity_pvalue

    def tuples(name):
        return [tuple(s) for s in sampled[name]["samples"]]

    return homogeneity_pvalue(tuples("plain"), tuples(arm))


@pytest.mark.parametrize("method", ["stand", "token_recycling"])
def test_sampled_output_on_v2_keeps_the_target_distribution(sampled, method):
    """Seeded samples at temperature 1 of the first tokens, drafted and
    verified by V2's rejection sampler (STAND's with its probability rows,
    token recycling's as one-hot drafts): one distribution with plain V2's."""
    got = sampled[method]
    assert sampled["plain"]["runner"] == "v2" and got["runner"] == "v2"
    assert len(got["samples"]) == len(sampled["plain"]["samples"]) == SAMPLED_N
    p = sampled_pvalue(sampled, method)
    print(f"{method}: p = {p:.3g}, drafts {got['drafts']}, "
          f"draft tokens {got['draft_tokens']}, accepted {got['accepted']}")
    assert p > 1e-3, (p, got["accepted"])
    assert got["stats"]["proposer"]["num_errors"] == 0
    assert got["stats"]["malformed_drafts"] == 0


@pytest.mark.parametrize("method", ["stand", "token_recycling", "stand_dishonest"])
def test_sampled_drafts_were_verified_and_accepted_on_v2(sampled, method):
    """vLLM's own counts while the samples were drawn: without accepted
    drafts the output is the target's own sampling and the homogeneity
    check proves nothing."""
    got = sampled[method]
    assert got["runner"] == "v2"
    assert got["drafts"] > 0 and got["accepted"] >= SAMPLED_N // 4, got["accepted"]


def test_stand_hands_v2_rows_for_its_sampled_drafts(sampled):
    """STAND's sampled drafts carried probability rows (none went out
    one-hot), so V2's sampler verified them against what they were drawn
    from."""
    drafted = sampled["stand"]["stats"]["proposer"]["stand"]["drafted"]
    assert drafted["sampled"] > 0 and drafted["sampled_one_hot"] == 0, drafted


def test_the_same_check_catches_stand_misstating_its_draws_on_v2(sampled):
    """The control: STAND drafts each distribution's mode under a row that
    claims a draw from it (proposers/stand_debug.py); V2's sampler, reading
    the row, over-accepts the mode and the same check on the same number
    of samples rejects."""
    p = sampled_pvalue(sampled, "stand_dishonest")
    print(f"stand_dishonest: p = {p:.3g}, accepted {sampled['stand_dishonest']['accepted']}")
    assert p < 1e-6, p
