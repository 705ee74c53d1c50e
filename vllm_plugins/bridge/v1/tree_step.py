"""Tree verification inside vLLM's V1 runner: one target forward checks
every request's draft tree.

vLLM schedules and verifies drafts as chains. A proposer that returns a
tree (``Drafts.parents``) hands vLLM its nodes as ordinary draft tokens in
topological order; the scheduler may cut a prefix, which is still a tree.
The next step (speculation through ``custom_class`` runs without async
scheduling, so drafts are verified in the very next step) is a tree step for
each request whose scheduled drafts are a prefix of the tree we recorded:

1. ``plan`` (after vLLM's ``_prepare_inputs``): vLLM's slots stay by node
   index (its slot mapping from positions ``num_computed + i`` already gives
   every node a slot of its own); the rotary positions the model reads are
   rewritten to ``num_computed + depth`` (the root, the request's last
   committed token, at depth 0). The runner's forward puts the attention
   wrapper on its layers for that forward only, each layer's bound to the
   runner's state, which holds the plan.
2. ``attend`` (in place of vLLM's attention of each layer): the rows of
   tree requests come from ``kernels.tree_attention`` (each node sees the
   committed prefix, its ancestors and itself), the other requests' from
   vLLM's own forward over them alone, so no row is computed twice. vLLM
   already wrote every node's K/V at its slot.
3. ``accept`` (after vLLM's sampler): a tree request's row of the sampler's
   output is replaced by the tree's accepted path plus one token
   (``vllm_plugins.tree.acceptance``), then the accepted nodes' K/V move
   into the slots a chain would have used (``kernels.kv_move``), so the
   scheduler's computed-token count, the cache contents and the prefix
   cache's block hashes (of token ids) are plain decoding's.

Requests the tree path cannot serve take chains
(``vllm_plugins.tree.sampling.tree_allowed``): the
bridge cuts their draft to its longest chain prefix before vLLM sees it.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from vllm_plugins.kernels.cache_layout import cpu_cache_views, layout_refusal
from vllm_plugins.kernels.kv_move import (HostLayers, host_elements, host_layout, move_kv_host,
                                         move_kv_layers)
from vllm_plugins.kernels.tree_attention import (TreeAttentionPlan, request_attention,
                                                 tree_attention_planned)
from vllm_plugins.tree import acceptance
from vllm_plugins.tree.draft import ancestor_mask_numpy, chain_length, depths, validate
from vllm_plugins.tree.sampling import is_greedy, tree_allowed

logger = logging.getLogger(__name__)

# vllm.v1.sample.rejection_sampler.PLACEHOLDER_TOKEN_ID: the padding of the
# rejection sampler's [requests, max_spec_len + 1] output.
PLACEHOLDER_TOKEN_ID = -1


# ------------------------------------------------------------ which requests

@dataclass
class ProposedTree:
    """What the bridge handed vLLM for one request: a tree's nodes (and
    the proposer's probability rows, one per node, or None)."""

    tokens: list[int]
    parents: list[int]
    probs: np.ndarray | None


def record_drafts(trees: dict, req_ids, drafts, params_of, capable: bool
                  ) -> tuple[list[list[int]], list | None]:
    """The drafts vLLM gets, and each tree request's tree into ``trees``.

    A request whose tree the step cannot verify (``tree_allowed`` false, or
    a runner that cannot serve trees) keeps its longest chain prefix: as a
    chain vLLM verifies it exactly, probability rows included (each chain
    node was drawn at its predecessor)."""
    tokens = [list(map(int, t)) for t in drafts.tokens]
    probs = list(drafts.probs) if drafts.probs is not None else None
    parents_all = getattr(drafts, "parents", None)
    for i, req_id in enumerate(req_ids):
        parents = parents_all[i] if parents_all is not None and i < len(parents_all) else None
        trees.pop(req_id, None)
        if parents is None or i >= len(tokens):
            continue
        parents = [int(p) for p in parents[:len(tokens[i])]]
        keep = chain_length(parents)
        if keep == len(parents):
            continue  # a chain: vLLM's own verification
        if capable and tree_allowed(params_of(req_id)) and _valid(req_id, parents):
            p = probs[i] if probs is not None else None
            trees[req_id] = ProposedTree(tokens[i], parents,
                                         None if p is None else np.asarray(p))
            continue
        tokens[i] = tokens[i][:keep]
        if probs is not None and probs[i] is not None:
            probs[i] = probs[i][:keep]
    return tokens, probs


