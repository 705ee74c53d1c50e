"""A synthetic world for the tree goodput policy: requests whose drafts are
trees with known conditional acceptance, a target that emits tokens by
those probabilities, and a step time from a stated cost curve.

At a node u the target emits child j's token with probability
``truth[j]`` (children of u in the offered tree), and a token no draft
has otherwise; verification descends while a sent child carries the
emitted token (greedy acceptance of a deterministic draft). The proposer's
confidence per node is ``confidence_scale * truth``, clipped to [0, 1].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vllm_plugins.step_context import Drafts, RequestStep, StepContext

OTHER = 7           # a token no draft carries
TOKEN_BASE = 1000   # node i of a step's tree carries token TOKEN_BASE + i


@dataclass
class Cost:
    intercept: float
    per_token: float
    tree_step: float = 0.0
    noise: float = 0.02
    tree_token: float = 0.0   # what each token of a tree step costs beyond a chain's

    def seconds(self, tokens: int, tree: bool, rng) -> float:
        t = self.intercept + self.per_token * tokens
        if tree:
            t += self.tree_step + self.tree_token * tokens
        return t * (1.0 + self.noise * rng.standard_normal())


def make_tree(nodes: int, root_children, children, max_depth: int = 8):
    """(parents, truth) of the ``nodes`` children of highest path
    probability, best first: the root's children have conditional
    probabilities ``root_children``, every other node ``children``."""
    import heapq

    parents, truth, path_p, depth = [], [], [], []
    heap = [(-p, 0, -1, j, p) for j, p in enumerate(root_children)]
    heapq.heapify(heap)
    seq = len(heap)
    while heap and len(parents) < nodes:
        neg, _, parent, _, p = heapq.heappop(heap)
        i = len(parents)
        parents.append(parent)
        truth.append(p)
        path_p.append(-neg)
        depth.append(1 if parent < 0 else depth[parent] + 1)
        if depth[i] < max_depth:
            for j, c in enumerate(children):
                heapq.heappush(heap, (-path_p[i] * c, seq, i, j, c))
                seq += 1
    return parents, np.asarray(truth)


class TreeWorld:
    """Requests drafting trees (``tree_rows``) and chains (the rest)."""

    def __init__(self, batch: int, cost: Cost, nodes: int = 12, seed: int = 0,
                 root_children=(0.6, 0.25, 0.1), children=(0.8, 0.1),
                 confidence_scale: float = 1.0, tree_rows: int | None = None,
                 chain_truth: float = 0.7):
        self.rng = np.random.default_rng(seed)
        self.cost = cost
        self.nodes = nodes
        self.parents, self.truth = make_tree(nodes, root_children, children)
        self.scale = confidence_scale
        self.ids = [f"r{i}" for i in range(batch)]
        self.tree_rows = batch if tree_rows is None else tree_rows
        self.chain_truth = chain_truth
        self.context = {rid: [1, 2, 3, 4, 5] for rid in self.ids}
        self.sent: dict[str, tuple[list[int], list[int] | None]] = {}
        self.last_seconds: float | None = None
        self.last_tokens = 0
        self.emitted_total = 0
        self.steps = 0
        self.seconds_total = 0.0

    def drafts(self) -> Drafts:
        tokens, conf, parents = [], [], []
        for k, _ in enumerate(self.ids):
            if k < self.tree_rows:
                tokens.append([TOKEN_BASE + i for i in range(self.nodes)])
                parents.append(list(self.parents))
                conf.append(np.clip(self.scale * self.truth, 0.0, 1.0).astype(np.float32))
            else:
                n = 6
                tokens.append([TOKEN_BASE + i for i in range(n)])
                parents.append(None)
                conf.append(np.full(n, min(1.0, self.scale * self.chain_truth), np.float32))
        return Drafts(tokens, None, conf, parents)

    def _emit(self, row: int, tokens: list[int], parents: list[int] | None) -> list[int]:
        """The target's tokens for one request's sent drafts."""
        if row >= self.tree_rows:   # a chain: each draft right with chain_truth
            out = []
            for t in tokens:
                if self.rng.random() < self.chain_truth:
                    out.append(t)
                else:
                    out.append(OTHER)
                    return out
            out.append(OTHER)
            return out
        # Children of each offered node, and which were sent.
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(self.parents):
            kids.setdefault(p, []).append(i)
        sent = {t - TOKEN_BASE for t in tokens}
        out, node = [], -1
        while True:
            cands = kids.get(node, [])
            probs = [self.truth[i] for i in cands]
            u = self.rng.random()
            pick, acc = None, 0.0
            for i, p in zip(cands, probs):
                acc += p
                if u < acc:
                    pick = i
                    break
            token = OTHER if pick is None else TOKEN_BASE + pick
            out.append(token)
            if pick is None or pick not in sent:
                return out
            node = pick

    def context_for(self, out: Drafts | None) -> StepContext:
        """The step that verifies ``out`` (None: the first step, prefill)."""
        reqs = []
        tree = False
        tokens = len(self.ids)
        for k, rid in enumerate(self.ids):
            if out is None:
                emitted = [OTHER]
                n = 0
            else:
                sent = out.tokens[k]
                par = out.parents[k] if out.parents is not None else None
                emitted = self._emit(k, sent, par)
                n = len(sent)
                tokens += n
                if par is not None and list(par) != list(range(-1, len(par) - 1)):
                    tree = True
            self.context[rid] = self.context[rid] + emitted
            self.emitted_total += len(emitted) if out is not None else 0
            reqs.append(RequestStep(
                req_id=rid, accepted=np.asarray(emitted, np.int64),
                context=np.asarray(self.context[rid], np.int64), num_prompt_tokens=5,
                num_draft=n, verified_tokens=np.zeros(n + 1, np.int64), topk_ids=None,
                topk_logprobs=None, temperature=0.0))
        seconds = None
        if out is not None:
            seconds = self.cost.seconds(tokens, tree, self.rng)
            self.seconds_total += seconds
            self.steps += 1
        return StepContext(reqs, max_draft=self.nodes, last_step_seconds=seconds,
                           last_step_tokens=tokens if out is not None else 0)


def run(controller, world: TreeWorld, steps: int) -> list[Drafts]:
    """Drive ``controller`` through ``steps`` steps of ``world``; returns
    the drafts it sent."""
    sent = []
    out = None
    for _ in range(steps):
        ctx = world.context_for(out)
        observation = controller.observe(ctx)
        if observation.resting:
            out = Drafts([[] for _ in ctx.requests])
        else:
            out = controller.shape(ctx, world.drafts(), observation)
        sent.append(out)
    return sent
