"""Sampled output through the hybrid's merged trees is the target's (fast; no
engine).

A target that is a Markov chain over a small vocabulary (each token's
distribution depends on the one before) writes batches of requests; the
hybrid, with every built-in source, learns from the target's top-k at the
rows each step verified, as the bridge hands them, and drafts merged trees
(or chains) that the tree acceptance verifies, dispatched as the bridge
dispatches (``sample_accept_with_probs``, deterministic where the drafts
carry no probability rows). Every emitted token, accepted draft or not,
must then be a draw from the target's row after the token before it: a
chi-square test over the transition counts says so, and rejects a biased
acceptance (drafted tokens accepted with their target probability, no
residual) run over the same trees.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.test_stand import pearson
from vllm_plugins.proposers import sources
from vllm_plugins.proposers.hybrid import HybridProposer
from vllm_plugins.step_context import RequestStep, StepContext
from vllm_plugins.tree import children, path_to, sample_accept_with_probs

V = 16
MAX_DRAFT = 8
BATCH = 8
PROMPT = 12
OUTPUT = 48
REQUESTS = 96      # about 4600 emitted tokens
SOURCES = ["token_recycling", "ngram", "stand"] + (
    ["suffix"] if sources.suffix_available() else [])


def target(seed=11):
    """P[a]: the target's distribution after token a, peaked enough that
    drafts are often right and trees branch where they are not."""
    rng = np.random.default_rng(seed)
    return rng.dirichlet(np.full(V, 0.25), size=V)


def transition_pvalue(counts, P):
    """Goodness of fit of a Markov chain's transition counts: the rows'
    Pearson statistics summed (given the row totals they are independent
    multinomials under the null)."""
    stat, df = 0.0, 0
    for a in range(V):
        if counts[a].sum():
            s, d = pearson(counts[a], P[a])
            stat, df = stat + s, df + d
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def topk_rows(P, tokens, k):
    """The target's top-k (ids by descending probability, log-probabilities)
    after each token, as the bridge extracts them at verified rows."""
    rows = P[np.asarray(tokens, np.int64)]
    ids = np.argsort(-rows, axis=1, kind="stable")[:, :k]
    with np.errstate(divide="ignore"):
        lps = np.log(np.take_along_axis(rows, ids, 1)).astype(np.float32)
    return ids.astype(np.int64), lps


def biased_accept(parents, tokens, rows, gen):
    """The control: each child of the current node accepted with its
    target probability, in node order; with none accepted, a draw from
    the target row itself instead of the residual. Drafted tokens come
    out too often."""
    kids = children(parents)
    out, row = [], 0
    while True:
        p = rows[row]
        coins = torch.rand(len(kids[row]), generator=gen, dtype=torch.float64).tolist()
        child = next((c for c, u in zip(kids[row], coins) if u < float(p[tokens[c]])), None)
        if child is None:
            out.append(int(torch.multinomial(p, 1, generator=gen)))
            return out
        out.append(tokens[child])
        row = child + 1


def exact_accept(parents, tokens, rows, probs, gen):
    """The rule the bridge runs for a tree request."""
    return sample_accept_with_probs([parents], [tokens], rows, [probs], gen)[0].tokens


class Run:
    """Requests of PROMPT + OUTPUT tokens, BATCH at a time, a finished one
    replaced by the next; the proposer sees each step as the bridge shows it."""

    def __init__(self, P, accept, draft_shape, proposer=None):
        self.P, self.accept = P, accept
        self.p = proposer or HybridProposer(None, {"draft_length": "fixed", "sources": SOURCES,
                                                   "draft_shape": draft_shape},
                                            vocab_size=V)
        self.p.load_model(None)
        self.rng = np.random.default_rng(0)
        self.gen = torch.Generator().manual_seed(0)
        self.counts = np.zeros((V, V))
        self.emitted = self.drafted = self.accepted = self.branched = 0
        self.started = 0

    def new_request(self):
        tok = [int(self.rng.integers(V))]
        for _ in range(PROMPT - 1):
            tok.append(int(self.rng.choice(V, p=self.P[tok[-1]])))
        self.started += 1
        return {"id": f"r{self.started}", "context": tok, "accepted": [],
                "verified": [], "params": SimpleNamespace(temperature=1.0, extra_args=None)}

    def step_context(self, live, finished):
        k = self.p.topk_wanted()
        steps = []
        for r in live:
            ctx = np.asarray(r["context"], np.int64)
            ids = lps = None
            if r["accepted"]:
                ids, lps = topk_rows(self.P, r["verified"], k)
            steps.append(RequestStep(
                r["id"], np.asarray(r["accepted"], np.int64), ctx, PROMPT,
                max(len(r["verified"]) - 1, 0), np.asarray(r["verified"], np.int64),
                ids, lps, 1.0, sampling_params=r["params"]))
        return StepContext(steps, finished=finished, max_draft=MAX_DRAFT)

    def run(self, requests=REQUESTS):
        live = [self.new_request() for _ in range(BATCH)]
        for r in live:   # prefill: the first token, drawn from the target
            r["accepted"] = [int(self.rng.choice(V, p=self.P[r["context"][-1]]))]
            r["verified"] = [r["context"][-1]]
            r["context"].append(r["accepted"][0])
        finished = set()
        while live:
            d = self.p.step(self.step_context(live, finished))
            finished = set()
            for i, r in enumerate(live):
                tok = [int(t) for t in d.tokens[i]]
                par = (d.parents[i] if d.parents and d.parents[i] is not None
                       else list(range(-1, len(tok) - 1)))
                probs = d.probs[i] if d.probs else None
                last = r["context"][-1]
                paths = [[]] + [path_to(par, j) for j in range(len(tok))]
                rows = torch.tensor(self.P[[tok[p[-1]] if p else last for p in paths]],
                                    dtype=torch.float32)
                out = (self.accept(par, tok, rows, self.gen) if self.accept
                       else exact_accept(par, tok, rows, probs, self.gen))
                for prev, x in zip([last] + out[:-1], out):
                    self.counts[prev, x] += 1
                self.emitted += len(out)
                self.drafted += len(tok)
                self.accepted += len(out) - 1
                self.branched += any(len(c) > 1 for c in children(par))
                r["verified"] = [last] + tok
                r["accepted"] = out
                r["context"] = r["context"] + out
            for r in [r for r in live if len(r["context"]) >= PROMPT + OUTPUT]:
                live.remove(r)
                finished.add(r["id"])
                if self.started < requests:
                    live.append(self.new_request())
                    nxt = live[-1]
                    nxt["accepted"] = [int(self.rng.choice(V, p=self.P[nxt["context"][-1]]))]
                    nxt["verified"] = [nxt["context"][-1]]
                    nxt["context"].append(nxt["accepted"][0])
        return self


@pytest.mark.parametrize("draft_shape, biased", [
    ("tree", False), ("chain", False), ("tree", True)],
    ids=["merged-trees", "best-chains", "merged-trees-biased-acceptance"])
def test_sampled_output_through_hybrid_drafts_is_the_targets(draft_shape, biased):
    P = target()
    run = Run(P, biased_accept if biased else None, draft_shape).run()
    pv = transition_pvalue(run.counts, P)
    m = run.p.metrics()
    print(f"{draft_shape}{' biased' if biased else ''}: emitted {run.emitted}, drafted "
          f"{run.drafted}, accepted {run.accepted}, branched steps {run.branched}, p={pv:.3g}",
          {k: v["accepted"] for k, v in m["sources"].items()})
    # Drafts were verified at depth, from several sources: the test has teeth.
    assert m["num_errors"] == 0 and all(s["errors"] == 0 for s in m["sources"].values())
    assert run.accepted > run.emitted // 3, (run.accepted, run.emitted)
    assert sum(s["accepted"] > 0 for s in m["sources"].values()) >= 2, m["sources"]
    if draft_shape == "tree":
        assert run.branched > 100, run.branched
    if biased:
        assert pv < 1e-6, pv
    else:
        assert pv > 1e-3, pv


@pytest.mark.parametrize("biased", [False, True], ids=["exact", "biased-acceptance"])
def test_grammar_forced_passes_an_inner_tree_through(biased):
    # grammar_forced around STAND's tree: a request without a grammar is
    # verified as STAND drafted it, a tree (its steps branch), and what comes
    # out is the target's.
    from vllm_plugins.proposers.grammar import GrammarProposer

    P = target()
    p = GrammarProposer(None, {"draft_length": "fixed", "inner": {
        "method": "stand", "draft_shape": "tree", "draft_length": "fixed"}}, vocab_size=V)
    p.load_model(None)
    run = Run(P, biased_accept if biased else None, "tree", proposer=p).run()
    pv = transition_pvalue(run.counts, P)
    print(f"grammar_forced(stand tree){' biased' if biased else ''}: emitted "
          f"{run.emitted}, drafted {run.drafted}, accepted {run.accepted}, "
          f"branched steps {run.branched}, p={pv:.3g}")
    assert run.branched > 100, run.branched
    if biased:
        assert pv < 1e-6, pv
    else:
        assert pv > 1e-3, pv