def _valid(req_id, parents) -> bool:
    try:
        validate(parents)
        return True
    except ValueError:
        logger.warning("request %s: a draft tree with bad parents goes out as its "
                       "chain prefix", req_id, exc_info=True)
        return False


# ---------------------------------------------------------------- the plan

@dataclass
class TreeRequest:
    batch_index: int
    req_id: str
    tokens: list[int]
    parents: list[int]
    probs: np.ndarray | None
    num_computed: int
    query_start: int  # the request's first token row in the step
    slots: np.ndarray  # KV slot of each of its step tokens (root first)


@dataclass
class TreeStep:
    """One step's tree requests, and what attention needs of them."""

    requests: list[TreeRequest]
    mask: np.ndarray  # [tree tokens, max query len] bool
    num_tokens: int  # tokens of the whole step (attention's sanity check)
    # id(attention metadata) -> StepAttention, planned at a group's first layer
    attention: dict = field(default_factory=dict)
    # Each layer's cache views (``cache_views_of``): the runner's, which
    # outlive the step (a cache tensor lives as long as the engine).
    cache_views: dict = field(default_factory=dict)


def step_mask(parents_list, query_lens) -> np.ndarray:
    """bool [sum(query_lens), max(query_lens)]: row t says which of its own
    request's step tokens token t may see. A request with parents None is
    causal (a chain, or a prompt chunk); a tree request's query is its root
    and its nodes."""
    for parents, q in zip(parents_list, query_lens):
        if parents is not None and len(parents) + 1 != int(q):
            raise ValueError(f"a tree of {len(parents)} nodes needs {len(parents) + 1} "
                             f"query tokens, got {int(q)}")
    if len(parents_list) == 1 and parents_list[0] is not None:
        return ancestor_mask_numpy(parents_list[0])   # the common step: one tree, one array
    total = int(sum(query_lens))
    width = int(max(query_lens)) if len(query_lens) else 0
    mask = np.zeros((total, width), dtype=bool)
    start = 0
    for parents, q in zip(parents_list, query_lens):
        q = int(q)
        if parents is None:
            mask[start:start + q, :q] = np.tri(q, dtype=bool)
        else:
            mask[start:start + q, :q] = ancestor_mask_numpy(parents)
        start += q
    return mask


def plan(trees: dict, req_ids, num_scheduled, num_computed, scheduled_drafts,
         slot_mapping) -> TreeStep | None:
    """The step's tree requests: those whose scheduled drafts (vLLM's
    ``scheduled_spec_decode_tokens``) are a prefix of a recorded tree and
    that are not a chain after the scheduler's cut."""
    out = []
    start = 0
    total = int(sum(int(n) for n in num_scheduled))
    for b, req_id in enumerate(req_ids):
        q = int(num_scheduled[b])
        tree = trees.get(req_id)
        drafts = scheduled_drafts.get(req_id) if tree is not None else None
        if drafts and q == len(drafts) + 1:
            n = len(drafts)
            if (n <= len(tree.tokens) and list(map(int, drafts)) == tree.tokens[:n]
                    and chain_length(tree.parents[:n]) < n):
                out.append(TreeRequest(
                    batch_index=b, req_id=req_id, tokens=tree.tokens[:n],
                    parents=tree.parents[:n],
                    probs=None if tree.probs is None else tree.probs[:n],
                    num_computed=int(num_computed[b]), query_start=start,
                    slots=np.asarray(slot_mapping[start:start + q], dtype=np.int64)))
        start += q
    if not out:
        return None
    lens = [len(r.tokens) + 1 for r in out]
    return TreeStep(
        requests=out,
        mask=step_mask([r.parents for r in out], lens),
        num_tokens=total,
    )


