"""Token Recycling: draft from the target's own recent top-k successors.

Every verification step computes the target's distribution at each verified
position, including rejected draft positions, and vLLM throws all but the
sampled token away. We keep it: a vocab x k adjacency matrix holds, per token,
the target's top-k successors the last time that token was verified. Drafts
walk the matrix from the last token along the most probable successor.

vLLM verifies one chain per request (no tree attention on this route), so the
chain must be right as often as possible. A bigram matrix forgets everything
but the last token; ``context_order`` adds direct-mapped tables keyed by the
last 2..n tokens, filled from the same verified positions, and drafting backs
off from the longest context that has an entry to the matrix. Prompt n-grams
seed empty entries, so a request can copy from its own prompt before the
target has verified anything.

Memory (stated, fixed at start): matrix vocab*k*(4+4) bytes (SmolLM2, k=8:
3.0 MiB); context table context_slots*(8+4+4) bytes (default 2^20: 16 MiB);
the walk's buffers, batch x num_speculative_tokens x 8 bytes, grown to the
largest batch seen. Tables and walk: ``token_recycling_tables``.

``"tables": "device"`` keeps the tables as tensors on the target's device
and drafts chains with static-shape torch ops that never read back to the
host (``token_recycling_device``; its V1 packing ``token_recycling_device_chains``);
the default, ``"host"``, is the numba walk, cheaper where the tables are in
host memory anyway.

``"draft_shape": "tree"`` drafts a tree per request instead, up to
``num_speculative_tokens`` nodes (``token_recycling_tree``); requests whose
sampling the tree path cannot serve (``vllm_plugins.tree.sampling.tree_allowed``) keep the
chain. The ``goodput`` policy then chooses which nodes to verify each step
(docs/draft_length_design.md, "Trees"); ``fixed`` verifies them all.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

import numpy as np

from vllm_plugins.options import Option, choice, flag, unit_float
from vllm_plugins.proposers.base import PluginProposer
from vllm_plugins.proposers.draft_length import draft_length_options
from vllm_plugins.proposers.token_recycling_device_chains import DeviceChains
from vllm_plugins.proposers.token_recycling_tables import (SEED_LOGP, TABLE_OPTIONS,
                                                           RecyclingTables,
                                                           warm_up)
from vllm_plugins.proposers.token_recycling_tree import BUILDERS, TreeBuilder, learn_tree
from vllm_plugins.proposers.token_recycling_tree import warm_up as warm_up_tree
from vllm_plugins.step_context import Drafts, RequestStep, StepContext
from vllm_plugins.tree.sampling import tree_allowed


def writes_shared_files() -> bool:
    """Whether this process writes files every rank would write alike
    (``save_path``): the first process of torch.distributed's world, or the
    only one. Tensor-parallel ranks hold the same tables (they learn from the
    same gathered logits), so one copy is all of them; under data parallel
    the first replica's tables are saved. Asked in ``load_model``: vLLM's
    workers have joined the world by then, and at exit it may be gone."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def max_device_slots(vllm_config) -> int:
    """Request slots of the device tables: the engine's max_num_seqs (more
    are added if preempted requests wait beside as many running ones)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    return int(getattr(scheduler, "max_num_seqs", None) or 256)


def target_device(target_model: Any):
    """The device of the target's weights (the CPU for a model without any)."""
    import torch

    for p in getattr(target_model, "parameters", lambda: ())():
        return p.device
    return torch.device("cpu")


