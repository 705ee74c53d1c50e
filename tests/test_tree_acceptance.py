"""Tree acceptance rules against references (fast; no engine).

Greedy: against a brute-force enumeration of every root-down path, and on
chains against vLLM's own rejection sampler. Sampling: chi-square tests that
the emitted tokens are distributed as the target's, each beside a control,
the same rule with one step left out, that the same test must reject.
"""

import numpy as np
import pytest
import torch

from tests.test_stand import chi2_pvalue
from vllm_plugins.tree import (chain_parents, children, greedy_accept,
                               path_to, row_starts,
                               sample_accept_deterministic,
                               sample_accept_with_probs, validate)


def random_tree(rng, n, vocab):
    parents = [int(rng.integers(-1, i)) for i in range(n)]
    return parents, [int(t) for t in rng.integers(0, vocab, n)]


# ------------------------------------------------------------------ greedy
def brute_force_greedy(parents, tokens, best):
    """Every root-down path (the empty one included), kept when each node is
    the argmax at its parent's row; the longest, then the first in node
    order."""
    paths = [[]] + [path_to(parents, i) for i in range(len(tokens))]
    good = [p for p in paths
            if all(tokens[i] == best[parents[i] + 1] for i in p)]
    path = min(good, key=lambda p: (-len(p), p))
    last_row = path[-1] + 1 if path else 0
    return path, [tokens[i] for i in path] + [best[last_row]]


def test_greedy_takes_the_longest_matching_path():
    rng = np.random.default_rng(0)
    for trial in range(200):
        batch = [random_tree(rng, int(rng.integers(0, 30)), vocab=3)
                 for _ in range(int(rng.integers(1, 4)))]
        parents, tokens = [b[0] for b in batch], [b[1] for b in batch]
        rows = sum(len(t) + 1 for t in tokens)
        logits = torch.randn(rows, 3, generator=torch.Generator().manual_seed(trial))
        got = greedy_accept(parents, tokens, logits)
        best = logits.argmax(-1).tolist()
        for r, start in enumerate(row_starts(tokens)):
            want = brute_force_greedy(parents[r], tokens[r], best[start:])
            assert (got[r].nodes, got[r].tokens) == want


def test_greedy_prefers_the_longer_branch_and_then_the_first_sibling():
    # Rows: root -> 5; node 0 (5) -> 9; node 1 (5) -> 7; node 2 (7) -> 1.
    best = torch.tensor([5, 9, 7, 1, 3])
    assert greedy_accept([[-1, -1, 1, 1]], [[5, 5, 7, 7]], best)[0].nodes == [1, 2]
    assert greedy_accept([[-1, -1]], [[5, 5]], best[:3])[0].nodes == [0]


@pytest.fixture(scope="module")
def vllm_rejection_sample():
    """vLLM's rejection_sample, with vLLM's own CPU implementation of its
    greedy kernel where this build has no Triton (the engine registers the
    same override at start-up; only the one kernel is rebound here, since
    vLLM's rebinding scan over every module trips on modules other tests
    import)."""
    import vllm.v1.sample.rejection_sampler as rs
    from vllm.triton_utils import HAS_TRITON
    from vllm.triton_utils.dispatcher import KernelOverride
    from vllm.utils import cpu_triton_utils
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    owner = rs._rejection_greedy_sample
    original = owner.kernel
    if not HAS_TRITON and not isinstance(original, KernelOverride):
        owner.kernel = KernelOverride(
            original, cpu_triton_utils._rejection_greedy_sample_kernel_impl)
        owner.__dict__.pop("_kernel_arg_names", None)

    def run(drafts, logits, bonus):
        batch = len(drafts)
        meta = SamplingMetadata(
            temperature=None, all_greedy=True, all_random=False, top_p=None,
            top_k=None, generators={}, max_num_logprobs=None, no_penalties=True,
            prompt_token_ids=None, frequency_penalties=torch.zeros(batch),
            presence_penalties=torch.zeros(batch),
            repetition_penalties=torch.ones(batch), output_token_ids=[[]] * batch,
            allowed_token_ids_mask=None, bad_words_token_ids={},
            logitsprocs=LogitsProcessors())
        counts = [len(d) for d in drafts]
        out = rs.rejection_sample(
            torch.tensor([t for d in drafts for t in d], dtype=torch.int32),
            counts, max(counts), torch.tensor(np.cumsum(counts), dtype=torch.int32),
            None, logits, bonus[:, None].contiguous(), meta)
        return [[t for t in row if t >= 0] for row in out.tolist()]

    yield run
    owner.kernel = original
    owner.__dict__.pop("_kernel_arg_names", None)


