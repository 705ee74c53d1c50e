"""Hybrid drafts: every draft source in one tree, per request and per step.

Each source sees one kind of evidence (``vllm_plugins.proposers.sources``):
Token Recycling's tables know the target's recent top-k successors, suffix
trees know long verbatim spans of the prompt and of earlier outputs, prompt
lookup knows the request's own context. Each step, for each request, every
source proposes a small tree; the trees are merged into one trie (the same
token under the same parent is one node), each node carrying the best
calibrated estimate among the sources that proposed it (``calibrate``: per
source, depth and confidence bucket, from every node whose parent was on
an accepted path), and the nodes come out best first by path probability,
cut to the request's budget (``merge``). The draft-length policy then
chooses which nodes to verify (``SHAPES_TREES``), down to one chain or
none. A request the tree path cannot serve (``tree_allowed``) gets the
merged tree's path with the most expected accepted tokens.

A source that raises costs its own candidates for that step only (logged
once per source, counted in ``metrics()["sources"][name]["errors"]``).
Output is exact whatever the sources draft: every node is verified.

Options: ``sources`` (names; default ``sources.default_sources()``),
``source_options`` ({name: {option: value}}, validated against each
source's declared options), ``draft_shape`` ("tree" or "chain"), and the
draft-length options every method takes. Per request,
``extra_args["speculation"]`` narrows the draft length and the sources
(``sources.request``).

Memory: the sources' own (Token Recycling's tables, the suffix cache), the
merge's buffers (a few arrays of the candidates' count), and per request
the last merged tree until its outcome is read and a few floats per source
of what each costs it and brings it (``SourceCosts``), until it is freed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from vllm_plugins.options import Option, choice, flag, resolve
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.draft_length import draft_length_options
from vllm_plugins.proposers.sources import DraftSource, default_sources, source_class
from vllm_plugins.proposers.sources.calibrate import SourceCalibrator
from vllm_plugins.proposers.sources.costs import SourceCosts
from vllm_plugins.proposers.sources.merge import MAX_SOURCES, MergedStep, Merger, StepTrees
from vllm_plugins.proposers.sources.merge import warm_up as warm_up_merge
from vllm_plugins.proposers.sources.request import chosen_sources
from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.tree.sampling import tree_allowed

logger = logging.getLogger("vllm_plugins")
_NO_LEARN, _NO_SENT = DraftSource.learn, DraftSource.sent


@dataclass
class MergedTree:
    """A request's merged tree as drafted, read against the next step: nodes
    ``start:start + n`` of its step's ``StepTrees`` (tokens, parents,
    depth, per-node source bits, per-node and source raw estimates)."""

    trees: StepTrees
    start: int
    n: int
    context_len: int


class HybridProposer(PluginProposer):
    OPTIONS = (
        *draft_length_options("goodput"),
        Option("sources", None, (list, tuple, type(None))),
        Option("source_options", None, (dict, type(None))),
        choice("draft_shape", "tree", ("tree", "chain")),
        flag("source_costs", True),
    )
    # The goodput rule prices every node it keeps, but on a CPU, where each
    # verified token costs a few percent of a step, a budget of 16 keeps more
    # nodes and runs no faster than 8 (docs/benchmarks.md, against vLLM
    # suffix): the smaller trees cost less host time for the same speed.
    DEFAULT_NUM_SPECULATIVE_TOKENS = 8
    CAN_REST = True        # every source catches up from the context itself
    SHAPES_TREES = True    # calibration reads outcomes; sources learn from ``sent``
    TREE_POLICIES = ("fixed", "goodput")

    @classmethod
    def check_options(cls, where: str, options: dict) -> None:
        cls.resolve_sources(where, options)
        if options["draft_shape"] == "tree" and options["draft_length"] not in cls.TREE_POLICIES:
            raise ValueError(
                f"speculative_config option 'draft_length' of method '{where}' must be "
                f"one of {list(cls.TREE_POLICIES)} with draft_shape='tree', got "
                f"{options['draft_length']!r}")

    @classmethod
    def engine_sources(cls, options: dict) -> tuple[str, ...]:
        """The source names an engine with these options runs."""
        return tuple(options["sources"] or default_sources())

    @classmethod
    def resolve_sources(cls, where: str, options: dict) -> list[tuple[str, type, dict]]:
        """(name, class, resolved options) per source; ValueError names the
        option, the source and what is wrong."""
        names = options["sources"]
        if names is None:
            names = default_sources()
        label = f"speculative_config option 'sources' of method '{where}'"
        if not names or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{label} must be a non-empty list of source names, got {names!r}")
        if len(set(names)) != len(names):
            raise ValueError(f"{label} names a source twice: {list(names)}")
        if len(names) > MAX_SOURCES:
            raise ValueError(f"{label} names {len(names)} sources, at most {MAX_SOURCES}")
        given = options["source_options"] or {}
        extra = sorted(set(given) - set(names))
        if extra:
            raise ValueError(f"speculative_config option 'source_options' of method "
                             f"'{where}' names {extra}, not among the sources {list(names)}")
        out = []
        for name in names:
            try:
                klass = source_class(name)
            except ValueError as e:
                raise ValueError(f"{label}: {e}") from None
            opts = given.get(name) or {}
            if not isinstance(opts, dict):
                raise ValueError(f"speculative_config option 'source_options' of method "
                                 f"'{where}': options of source {name!r} must be a dict, "
                                 f"got {opts!r}")
            resolved = resolve(name, klass.OPTIONS, opts, scope="draft source",
                               label="draft source option")
            try:
                klass.check_options(resolved)
            except ValueError as e:
                raise ValueError(f"speculative_config option 'source_options' of method "
                                 f"'{where}': {e}") from None
            out.append((name, klass, resolved))
        return out

    def __init__(self, vllm_config=None, options: dict | None = None,
                 vocab_size: int | None = None):
        super().__init__(vllm_config, options, vocab_size)
        specs = self.resolve_sources("hybrid", self.options)
        self.source_names = tuple(name for name, _, _ in specs)
        self.sources = [klass(opts, self.vocab_size, self.max_draft)
                        for _, klass, opts in specs]
        self.TOPK = max(s.TOPK for s in self.sources)
        self.merger = Merger(len(self.sources), self.vocab_size)
        self.calibrator = SourceCalibrator(len(self.sources), depth=max(self.max_draft, 1))
        self._merged: dict[str, MergedTree] = {}
        self._logged_source: set[int] = set()
        self._logged_request = False
        k = len(self.sources)
        # Per source: merged nodes it proposed, accepted tokens it proposed,
        # calls that raised; rows of one array, read in one call a step
        # (``counters``).
        self.source_counts = np.zeros((3, k), np.int64)
        self.source_nodes, self.source_accepted, self.source_errors = self.source_counts
        self.source_alone = np.zeros(k, np.int64)      # accepted that no other source proposed
        self.request_errors = 0
        self.costs = SourceCosts(k, self.options["source_costs"])

    def load_model(self, target_model) -> None:
        super().load_model(target_model)
        warm_up_merge()
        for s in self.sources:
            s.load()

    # ------------------------------------------------------------ helpers
    def _guard(self, k: int, what: str, fn, *args):
        """``fn(*args)``, or None when it raises: a failing source costs its
        own candidates only (``_raised``)."""
        try:
            return fn(*args)
        except Exception:
            return self._raised(k, what)

    def _raised(self, k: int, what: str) -> None:
        """Source k raised in ``what`` (called in its except block): counted,
        logged once per source; its candidates are left out."""
        self.source_errors[k] += 1
        if k not in self._logged_source:
            self._logged_source.add(k)
            logger.exception("draft source %r failed in %s; its candidates are left "
                             "out (logged once, counted in metrics()['sources'])",
                             self.source_names[k], what)

    def _count_costs(self, ctx: StepContext) -> None:
        """The drafts of the last drafting step against what they cost: the
        step that verified them (its tokens and seconds, the proposer's
        included: the engine waits for it) and the tokens only each source
        proposed for each request (``_learn_outcomes``), against each
        source's time since."""
        seconds = None
        if ctx.last_step_seconds is not None:
            seconds = ctx.last_step_seconds + (ctx.last_propose_seconds or 0.0)
        self.costs.end_step(sum(len(r.accepted) for r in ctx.requests), seconds)

    def _timed(self, k: int, what: str, fn, *args) -> None:
        """``fn(*args)`` (learn, sent), guarded as ``_guard`` does, its time
        counted to source k's engine-wide work (a request's propose is timed
        to that request)."""
        start = time.perf_counter()
        try:
            fn(*args)
        except Exception:
            self._raised(k, what)
        self.costs.add(k, time.perf_counter() - start)

    def _request_options(self, r: RequestStep) -> tuple[int | None, tuple[int, ...]]:
        """(draft cap, source indices) of a request's parsed
        ``speculation``; a malformed one (the front end refuses it first)
        drafts nothing."""
        spec = r.speculation
        try:
            if spec is not None and spec.problem is not None:
                raise ValueError(spec.problem)
            names = chosen_sources(spec, self.source_names)
        except ValueError as e:
            self.request_errors += 1
            if not self._logged_request:
                self._logged_request = True
                logger.error("request %s: bad extra_args (%s); no drafts for it",
                             r.req_id, e)
            return 0, ()
        cap = None if spec is None else spec.max_draft
        if names is None:
            return cap, tuple(range(len(self.sources)))
        return cap, tuple(self.source_names.index(n) for n in names)

    # ------------------------------------------------------------ step
    def draft(self, ctx: StepContext) -> Drafts:
        """Learn, collect every drafting request's source trees (from the
        sources ``SourceCosts`` keeps on for it), merge them all in one call
        (``Merger.merge_step``), lay out the drafts. Every running request
        that may draft joins the costs before the sources learn: a source
        on for none of them learns nothing."""
        self._learn_outcomes(ctx)
        self._count_costs(ctx)
        costs = self.costs
        chosen: list[tuple[int | None, tuple[int, ...]] | None] = []
        for r in ctx.requests:
            choice = None if r.in_prefill else self._request_options(r)
            chosen.append(choice)
            if choice is not None and choice[0] != 0:
                costs.join(r.req_id, choice[1])
        on = costs.on
        for k, s in enumerate(self.sources):
            # A source that keeps no state inherits the empty method: it is
            # neither called nor timed (nor is its ``sent``).
            if on[k] and type(s).learn is not _NO_LEARN:
                self._timed(k, "learn", s.learn, ctx)
        n = len(ctx.requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        conf: list[np.ndarray | None] = [None] * n
        parents: list[list[int] | None] = [None] * n
        as_trees = self.options["draft_shape"] == "tree"
        trees, rows, counts, budgets, chains = [], [], [], [], []
        clock, sources = time.perf_counter, self.sources
        for i, r, budget in self.drafting_requests(ctx):
            cap = chosen[i][0]
            if cap is not None:
                budget = min(budget, cap)
            if budget <= 0:
                continue
            asked = costs.ask(r.req_id)
            seconds = asked.seconds
            before = len(trees)
            for k in asked.on:
                start = clock()
                try:
                    # ValueError for a tree of the wrong types or shapes
                    # (``SourceTree.conformed``): it costs source k's candidates
                    # only. The per-node rules are the merge's (its status).
                    t = sources[k].propose(r, budget).conformed()
                except Exception:
                    t = self._raised(k, "propose")
                seconds[k] += clock() - start
                if t is not None and len(t.tokens):
                    trees.append((k, t))
            if len(trees) > before:
                rows.append((i, r))
                counts.append(len(trees) - before)
                budgets.append(budget)
                chains.append(not (as_trees and tree_allowed(r.sampling_params)))
        if not rows:
            return Drafts(tokens, None, conf, parents)
        step = self.merger.merge_step(trees, counts, budgets, chains, self.calibrator,
                                      self.source_nodes)
        status, starts, sizes, chain_sizes = step.lists()
        if any(status):
            for g, problem in enumerate(status):
                if problem:
                    self._source_failed(trees[g][0], MergedStep.PROBLEMS[problem])
        tok, par, chain_tok = step.drafted()
        cond, chain_cond = step.draft_cond
        for (i, r), a, m, c, chain in zip(rows, starts, sizes, chain_sizes, chains):
            if m == 0:
                continue
            self._merged[r.req_id] = MergedTree(step.trees, a, m, len(r.context))
            if chain:
                tokens[i], conf[i] = chain_tok[a:a + c], chain_cond[a:a + c]
            else:
                tokens[i], parents[i], conf[i] = tok[a:a + m], par[a:a + m], cond[a:a + m]
        return Drafts(tokens, None, conf, parents)

    def _source_failed(self, k: int, problem: str) -> None:
        """A tree the merge refused: it costs source k's candidates for that
        request (logged once per source)."""
        self.source_errors[k] += 1
        if k not in self._logged_source:
            self._logged_source.add(k)
            logger.error("draft source %r proposed a tree that breaks the contract (%s); "
                         "its candidates are left out (logged once, counted in "
                         "metrics()['sources'])", self.source_names[k], problem)

    def _learn_outcomes(self, ctx: StepContext) -> None:
        """Every observed node of the trees drafted last step: a node whose
        parent is the root or on the accepted path (the accepted tokens
        walk the trie). Its outcome, for each source that proposed it,
        goes to the calibration; the accepted path's nodes are counted to
        the sources that proposed them, and each request's tokens that
        only one source proposed to that request's costs
        (``SourceCosts.outcomes``). All requests in one call
        (``Merger.outcomes_step``)."""
        recs, emitted, req_ids = [], [], []
        for r in ctx.requests:
            rec = self._merged.pop(r.req_id, None)
            if rec is None or len(r.accepted) == 0 \
                    or len(r.context) - len(r.accepted) != rec.context_len:
                continue
            recs.append(rec)
            emitted.append(r.accepted)
            req_ids.append(r.req_id)
        if not recs:
            return
        trees = recs[0].trees
        if all(rec.trees is trees for rec in recs):
            starts = [rec.start for rec in recs]
        else:   # a request that skipped steps: its tree is an older step's
            trees = StepTrees.concatenate([(rec.trees, rec.start, rec.n) for rec in recs])
            starts = np.cumsum([0] + [rec.n for rec in recs[:-1]])
        *_, alone = self.merger.outcomes_step(
            trees, starts, [rec.n for rec in recs], emitted, self.source_accepted,
            self.source_alone, self.calibrator)
        if self.costs.enabled:
            self.costs.outcomes(req_ids, alone.tolist())

    def proposed(self, ctx: StepContext, drafts: Drafts) -> None:
        on = self.costs.on
        for k, s in enumerate(self.sources):
            if on[k] and type(s).sent is not _NO_SENT:
                self._timed(k, "sent", s.sent, ctx, drafts)

    def free(self, req_id: str) -> None:
        self._merged.pop(req_id, None)
        self.costs.free(req_id)
        for k, s in enumerate(self.sources):
            self._guard(k, "free", s.free, req_id)

    def counters(self) -> dict[str, dict[str, int]]:
        out = super().counters()
        names = self.source_names
        nodes, accepted, errors = self.source_counts.tolist()
        out["source_draft_nodes"] = dict(zip(names, nodes))
        out["source_accepted_tokens"] = dict(zip(names, accepted))
        out["source_errors"] = dict(zip(names, errors))
        out["source_off_steps"] = dict(zip(names, self.costs.off_steps))
        return out

    def metrics(self) -> dict:
        out = super().metrics()
        out["request_errors"] = self.request_errors
        costs = self.costs.table(self.source_names)
        out["sources"] = {
            name: {"nodes": int(self.source_nodes[k]),
                   "accepted": int(self.source_accepted[k]),
                   "accepted_alone": int(self.source_alone[k]),
                   "errors": int(self.source_errors[k]),
                   "acceptance_by_depth": self.calibrator.table(k)[:8],
                   **costs[name]}
            for k, name in enumerate(self.source_names)}
        return out