def depth_positions(step: TreeStep, positions: torch.Tensor) -> None:
    """Rotary positions by depth: token k of a tree request (0 the root,
    i + 1 node i) reads position num_computed + depth (root 0)."""
    rows, values = [], []
    for r in step.requests:
        d = [0] + depths(r.parents)
        rows.extend(range(r.query_start, r.query_start + len(d)))
        values.extend(r.num_computed + x for x in d)
    if positions.is_cpu:   # one numpy write: each torch call costs more after a forward
        positions.numpy()[rows] = values
        return
    idx = torch.tensor(rows, dtype=torch.int64, device=positions.device)
    positions[idx] = torch.tensor(values, dtype=positions.dtype, device=positions.device)


# --------------------------------------------------------------- attention

@dataclass
class StepAttention:
    """How one step's layers attend, planned at the first layer of an
    attention group (its metadata object is shared by the group's layers):
    tree requests by ``kernels.tree_attention`` on a per-step plan, and the
    other requests by vLLM's own op over them alone, so no row is computed
    twice."""

    tree: object                       # kernels.tree_attention.TreeAttentionPlan
    other_rows: torch.Tensor | None    # the other requests' token rows, int64
    other_metadata: object | None      # vLLM's metadata for those requests alone
    vllm_all: bool = False             # vLLM's op over every row (it cannot be cut)


def plan_attention(step: TreeStep, impl, layer, attn_metadata, block_size: int,
                   dtype) -> StepAttention:
    """The step's attention for one group's layers. vLLM's op is cut to the
    other requests only when its metadata is plain causal; otherwise it runs
    over every row and tree rows are overwritten (exact, at twice their
    cost)."""
    group = impl.num_heads // impl.num_kv_heads
    tree_plan = TreeAttentionPlan([])
    packed = 0
    seq_lens = attn_metadata.seq_lens.tolist()
    for r in step.requests:
        q = len(r.tokens) + 1
        tree_plan.requests.append(request_attention(
            r.query_start, seq_lens[r.batch_index],
            attn_metadata.block_table[r.batch_index],
            step.mask[packed:packed + q, :q], block_size, group))
        packed += q
    tree_batch = {r.batch_index for r in step.requests}
    others = [b for b in range(len(seq_lens)) if b not in tree_batch]
    if not others:
        return StepAttention(tree_plan, None, None)
    if getattr(attn_metadata, "dynamic_causal", None) is not None \
            or attn_metadata.causal is not True:
        return StepAttention(tree_plan, None, None, vllm_all=True)
    rows, metadata = subset_metadata(attn_metadata, others, impl, layer, dtype)
    return StepAttention(tree_plan, rows, metadata)


def subset_metadata(attn_metadata, keep: list[int], impl, layer, dtype):
    """(token rows, metadata) for vLLM's CPU attention over the requests
    ``keep`` alone: CPUAttentionMetadata with their query starts, sequence
    lengths and block table rows, and the scheduler metadata that
    CPUAttentionMetadataBuilder.build would give them (vllm._custom_ops.
    cpu_attn_get_scheduler_metadata with the builder's arguments)."""
    import dataclasses

    from vllm import _custom_ops as ops
    from vllm import envs

    starts = attn_metadata.query_start_loc.tolist()
    lens = [starts[b + 1] - starts[b] for b in keep]
    rows = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in keep])
    qsl = torch.zeros(len(keep) + 1, dtype=attn_metadata.query_start_loc.dtype)
    qsl[1:] = torch.tensor(np.cumsum(lens))
    index = torch.tensor(keep, dtype=torch.int64)
    seq_lens = attn_metadata.seq_lens.index_select(0, index)
    scheduler_metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=len(keep), num_heads=impl.num_heads, num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl,
        causal=True, sliding_window_size=-1, isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV, dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype)
    metadata = dataclasses.replace(
        attn_metadata, num_actual_tokens=int(rows.numel()), max_query_len=max(lens),
        query_start_loc=qsl, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=attn_metadata.block_table.index_select(0, index),
        scheduler_metadata=scheduler_metadata)
    return rows, metadata