class TokenRecyclingProposer(PluginProposer):
    OPTIONS = (
        *draft_length_options("goodput"),
        *TABLE_OPTIONS,
        unit_float("min_confidence", 0.02),
        flag("seed_from_prompt", True),
        Option("warm_start_path", None, (str, type(None))),
        Option("save_path", None, (str, type(None))),
        choice("draft_shape", "chain", ("chain", "tree")),
        choice("tree_builder", "best_first", BUILDERS),
        flag("context_branch", True),
        choice("tables", "host", ("host", "device")),
    )
    DEFAULT_NUM_SPECULATIVE_TOKENS = 6
    CAN_REST = True   # drafts from the tables and each request's context
    SHAPES_TREES = True   # learns from the nodes sent (``proposed``)
    # Up to this many requests a step, each request's chain is learnt by one
    # compiled call (``RecyclingTables.learn_chain``); more are batched into
    # arrays, one pass for all.
    _LEARN_ONE_BY_ONE = 8
    # Policies that read a tree node by node (the others read it as a chain).
    TREE_POLICIES = ("fixed", "goodput")

    @classmethod
    def check_options(cls, where: str, options: dict) -> None:
        if options["tables"] == "device":
            given = [name for name in ("warm_start_path", "save_path") if options[name]]
            if options["draft_shape"] != "chain" or given:
                raise ValueError(
                    f"speculative_config option 'tables' of method '{where}' is 'device', "
                    f"which drafts chains from tables it does not save or load; got "
                    f"draft_shape={options['draft_shape']!r}"
                    + "".join(f", {name}={options[name]!r}" for name in given))
        if options["draft_shape"] == "tree" and options["draft_length"] not in cls.TREE_POLICIES:
            raise ValueError(
                f"speculative_config option 'draft_length' of method '{where}' must be "
                f"one of {list(cls.TREE_POLICIES)} with draft_shape='tree' (the others "
                f"read a tree as a chain), got {options['draft_length']!r}")

    def __init__(self, vllm_config=None, options: dict | None = None,
                 vocab_size: int | None = None):
        super().__init__(vllm_config, options, vocab_size)
        o = self.options
        if self.vocab_size is None:
            raise ValueError("token_recycling needs the vocabulary size")
        self.device_chains = None
        if o["tables"] == "device":
            self.device_chains = DeviceChains(self.vocab_size, o, max_device_slots(vllm_config))
            self.tables = None
            self.TOPK = 1  # the chain reads a matrix row's top-1 only
        else:
            self.tables = RecyclingTables(self.vocab_size, o["topk"], o["context_order"],
                                          o["context_slots"])
        if o["warm_start_path"] and os.path.exists(o["warm_start_path"]):
            self.tables.load(o["warm_start_path"])
        self._seen: set[str] = set()
        self._walk: tuple[np.ndarray, ...] | None = None  # see _walk_buffers
        self._tree = None
        if o["draft_shape"] == "tree":
            self._tree = TreeBuilder(self.tables, o["tree_builder"], o["context_branch"])
        # Each request's last tree draft (tokens, parents): the next step's
        # verified rows are read against it.
        self._drafted_trees: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def device_drafter(self):
        """With ``"tables": "device"``, the device route over the same
        tables (Model Runner V2 serves it with no host read in its step)."""
        if self.device_chains is None:
            return None
        from vllm_plugins.proposers.token_recycling_device_step import DeviceRecyclingDrafter

        return DeviceRecyclingDrafter(self.device_chains.tables,
                                      self.options["seed_from_prompt"])

    def load_model(self, target_model: Any) -> None:
        super().load_model(target_model)
        if self.device_chains is not None:
            self.device_chains.to(target_device(target_model))
            if self.device_chains.tables.compiled:
                from vllm_plugins.proposers.token_recycling_device_compiled import (
                    warm_up as warm_up_compiled_step)

                warm_up_compiled_step()  # the route's step, compiled now, not in a step
            return
        warm_up()  # numba compiles (or loads) the walk now, not in a step
        if self._tree is not None:
            warm_up_tree()
        if self.options["save_path"] and writes_shared_files():
            atexit.register(self.tables.save, self.options["save_path"])

    def free(self, req_id: str) -> None:
        if self.device_chains is not None:
            self.device_chains.free(req_id)
        self._seen.discard(req_id)
        self._drafted_trees.pop(req_id, None)

    def learn(self, ctx: StepContext) -> None:
        """Tables <- every verified row of the step: a few requests' chains
        by one compiled call each, more in one vectorised pass (a Python
        loop row by row would be most of the learning time); a request's
        prompt seeds the tables the first time it is seen."""
        if self.device_chains is not None:
            self.device_chains.learn(ctx)
            return
        t = self.tables
        inputs, ids, lps = [], [], []
        seqs, ends, starts = [], [], []
        offset = 0
        # A few requests' chains are learnt one compiled call each, after the
        # trees (as the batched arrays are): the same writes in the same order.
        one_by_one = len(ctx.requests) <= self._LEARN_ONE_BY_ONE
        chains = []
        for r in ctx.requests:
            if r.req_id not in self._seen and len(r.accepted) > 0:
                self._seen.add(r.req_id)
                if self.options["seed_from_prompt"]:
                    self._seed(np.asarray(r.context[:r.num_prompt_tokens], np.int64))
            if r.topk_ids is None or len(r.verified_tokens) == 0:
                continue
            rows = len(r.verified_tokens)
            if self._learn_tree(r):
                continue
            if one_by_one:
                chains.append(r)
                continue
            inputs.append(r.verified_tokens)
            ids.append(r.topk_ids[:rows])
            lps.append(r.topk_logprobs[:rows])
            if t.context_order >= 2:
                # Row j's context: the tokens before this step's output,
                # then drafts 1..j (verified_tokens[0] is the last of those).
                base = len(r.context) - len(r.accepted)
                lo = max(0, base - t.context_order)
                seqs += [np.asarray(r.context[lo:base], np.int64),
                         r.verified_tokens[1:].astype(np.int64)]
                ends.append(offset + base - lo + np.arange(rows))
                starts.append(np.full(rows, offset))
                offset += base - lo + rows - 1
        for r in chains:
            t.learn_chain(r.context, len(r.context) - len(r.accepted), r.verified_tokens,
                          r.topk_ids, r.topk_logprobs)
        if not inputs:
            return
        ids_all, lps_all = np.concatenate(ids), np.concatenate(lps)
        t.learn_rows(np.concatenate(inputs), ids_all, lps_all)
        if seqs:
            t.learn_contexts(np.concatenate(seqs), np.concatenate(ends),
                             ids_all[:, 0], lps_all[:, 0], np.concatenate(starts))

    def _learn_tree(self, r: RequestStep) -> bool:
        """Learn a step that verified (a prefix of) this request's tree
        draft, node by node along each node's own path; False when the
        verified rows are a chain (the walk's learning applies)."""
        drafted = self._drafted_trees.pop(r.req_id, None)
        if drafted is None:
            return False
        tokens, parents = drafted
        m = len(r.verified_tokens) - 1
        # m <= len(tokens) and verified_tokens has m + 1 entries: the compared
        # arrays have one length (np.array_equal's checks cost more here).
        if m < 2 or m > len(tokens) or not (r.verified_tokens[1:] == tokens[:m]).all() \
                or (parents[:m] == np.arange(-1, m - 1)).all():
            return False
        base = len(r.context) - len(r.accepted)
        learn_tree(self.tables, np.asarray(r.context[:base], np.int64), tokens[:m],
                   parents[:m], r.topk_ids, r.topk_logprobs)
        return True

    def _seed(self, prompt: np.ndarray) -> None:
        t = self.tables
        t.seed_matrix(prompt)
        if len(prompt) > 2:
            t.learn_contexts(prompt, np.arange(2, len(prompt)), prompt[2:],
                             np.full(len(prompt) - 2, SEED_LOGP, np.float32),
                             only_if_empty=True)

    def draft(self, ctx: StepContext) -> Drafts:
        self.learn(ctx)
        n = len(ctx.requests)
        tokens: list[list[int]] = [[] for _ in range(n)]
        conf: list[np.ndarray | None] = [None] * n
        drafting = list(self.drafting_requests(ctx))
        if not drafting:
            return Drafts(tokens, None, conf)
        if self._tree is not None:
            return self._draft_trees(ctx, drafting, tokens, conf)
        if self.device_chains is not None:
            self.device_chains.draft(drafting, tokens, conf)
        else:
            self._draft_chains(drafting, tokens, conf)
        return Drafts(tokens, None, conf)

    def _draft_chains(self, drafting, tokens, conf) -> None:
        """The walk's chain for each (row, request, length) of ``drafting``,
        into ``tokens`` and ``conf`` at its row."""
        order = max(self.tables.context_order, 1)
        rows, tails, tail_lens, lengths, out_tok, out_conf, out_len = \
            self._walk_buffers(len(drafting), max(length for _, _, length in drafting))
        for j, (i, r, length) in enumerate(drafting):
            tail = r.context[-order:]
            tails[j, :len(tail)] = tail
            tail_lens[j] = len(tail)
            lengths[j] = length
        self.tables.walk(tails[:rows], tail_lens[:rows], lengths[:rows],
                         self.options["min_confidence"], out_tok, out_conf, out_len)
        for j, (i, _, _) in enumerate(drafting):
            m = out_len[j]
            tokens[i] = out_tok[j, :m].tolist()
            conf[i] = out_conf[j, :m].astype(np.float32)

    def _draft_trees(self, ctx: StepContext, drafting, tokens, conf) -> Drafts:
        """Trees for the requests the tree path serves, chains for the rest
        (``tree_allowed``). A tree node's confidence is its
        probability given its parent."""
        parents: list[list[int] | None] = [None] * len(ctx.requests)
        chains = []
        for i, r, length in drafting:
            if not tree_allowed(r.sampling_params):
                chains.append((i, r, length))
                continue
            tok, par, p = self._tree.build(np.asarray(r.context, np.int64), length,
                                           self.options["min_confidence"])
            tokens[i] = tok.tolist()
            parents[i] = par.tolist()
            conf[i] = p.astype(np.float32)
        if chains:
            self._draft_chains(chains, tokens, conf)
        return Drafts(tokens, None, conf, parents)

    def proposed(self, ctx: StepContext, drafts: Drafts) -> None:
        """Record each request's tree as sent (the policy may send a subset
        of the drafted nodes, re-laid): the next step's verified rows are
        read against it."""
        if self._tree is None:
            return
        parents = drafts.parents or [None] * len(ctx.requests)
        for r, tok, par in zip(ctx.requests, drafts.tokens, parents):
            if par is None or not tok:
                self._drafted_trees.pop(r.req_id, None)
            else:
                self._drafted_trees[r.req_id] = (np.asarray(tok, np.int64),
                                                 np.asarray(par, np.int64))

    def _walk_buffers(self, rows: int, length: int):
        """The walk's inputs and outputs for ``rows`` requests of drafts up
        to ``length``: allocated once, grown when a step needs more."""
        buf = self._walk
        if buf is None or len(buf[1]) < rows or buf[3].shape[1] < length:
            rows_cap = max(rows, 0 if buf is None else len(buf[1]))
            len_cap = max(length, self.max_draft, 0 if buf is None else buf[3].shape[1])
            order = max(self.tables.context_order, 1)
            buf = self._walk = (
                np.zeros((rows_cap, order), np.int64), np.zeros(rows_cap, np.int64),
                np.zeros(rows_cap, np.int64), np.zeros((rows_cap, len_cap), np.int64),
                np.zeros((rows_cap, len_cap), np.float64), np.zeros(rows_cap, np.int64))
        return (rows,) + buf

    def continue_draft(self, request: RequestStep, prefix, n: int) -> np.ndarray:
        """Up to ``n`` tokens after a draft prefix this proposer did not draft:
        the table walk from the request's context followed by the prefix,
        under the same confidence stop as a draft. Reads the tables only."""
        if n <= 0:
            return np.zeros(0, dtype=np.int64)
        if self.device_chains is not None:
            return self.device_chains.continue_draft(request.context, prefix, int(n))
        order = max(self.tables.context_order, 1)
        tail = np.concatenate([np.asarray(request.context[-order:], np.int64),
                               np.asarray(prefix, np.int64)])[-order:]
        return np.asarray(self.tables.chain(tail, int(n), self.options["min_confidence"])[0],
                          dtype=np.int64)