def test_greedy_chain_is_vllms_rejection_sampler(vllm_rejection_sample):
    rng = np.random.default_rng(1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        vocab = 4
        drafts = [[int(t) for t in rng.integers(0, vocab, int(rng.integers(1, 7)))]
                  for _ in range(int(rng.integers(1, 5)))]
        starts = row_starts(drafts)
        rows = torch.randn(starts[-1] + len(drafts[-1]) + 1, vocab, generator=gen)
        # vLLM verifies the draft rows and takes the bonus token separately:
        # the argmax of the row after each request's last draft.
        draft_rows = torch.cat([rows[s:s + len(d)] for s, d in zip(starts, drafts)])
        bonus = torch.stack([rows[s + len(d)].argmax() for s, d in zip(starts, drafts)])
        want = vllm_rejection_sample(drafts, draft_rows, bonus)
        got = greedy_accept([chain_parents(len(d)) for d in drafts], drafts, rows)
        assert [g.tokens for g in got] == want
        assert [g.nodes for g in got] == [list(range(len(w) - 1)) for w in want]


# ----------------------------------------------------------------- sampling
V = 4


class World:
    """A target p(. | context) and a draft model q(. | context) over V tokens,
    fixed per context (seeded by it), so a step's target rows are what a
    model would give along each tree path. The two are drawn independently:
    rejections are frequent, which is where every control goes wrong."""

    def __init__(self, seed):
        self.seed, self.cache = seed, {}

    def dist(self, who, context):
        key = (who, tuple(context))
        if key not in self.cache:
            rng = np.random.default_rng([self.seed, who, len(context), *context])
            self.cache[key] = rng.dirichlet(np.ones(V))
        return self.cache[key]

    def target_rows(self, context, parents, tokens):
        paths = [[]] + [path_to(parents, i) for i in range(len(tokens))]
        return torch.tensor(np.stack(
            [self.dist(0, [*context, *[tokens[j] for j in p]]) for p in paths]),
            dtype=torch.float32)


# Tree shapes: children per node, in node order (node i's count at index i+1;
# index 0 is the root). Drawn trees place up to 3 root children.
SHAPE = [3, 2, 1, 0, 1, 0, 0]


def deterministic_tree(world, context):
    """Tokens by rank under the draft model (no randomness): the root's three
    likeliest, their likeliest children, and so on."""
    parents, tokens = [], []
    frontier = [(-1, list(context))]
    for slots in SHAPE:
        if not frontier:
            break
        parent, ctx = frontier.pop(0)
        ranked = np.argsort(-world.dist(1, ctx), kind="stable")[:slots]
        for t in ranked:
            parents.append(parent)
            tokens.append(int(t))
            frontier.append((len(tokens) - 1, [*ctx, int(t)]))
    return parents, tokens, None


def drawn_tree(world, context, rng):
    """Gumbel-top-k without replacement from the draft model at each node,
    siblings in draw order, each node's row the q it was drawn from."""
    parents, tokens, rows = [], [], []
    frontier = [(-1, list(context))]
    for slots in SHAPE:
        if not frontier:
            break
        parent, ctx = frontier.pop(0)
        q = world.dist(1, ctx)
        keys = np.log(q) + rng.gumbel(size=V)
        for t in np.argsort(-keys, kind="stable")[:slots]:
            parents.append(parent)
            tokens.append(int(t))
            rows.append(q)
            frontier.append((len(tokens) - 1, [*ctx, int(t)]))
    return parents, tokens, np.stack(rows).astype(np.float32)


def plain_rrs(parents, tokens, p_rows, q_rows, rng, residual=True, condition=True):
    """Recursive rejection sampling written out plainly for one request, with
    switches that each leave one step out: the controls."""
    p_rows = p_rows.numpy().astype(np.float64)
    kids = children(parents)
    out, row = [], 0
    while True:
        p = p_rows[row]
        seen = []
        for c in kids[row]:
            q = np.eye(V)[tokens[c]] if q_rows is None else q_rows[c].astype(np.float64)
            if condition and q_rows is not None and seen:
                q = q.copy()
                q[seen] = 0
                q /= q.sum()
            seen.append(tokens[c])
            x = tokens[c]
            if rng.random() * q[x] < p[x]:
                break
            if residual:
                p = np.maximum(p - q, 0)
                p /= p.sum()
        else:
            out.append(int(rng.choice(V, p=p / p.sum())))
            return out
        out.append(x)
        row = c + 1


def first_two_tokens(world, build, accept, draws, seed):
    """Counts of the first two emitted tokens over independent runs from an
    empty context (a second step when the first emitted one token)."""
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(draws):
        out = []
        while len(out) < 2:
            parents, tokens, rows = build(world, out, rng)
            validate(parents)
            out += accept(parents, tokens, world.target_rows(out, parents, tokens),
                          rows, rng)
        counts[out[0], out[1]] += 1
    return counts


def exactness_pvalues(world, counts):
    p1 = world.dist(0, [])
    want = p1[:, None] * np.stack([world.dist(0, [t]) for t in range(V)])
    return (chi2_pvalue(counts.sum(1), p1), chi2_pvalue(counts.ravel(), want.ravel()))


def library(rule):
    gen = torch.Generator().manual_seed(0)

    def accept(parents, tokens, p_rows, q_rows, rng):
        if rule == "deterministic":
            return sample_accept_deterministic([parents], [tokens], p_rows, gen)[0].tokens
        return sample_accept_with_probs([parents], [tokens], p_rows, [q_rows], gen)[0].tokens
    return accept


def control(**switches):
    def accept(parents, tokens, p_rows, q_rows, rng):
        return plain_rrs(parents, tokens, p_rows, q_rows, rng, **switches)
    return accept


BUILDS = {"deterministic": lambda w, ctx, rng: deterministic_tree(w, ctx),
          "drawn": drawn_tree}
DRAWS = 3000


@pytest.mark.parametrize("build, accept, exact", [
    ("deterministic", library("deterministic"), True),
    ("deterministic", library("with_probs"), True),  # no rows: the same rule
    ("deterministic", control(residual=False), False),
    ("drawn", library("with_probs"), True),
    ("drawn", control(), True),
    ("drawn", control(residual=False), False),
    ("drawn", control(condition=False), False),
], ids=["deterministic", "deterministic-via-with-probs", "deterministic-no-residual",
        "drawn", "drawn-plain-reference", "drawn-no-residual",
        "drawn-no-without-replacement"])
def test_sampled_output_is_the_targets(build, accept, exact):
    world = World(seed=3)
    counts = first_two_tokens(world, BUILDS[build], accept, DRAWS, seed=7)
    p_first, p_pair = exactness_pvalues(world, counts)
    if exact:
        assert min(p_first, p_pair) > 1e-3, (p_first, p_pair)
    else:
        assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)