def attend(step: TreeStep, impl, layer, query: torch.Tensor, key, value,
           kv_cache: torch.Tensor, attn_metadata, output: torch.Tensor, vllm_forward,
           args: tuple = (), kwargs: dict | None = None) -> None:
    """One layer of a tree step (query, output: [tokens, heads, head]):
    tree requests' rows by ancestry over the paged cache vLLM just wrote,
    the other requests' rows by ``vllm_forward`` (vLLM's
    ``CPUAttentionBackendImpl.forward``, called as vLLM calls it, with the
    layer call's own ``key``, ``value``, ``args`` and ``kwargs``) over them
    alone."""
    if attn_metadata.num_actual_tokens != step.num_tokens:
        raise RuntimeError(f"tree step planned for {step.num_tokens} tokens, attention "
                           f"runs {attn_metadata.num_actual_tokens}")
    planned = step.attention.get(id(attn_metadata))
    if planned is None:
        # kv_cache: [num_blocks, kv_heads, block_size, 2 * head_size]
        planned = plan_attention(step, impl, layer, attn_metadata, kv_cache.shape[2],
                                 query.dtype)
        step.attention[id(attn_metadata)] = planned
    if planned.vllm_all:
        vllm_forward(impl, layer, query, key, value, kv_cache, attn_metadata, output,
                     *args, **(kwargs or {}))
    elif planned.other_rows is not None:
        rows = planned.other_rows
        part = output.new_empty((rows.numel(), *output.shape[1:]))
        vllm_forward(impl, layer, query.index_select(0, rows), key, value, kv_cache,
                     planned.other_metadata, part, *args, **(kwargs or {}))
        output.index_copy_(0, rows, part)
    layer_views = cache_views_of(step.cache_views, kv_cache)
    tree_attention_planned(query, layer_views.key, layer_views.value, planned.tree, impl.scale,
                           output)


class CacheViews(NamedTuple):
    """A layer's CPU cache as attention and the K/V move read it; in this
    order it is what ``kernels.kv_move.move_kv_host`` takes per layer."""

    cache: torch.Tensor
    key: torch.Tensor        # ``cpu_cache_views``
    value: torch.Tensor
    elements: object         # ``host_elements``: a numpy array, or None
    layout: tuple            # ``host_layout``


def cache_views_of(views: dict, kv_cache: torch.Tensor) -> CacheViews:
    """A layer's ``CacheViews``, made at its first use and kept in ``views``
    by the tensor's id (the entry holds the tensor, so the id stays its
    own)."""
    got = views.get(id(kv_cache))
    if got is None or got.cache is not kv_cache:
        key, value = cpu_cache_views(kv_cache)
        got = views[id(kv_cache)] = CacheViews(kv_cache, key, value, host_elements(kv_cache),
                                               host_layout(kv_cache, key, value))
    return got


def unsupported_attention(impl) -> str | None:
    """Why an attention layer cannot serve tree steps, or None."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    if not isinstance(impl, CPUAttentionBackendImpl):
        return (f"tree drafts are verified on vLLM's CPU attention backend only; this "
                f"engine attends with {type(impl).__name__}")
    if getattr(impl, "attn_type", "decoder") != "decoder":
        return None  # encoder layers never see drafts
    if impl.sliding_window not in (-1, None) or impl.alibi_slopes is not None \
            or impl.logits_soft_cap or impl.sinks is not None:
        return "tree drafts need plain attention (no sliding window, ALiBi, soft cap or sinks)"
    if impl.kv_cache_dtype not in ("auto", None):
        return f"tree drafts need an unquantised KV cache (kv_cache_dtype={impl.kv_cache_dtype})"
    return None


def attention_tree_refusal(model, isa_of=None) -> str | None:
    """Why this model's attention layers cannot serve tree steps, or None. The CPU
    backend sets each layer's kernel ISA (``layer.isa``, which decides the
    K/V layout: ``kernels.cache_layout.layout_refusal``) once the cache
    exists; before that, ``isa_of(impl)`` predicts it."""
    for module in model.modules():
        impl = getattr(module, "impl", None)
        if impl is not None and hasattr(impl, "do_kv_cache_update"):
            why = unsupported_attention(impl)
            if why:
                return why
            isa = getattr(module, "isa", None)
            if isa is None and isa_of is not None and \
                    getattr(impl, "attn_type", "decoder") == "decoder":
                isa = isa_of(impl)
            why = None if isa is None else layout_refusal(isa)
            if why:
                return why
    return None


# -------------------------------------------------------------- acceptance

def request_rows(step: TreeStep, num_draft) -> list[int]:
    """First logits row of each tree request: vLLM's sampler input holds
    num_draft + 1 rows per request in batch order."""
    offsets = list(itertools.accumulate((int(n) + 1 for n in num_draft), initial=0))
    out = []
    for r in step.requests:
        if int(num_draft[r.batch_index]) != len(r.tokens):
            raise RuntimeError(f"request {r.req_id}: vLLM verifies "
                               f"{int(num_draft[r.batch_index])} drafts, the tree has "
                               f"{len(r.tokens)} nodes")
        out.append(int(offsets[r.batch_index]))
    return out


def stash_top1(ids: np.ndarray | None, logprobs: np.ndarray | None, starts: list[int],
               step: TreeStep) -> list[list[int] | None]:
    """Per tree request, the argmax of each of its rows read from the step's
    top-k stash (``ids``/``logprobs`` over every logits row, taken where
    ``topk.first_is_argmax`` held), as a list, or None where a row's top-1
    log-probability is not finite: that request's rows are read whole. The
    stash's first column is read once, as lists: a few numpy calls per
    request cost more than the step's rows in Python."""
    if ids is None:
        return [None] * len(step.requests)
    top1, first_lps = ids[:, 0].tolist(), logprobs[:, 0].tolist()
    out = []
    for s, r in zip(starts, step.requests):
        stop = s + len(r.tokens) + 1
        finite = all(map(math.isfinite, first_lps[s:stop]))
        out.append(top1[s:stop] if finite else None)
    return out


