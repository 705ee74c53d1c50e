"""The merge's compiled halves for a whole step (``merge.Merger``'s
``merge_step`` and ``outcomes_step``): every request's source trees checked
and merged in one call, and every request's merged tree read against what
the target emitted in one call, over buffers the merger keeps."""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.array_table import mat, vec
from vllm_plugins.proposers.jit import cached_njit
from vllm_plugins.proposers.sources.base import valid_tree
from vllm_plugins.proposers.sources.calibrate import _learn as learn_calibration
from vllm_plugins.proposers.sources.trie import _merge, best_chain, outcomes


@cached_njit
def merge_step(tok, par, raw, vocab, meta, n_trees, cal_s, cal_n, cal_sd, cal_nd, strength,
                c_tok, c_par, c_raw, c_src, c_seg, local_depth, m_map, m_tok, m_par, m_cond,
                m_mask, m_depth, m_q, first_child, next_sibling, m_raw, new_index, order, out_tok,
                out_par, out_cond, out_mask, out_depth, out_q, out_raw, chain_idx, chain_tok,
                chain_cond, draft_cond, res, status_given, node_count):
    """A step's merge. ``meta`` holds, for the ``n_trees`` source trees and
    the R requests: ``g_off`` (tree g holds candidates ``g_off[g]:g_off[g+1]``),
    ``g_src`` (its source), ``r_off`` (request r holds trees
    ``r_off[r]:r_off[r+1]``), each request's budget and whether it wants a
    chain, one after another (``step_meta``). ``vocab``: token ids from it
    on break the contract (-1: unknown). ``res`` holds status (per tree),
    then out_start, out_n and chain_n (per request); its status is zeroed
    first unless ``status_given``. ``status[g]`` <- 0 for a tree that keeps
    the contract (``valid_tree``; 3: more nodes than the
    budget), and only those are merged (a tree whose status comes in
    nonzero is skipped as it is). Request r's merged nodes go to
    ``out_*[out_start[r]:][:out_n[r]]``; where it wants a chain, its best
    chain's tokens and estimates to ``chain_*[out_start[r]:][:chain_n[r]]``.
    ``node_count[s]`` += the merged nodes source s proposed; ``draft_cond``'s
    rows <- the merged nodes' and the chains' estimates in float32. Returns
    the number of merged nodes."""
    n_req = (len(meta) - 2 * n_trees - 2) // 3
    g_off = meta[:n_trees + 1]
    g_src = meta[n_trees + 1:2 * n_trees + 1]
    r_off = meta[2 * n_trees + 1:2 * n_trees + 2 + n_req]
    budget = meta[2 * n_trees + 2 + n_req:2 * n_trees + 2 + 2 * n_req]
    want_chain = meta[2 * n_trees + 2 + 2 * n_req:]
    status = res[:n_trees]
    out_start = res[n_trees:n_trees + n_req]
    out_n = res[n_trees + n_req:n_trees + 2 * n_req]
    chain_n = res[n_trees + 2 * n_req:n_trees + 3 * n_req]
    if not status_given:
        status[:] = 0
    n_src = m_raw.shape[1]
    at = 0
    for r in range(n_req):
        n_c = 0
        for g in range(r_off[r], r_off[r + 1]):
            if status[g] != 0:
                continue
            lo, hi = g_off[g], g_off[g + 1]
            st = valid_tree(tok[lo:hi], par[lo:hi], raw[lo:hi], vocab)
            if st == 0 and hi - lo > budget[r]:
                st = 3
            status[g] = st
            if st != 0:
                continue
            base = n_c
            for i in range(lo, hi):
                c_tok[n_c] = tok[i]
                c_par[n_c] = par[i]
                c_raw[n_c] = raw[i]
                c_src[n_c] = g_src[g]
                c_seg[n_c] = base
                n_c += 1
        out_start[r] = at
        k = 0
        if n_c > 0:
            k = _merge(c_tok[:n_c], c_par[:n_c], c_seg[:n_c], c_src[:n_c], c_raw[:n_c],
                       budget[r], cal_s, cal_n, cal_sd, cal_nd, strength, local_depth, m_map,
                       m_tok, m_par, m_cond, m_mask, m_depth, m_q, first_child, next_sibling,
                       m_raw, new_index, order, out_tok[at:], out_par[at:], out_cond[at:],
                       out_mask[at:], out_depth[at:], out_q[at:], out_raw[at:])
        out_n[r] = k
        chain_n[r] = 0
        if k > 0 and want_chain[r] != 0:
            m = best_chain(out_par[at:at + k], out_q[at:at + k], chain_idx)
            for j in range(m):
                chain_tok[at + j] = out_tok[at + chain_idx[j]]
                chain_cond[at + j] = out_cond[at + chain_idx[j]]
                draft_cond[1, at + j] = chain_cond[at + j]
            chain_n[r] = m
        for j in range(at, at + k):
            draft_cond[0, j] = out_cond[j]
            for s in range(n_src):
                if (out_mask[j] >> s) & 1:
                    node_count[s] += 1
        at += k
    return at