@pytest.mark.parametrize("with_rows", [True, False])
def test_a_seeded_request_draws_only_from_its_own_generator(with_rows):
    world, rng = World(seed=5), np.random.default_rng(0)
    trees = [drawn_tree(world, [c], rng) for c in range(3)]
    parents, tokens = [t[0] for t in trees], [t[1] for t in trees]
    rows = torch.cat([world.target_rows([c], t[0], t[1]) for c, t in enumerate(trees)])
    q_rows = [t[2] if with_rows else None for t in trees]

    def seeded(seed):
        return torch.Generator().manual_seed(seed)

    for trial in range(20):
        batch = sample_accept_with_probs(
            parents, tokens, rows, q_rows,
            {0: seeded(trial), 1: seeded(100 + trial), 2: seeded(200 + trial)})
        start = row_starts(tokens)[1]
        alone = sample_accept_with_probs(
            parents[1:2], tokens[1:2], rows[start:start + len(tokens[1]) + 1],
            q_rows[1:2], [seeded(100 + trial)])
        assert batch[1] == alone[0]
        assert batch[1].tokens[:-1] == [tokens[1][n] for n in batch[1].nodes]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_first_argmax_is_argmax_with_ties_anywhere(dtype):
    """Tree acceptance reads greedy tokens through ``first_argmax``; it must
    pick what argmax (vLLM's greedy sampler) picks, ties included, wherever
    the tied maxima fall in a vocabulary-sized row."""
    from vllm_plugins.tree.acceptance import first_argmax

    gen = torch.Generator().manual_seed(3)
    vocab = 49152
    rows = torch.randn(40, vocab, generator=gen).to(dtype)
    top = rows.max() + 1
    ties = [(0, 1), (7, 8), (15, 16), (16, 31), (3, vocab - 1), (vocab - 2, vocab - 1),
            (100, 40000), (63, 64), (127, 128), (1000, 1001, 1002)]
    for r, cols in enumerate(ties):
        rows[r, list(cols)] = top
    rows[len(ties), :] = float("-inf")     # no finite entry: argmax says 0
    rows[len(ties) + 1, 5:] = float("-inf")
    expect = rows.argmax(dim=-1)
    assert torch.equal(first_argmax(rows), expect)
    assert [int(expect[r]) for r in range(len(ties))] == [min(c) for c in ties]