def accept(step: TreeStep, params, tree_logits: torch.Tensor, num_draft_all,
           sampling_metadata, top1: list | None = None) -> list:
    """Each tree request's accepted path and emitted tokens
    (``vllm_plugins.tree.acceptance.TreeAcceptance``), in ``step`` order.

    ``tree_logits``: the target's rows of the tree requests only, packed
    (root row, then one per node), taken before vLLM's sampler ran, in the
    logits' dtype (read in float32 here). Greedy requests take the argmax,
    as vLLM's greedy sampler does on requests without logits processors
    (``tree_allowed``); sampled ones sample from
    vLLM's own processing of those rows (temperature, top-k, top-p:
    ``apply_sampling_constraints``), each seeded request with its own
    generator (``sampling_metadata.generators``, keyed by batch index).
    ``top1`` (``stash_top1``): greedy rows' argmax where the top-k stash
    holds it, which saves a pass over the vocabulary."""
    reqs = step.requests
    starts = acceptance.row_starts([r.tokens for r in reqs])
    out: list = [None] * len(reqs)
    greedy = [i for i, p in enumerate(params) if is_greedy(p)]
    sampled = [i for i in range(len(reqs)) if i not in set(greedy)]

    def rows(i):
        return tree_logits[starts[i]:starts[i] + len(reqs[i].tokens) + 1]

    if greedy:
        argmax = []
        for i in greedy:
            argmax += (acceptance.first_argmax(rows(i)).tolist()
                       if top1 is None or top1[i] is None else top1[i])
        got = acceptance.greedy_accept(
            [reqs[i].parents for i in greedy], [reqs[i].tokens for i in greedy], argmax)
        for i, a in zip(greedy, got):
            out[i] = a
    if sampled:
        from vllm.v1.sample.rejection_sampler import apply_sampling_constraints

        # vLLM's processing expands per-request parameters over rows with
        # cumulative counts in batch order: ours, 0 for every other request.
        counts = np.zeros(len(num_draft_all), dtype=np.int64)
        for i in sampled:
            counts[reqs[i].batch_index] = len(reqs[i].tokens) + 1
        device = tree_logits.device
        packed = torch.cat([rows(i) for i in sampled]).to(torch.float32).clone()
        processed = apply_sampling_constraints(
            packed, torch.from_numpy(np.cumsum(counts)).to(torch.int32).to(device),
            sampling_metadata)
        probs = torch.softmax(processed, dim=-1)
        generators = sampling_metadata.generators or {}
        got = acceptance.sample_accept_with_probs(
            [reqs[i].parents for i in sampled], [reqs[i].tokens for i in sampled], probs,
            [reqs[i].probs for i in sampled],
            [generators.get(reqs[i].batch_index) for i in sampled])
        for i, a in zip(sampled, got):
            out[i] = a
    return out