_I64, _F64 = np.int64, np.float64
# ``merge.MergeBuffers`` as an ``ArrayTable``, (dtype, dimensions) by row, in
# ``merge_step``'s order of them (``c_tok`` .. ``draft_cond``).
MERGE_TABLE = (
    *((_I64, 1),) * 2, (_F64, 1), *((_I64, 1),) * 2,        # c_tok, c_par, c_raw, c_src, c_seg
    *((_I64, 1),) * 4, (_F64, 1), (_I64, 1), (_I64, 1),     # local_depth .. m_depth
    (_F64, 1), (_I64, 1), (_I64, 1), (_F64, 2), (_I64, 1),  # m_q .. new_index
    (_I64, 1), (_I64, 1), (_I64, 1), (_F64, 1), (_I64, 1),  # order .. out_mask
    (_I64, 1), (_F64, 1), (_F64, 2), (_I64, 1), (_I64, 1),  # out_depth .. chain_tok
    (_F64, 1), (np.float32, 2),                             # chain_cond, draft_cond
)


@cached_njit
def merge_step_table(tok, par, raw, vocab, meta, n_trees, cal_s, cal_n, cal_sd, cal_nd,
                     strength, t, res, status_given, node_count):
    """``merge_step`` with the merger's buffers as a table (``MERGE_TABLE``)."""
    return merge_step(
        tok, par, raw, vocab, meta, n_trees, cal_s, cal_n, cal_sd, cal_nd, strength,
        vec(t, 0, _I64), vec(t, 1, _I64), vec(t, 2, _F64), vec(t, 3, _I64), vec(t, 4, _I64),
        vec(t, 5, _I64), vec(t, 6, _I64), vec(t, 7, _I64), vec(t, 8, _I64), vec(t, 9, _F64),
        vec(t, 10, _I64), vec(t, 11, _I64), vec(t, 12, _F64), vec(t, 13, _I64),
        vec(t, 14, _I64), mat(t, 15, _F64), vec(t, 16, _I64), vec(t, 17, _I64),
        vec(t, 18, _I64), vec(t, 19, _I64), vec(t, 20, _F64), vec(t, 21, _I64),
        vec(t, 22, _I64), vec(t, 23, _F64), mat(t, 24, _F64), vec(t, 25, _I64),
        vec(t, 26, _I64), vec(t, 27, _F64), mat(t, 28, np.float32), res, status_given,
        node_count)


@cached_njit
def outcomes_step(ints, raw, meta, emitted, observed, accepted, path, out_int, out_float,
                   src_accepted, src_alone, row_alone, learn, decay, cal_s, cal_n, cal_sd,
                   cal_nd):
    """``outcomes`` of each request's merged tree against its emitted tokens.
    ``ints``: a ``StepTrees``' rows (tokens, parents, chains' tokens, source
    bits, depths);
    ``meta``: per request its first node, its node count, then the offsets
    of its emitted tokens (request r's: ``emitted[e_off[r]:e_off[r+1]]``).
    Writes one calibration entry per (observed node, source that proposed
    it), nodes in order, then sources: the source and the node's depth to
    ``out_int``'s rows, the source's own estimate and 1.0 if accepted to
    ``out_float``'s. Counts each accepted node to every source that proposed
    it (``src_accepted``) and to the one source where only one did
    (``src_alone``, and ``row_alone[r]`` per request, zeroed first: what
    each source brought each request). With ``learn``, the entries go into
    the calibration's counts (``SourceCalibrator.learn``). Returns the
    number of entries."""
    n_req = (len(meta) - 1) // 3
    start, n, e_off = meta[:n_req], meta[n_req:2 * n_req], meta[2 * n_req:]
    tok, par, mask, depth = ints[0], ints[1], ints[3], ints[4]
    n_src = raw.shape[1]
    c = 0
    for r in range(n_req):
        for q in range(n_src):
            row_alone[r, q] = 0
        s, k = start[r], n[r]
        m = outcomes(tok[s:s + k], par[s:s + k], depth[s:s + k],
                     emitted[e_off[r]:e_off[r + 1]], observed[:k], accepted[:k], path[:k])
        for v in range(k):
            if not observed[v]:
                continue
            for q in range(n_src):
                x = raw[s + v, q]
                if not np.isnan(x):
                    out_int[0, c] = q
                    out_int[1, c] = depth[s + v]
                    out_float[0, c] = x
                    out_float[1, c] = 1.0 if accepted[v] else 0.0
                    c += 1
        for j in range(m):
            bits = mask[s + path[j]]
            count, last = 0, -1
            for q in range(n_src):
                if (bits >> q) & 1:
                    src_accepted[q] += 1
                    count += 1
                    last = q
            if count == 1:
                src_alone[last] += 1
                row_alone[r, last] += 1
    if learn and c > 0:
        learn_calibration(out_int[0, :c], out_int[1, :c], out_float[0, :c], out_float[1, :c],
                          decay, cal_s, cal_n, cal_sd, cal_nd)
    return c