def trees_output(step: TreeStep, results, num_reqs: int, max_spec_len: int, device):
    """vLLM's sampler output for a step of tree requests only: the rejection
    sampler's [requests, max_spec_len + 1] int32 token rows (the emitted
    tokens, then padding), made in one call, and no logprobs."""
    from vllm.v1.outputs import SamplerOutput

    width = max_spec_len + 1
    rows = [[PLACEHOLDER_TOKEN_ID] * width for _ in range(num_reqs)]
    for r, row in zip(step.requests, output_rows(step, results, width)):
        rows[r.batch_index] = row
    return SamplerOutput(sampled_token_ids=torch.tensor(rows, dtype=torch.int32, device=device),
                         logprobs_tensors=None)


def write_output(sampled_token_ids: torch.Tensor, step: TreeStep, results) -> None:
    """Tree requests' rows of vLLM's [requests, max_spec_len + 1] output,
    all in one write."""
    rows = output_rows(step, results, sampled_token_ids.shape[1])
    sampled_token_ids[[r.batch_index for r in step.requests]] = torch.tensor(
        rows, dtype=sampled_token_ids.dtype, device=sampled_token_ids.device)


def output_rows(step: TreeStep, results, width: int) -> list[list[int]]:
    """Each tree request's output row: its emitted tokens, then padding."""
    out = []
    for r, a in zip(step.requests, results):
        if len(a.tokens) > width:
            raise RuntimeError(f"request {r.req_id}: {len(a.tokens)} tokens emitted, "
                               f"vLLM's output holds {width}")
        out.append([*a.tokens, *[PLACEHOLDER_TOKEN_ID] * (width - len(a.tokens))])
    return out


def kv_moves(request: TreeRequest, path) -> tuple[list[int], list[int]]:
    """(source, destination) slots that put the accepted path where a chain
    puts it: node path[j] (step token 1 + path[j]) -> step token j + 1."""
    src, dst = [], []
    for j, node in enumerate(path):
        if int(node) != j:
            src.append(int(request.slots[1 + int(node)]))
            dst.append(int(request.slots[1 + j]))
    return src, dst


def move_accepted_kv(kv_caches, src: list[int], dst: list[int],
                     views: dict | None = None) -> None:
    """Every attention layer's K/V from src slots to dst slots (CPU layout),
    all layers in one call (``move_kv_layers``: one pair of launches on a
    GPU; host caches as moves of their memory, ``move_kv_host``, its layers
    prepared once and kept). ``views``: the runner's kept cache views
    (``cache_views_of``)."""
    if not src:
        return
    if views is None:
        views = {}
    layers, host = host_layers_of(views, kv_caches)
    if host is not None:
        move_kv_host(host, src, dst)
        return
    keys = [layer.key for layer in layers]
    values = [layer.value for layer in layers]
    if keys:
        device = keys[0].device
        move_kv_layers(keys, values, torch.tensor(src, dtype=torch.int64, device=device),
                       torch.tensor(dst, dtype=torch.int64, device=device))


def host_layers_of(views: dict, kv_caches) -> tuple[list, HostLayers | None]:
    """(each distinct cache's ``CacheViews``, in order; their ``HostLayers``,
    None where a cache's memory cannot be moved on the host), made once for
    the runner's list of caches and kept in ``views`` with that list's
    tensors, so a list whose tensors changed is prepared again."""
    caches = tuple(kv_caches)
    got = views.get(_HOST_LAYERS)
    if got is not None and len(got[0]) == len(caches) \
            and all(a is b for a, b in zip(got[0], caches)):
        return got[1], got[2]
    seen = set()
    layers = []
    for cache in caches:
        if cache is None or cache.data_ptr() in seen:
            continue  # layers sharing one cache move it once
        seen.add(cache.data_ptr())
        layers.append(cache_views_of(views, cache))
    host = (HostLayers(layers) if layers and all(layer.elements is not None
                                                 for layer in layers) else None)
    views[_HOST_LAYERS] = (caches, layers, host)
    return layers, host


def warm_up_kv_move(kv_caches, views: dict) -> None:
    """Prepare (``host_layers_of``) and compile the host move of these
    caches, before the runner's first tree step."""
    _, host = host_layers_of(views, kv_caches)
    if host is not None:
        host.warm_up()


# ``views``' key for ``host_layers_of`` (the others are tensors' ids).
_HOST_LAYERS = "host_layers"
