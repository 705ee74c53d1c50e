"""The tree goodput policy's per-tree work, compiled.

Each step reads the tree a request sent last step against the tokens the
target emitted (the accepted path, each observed node's outcome), and
prices the tree it offers now (path probabilities, calibrated, capped by
the parent, ranked; the best path), then lays the kept nodes out. As
Python and numpy these were some forty calls per tree on a few dozen
nodes, where dispatch outweighed the arithmetic; each loop here is the
function of ``vllm_plugins.tree.select`` named in its docstring, with the
same values (``tests/test_tree_select.py`` checks them against it).
``TreeGoodputController`` says what the numbers mean.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.array_table import mat, vec
from vllm_plugins.proposers.draft_length.calibration_kernels import _bucket, calibrated_at
from vllm_plugins.proposers.jit import cached_njit

_F64 = np.float64
# The pricing's calibration tables as an ``ArrayTable`` (``price_tree_table``):
# (dtype, dimensions) by row, ``gs`` .. ``cal_e`` then ``edges``, ``s``, ``e``.
PRICE_TABLE = ((_F64, 1), (_F64, 1), (_F64, 2), (_F64, 2), (_F64, 1), (_F64, 1),
               (_F64, 1), (_F64, 1), (_F64, 1))
#: Its scalars, in a float64 vector, by position.
PRICE_SCALARS = ("last_position", "conf_strength", "eps", "strength", "lo", "hi")


@cached_njit
def tree_depths(parents):
    """``tree.draft.depths``: depth per node, root children at 1."""
    n = len(parents)
    out = np.empty(n, np.int64)
    for i in range(n):
        p = parents[i]
        out[i] = 1 if p < 0 else out[p] + 1
    return out


@cached_njit
def well_formed(parents, n):
    """Whether ``parents`` holds ``n`` entries, each -1 or an earlier node."""
    if len(parents) != n:
        return False
    for i in range(n):
        p = parents[i]
        if p < -1 or p >= i:
            return False
    return True


@cached_njit
def price_tree(parents, conf, row, last_position, gs, gn, gps, gpn, cal_s, cal_e,
               conf_strength, eps, calibrate, edges, s, e, strength, lo, hi):
    """(depth, q_raw, q, ranked, best path, q of the ranked nodes, q of the
    path's nodes) of one tree offered to slot row ``row``.

    Each node's conditional acceptance is its confidence ``conf``
    calibrated at its depth (``ConfidenceCalibrator.calibrate_at``: its
    tables, position depth - 1 up to ``last_position``); ``q_raw``:
    ``select.path_probabilities`` of those; ``q``: with ``calibrate``,
    ``q_raw`` times the outcome calibration's factor
    (``OutcomeCalibrator.factor``: bucket ``searchsorted(edges, q_raw)``,
    (s + strength) / (e + strength)), clipped to [lo, hi], then
    ``select.cap_by_parent``; ``ranked``: ``select.rank_nodes``
    (descending q, ties by index); the path ``select.best_path`` takes
    through q."""
    n = len(parents)
    depth = tree_depths(parents)
    cond = calibrated_at(np.full(n, row, np.int64), np.minimum(depth - 1, last_position),
                         conf, gs, gn, gps, gpn, cal_s, cal_e, conf_strength, eps)
    q_raw = np.empty(n, np.float64)
    for i in range(n):
        p = parents[i]
        q_raw[i] = cond[i] if p < 0 else q_raw[p] * cond[i]
    q = np.empty(n, np.float64)
    for i in range(n):
        v = q_raw[i]
        if calibrate:
            b = _bucket(edges, v)
            v = v * ((s[b] + strength) / (e[b] + strength))
            v = min(max(v, lo), hi)
        p = parents[i]
        q[i] = v if p < 0 else min(v, q[p])
    # Stable insertion sort by descending q: ties keep the lower index first.
    ranked = np.empty(n, np.int64)
    for i in range(n):
        j = i
        while j > 0 and q[ranked[j - 1]] < q[i]:
            ranked[j] = ranked[j - 1]
            j -= 1
        ranked[j] = i
    # Best child of each node (index parent + 1; 0 the root): the first of
    # highest q.
    best = np.full(n + 1, -1, np.int64)
    for i in range(n):
        b = best[parents[i] + 1]
        if b < 0 or q[i] > q[b]:
            best[parents[i] + 1] = i
    path = np.empty(n, np.int64)
    k = 0
    node = best[0]
    while node >= 0:
        path[k] = node
        k += 1
        node = best[node + 1]
    path = path[:k]
    return depth, q_raw, q, ranked, path, q[ranked], q[path]


@cached_njit
def price_tree_into(parents, conf, row, last_position, gs, gn, gps, gpn, cal_s, cal_e,
                    conf_strength, eps, calibrate, edges, s, e, strength, lo, hi, i, q,
                    valid, q_chain, valid_chain, lengths_chain):
    """``price_tree`` of the tree of batch row ``i``, its two shapes'
    candidates written straight into that row of the step's matrices (the
    ranked nodes' q into ``q``/``valid``, the best path's into
    ``q_chain``/``valid_chain``/``lengths_chain``). Returns (depth, q_raw,
    ranked, path): boxing the other three arrays and copying them into the
    matrices cost more than the pricing."""
    depth, q_raw, _, ranked, path, q_ranked, q_path = price_tree(
        parents, conf, row, last_position, gs, gn, gps, gpn, cal_s, cal_e, conf_strength,
        eps, calibrate, edges, s, e, strength, lo, hi)
    for j in range(len(q_ranked)):
        q[i, j] = q_ranked[j]
        valid[i, j] = True
    for j in range(len(q_path)):
        q_chain[i, j] = q_path[j]
        valid_chain[i, j] = True
    lengths_chain[i] = len(q_path)
    return depth, q_raw, ranked, path


@cached_njit
def price_tree_table(parents, conf, row, t, x, calibrate, i, q, valid, q_chain, valid_chain,
                     lengths_chain):
    """``price_tree_into`` with the calibrations' tables as a table
    (``PRICE_TABLE``) and their scalars as ``x`` (``PRICE_SCALARS``)."""
    return price_tree_into(
        parents, conf, row, int(x[0]), vec(t, 0, _F64), vec(t, 1, _F64), mat(t, 2, _F64),
        mat(t, 3, _F64), vec(t, 4, _F64), vec(t, 5, _F64), x[1], x[2], calibrate,
        vec(t, 6, _F64), vec(t, 7, _F64), vec(t, 8, _F64), x[3], x[4], x[5], i, q, valid,
        q_chain, valid_chain, lengths_chain)


@cached_njit
def lay_out(parents, nodes):
    """(``select.relaid_parents(parents, nodes)``, whether that is not a
    chain) of nodes closed under ancestors in their order; the relaid list
    is empty where it is not closed (``relaid_parents`` raises there)."""
    k = len(nodes)
    index = np.full(len(parents), -1, np.int64)
    out = np.empty(k, np.int64)
    tree = False
    for j in range(k):
        index[nodes[j]] = j
    for j in range(k):
        p = parents[nodes[j]]
        if p < 0:
            out[j] = -1
        else:
            at = index[p]
            if at < 0 or at >= j:
                return out[:0], True
            out[j] = at
        if out[j] != j - 1:
            tree = True
    return out, tree


@cached_njit
def read_tree(tokens, parents, depth, conf, q_raw, layout, num_draft, emitted):
    """What the target's ``emitted`` tokens (the accepted path's tokens plus
    one) show of a tree sent with ``layout`` (its nodes in the order sent),
    of which the first ``num_draft`` were verified.

    Returns (found, a tree was verified, root child accepted, observed
    nodes, their depth - 1, their confidences, their outcomes, the path
    probabilities of the nodes whose path outcome is known, those
    outcomes). ``found`` is False where the emitted tokens are no path of
    the verified nodes (``select.accepted_path`` None): then nothing else
    is read. The path is the first in layout order that fits; a node whose
    parent is on it (or is the root) is observed
    (``select.node_outcomes``); a node's path outcome is known where it was
    observed or verified: its outcome if observed, else whether it is on
    the path."""
    n = len(parents)
    v = min(num_draft, len(layout))
    # Verified nodes as a tree: whether they form a chain (vLLM's own path).
    verified_tree = False
    if v > 0:
        for j in range(v):
            expect = -1 if j == 0 else layout[j - 1]
            if parents[layout[j]] != expect:
                verified_tree = True
                break
    # Children of each node (index parent + 1) in layout order.
    first = np.full(n + 1, -1, np.int64)
    last = np.full(n + 1, -1, np.int64)
    nxt = np.full(n, -1, np.int64)
    for j in range(v):
        c = layout[j]
        p = parents[c] + 1
        if first[p] < 0:
            first[p] = c
        else:
            nxt[last[p]] = c
        last[p] = c
    m = len(emitted) - 1
    path = np.empty(max(m, 0), np.int64)
    cand = np.empty(max(m, 0) + 1, np.int64)
    found = False
    d = 0
    if m >= 0:
        cand[0] = first[0]
        while True:
            if d == m:
                at = -1 if d == 0 else path[d - 1]
                c = first[at + 1]
                fits = True
                while c >= 0:
                    if tokens[c] == emitted[m]:
                        fits = False
                        break
                    c = nxt[c]
                if fits:
                    found = True
                    break
            else:
                c = cand[d]
                while c >= 0 and tokens[c] != emitted[d]:
                    c = nxt[c]
                if c >= 0:
                    path[d] = c
                    d += 1
                    cand[d] = first[c + 1]
                    continue
            # Back up to the last depth with a sibling left to try.
            d -= 1
            if d < 0:
                break
            cand[d] = nxt[path[d]]
    none_i = np.zeros(0, np.int64)
    none_f = np.zeros(0, np.float64)
    if not found:
        return False, verified_tree, False, none_i, none_i, none_f, none_f, none_f, none_f
    on_path = np.zeros(n + 1, np.bool_)   # index node + 1; 0 the root
    on_path[0] = True
    for j in range(m):
        on_path[path[j] + 1] = True
    verified = np.zeros(n, np.bool_)
    for j in range(v):
        verified[layout[j]] = True
    count = 0
    known = 0
    for i in range(n):
        if on_path[parents[i] + 1]:
            count += 1
            known += 1
        elif verified[i]:
            known += 1
    idx = np.empty(count, np.int64)
    j_idx = np.empty(count, np.int64)
    c_obs = np.empty(count, np.float64)
    outcome = np.empty(count, np.float64)
    q_used = np.empty(known, np.float64)
    q_outcome = np.empty(known, np.float64)
    root_hit = False
    a = 0
    b = 0
    for i in range(n):
        if on_path[parents[i] + 1]:
            hit = tokens[i] == emitted[depth[i] - 1]
            if hit and depth[i] == 1:
                root_hit = True
            idx[a] = i
            j_idx[a] = depth[i] - 1
            c_obs[a] = conf[i]
            outcome[a] = 1.0 if hit else 0.0
            a += 1
            q_used[b] = q_raw[i]
            q_outcome[b] = 1.0 if hit else 0.0
            b += 1
        elif verified[i]:
            q_used[b] = q_raw[i]
            q_outcome[b] = 1.0 if on_path[i + 1] else 0.0
            b += 1
    return True, verified_tree, root_hit, idx, j_idx, c_obs, outcome, q_used, q_outcome


def warm_up() -> None:
    """Compile (or load from numba's cache) each loop on a toy tree, so that
    an engine's first tree step does not wait for the JIT."""
    parents = np.array([-1, -1, 0], np.int64)
    tokens = np.array([5, 6, 7], np.int64)
    edges = np.array([0.5])
    well_formed(parents, 3)
    tables = (np.zeros(4), np.zeros(4), np.zeros((2, 4)), np.zeros((2, 4)), np.zeros(1),
              np.zeros(1), 2.0, 1e-3)
    for calibrate in (False, True):
        depth, q_raw, _, ranked, _, _, _ = price_tree(
            parents, np.full(3, 0.5), 0, 1, *tables, calibrate, edges, np.zeros(2),
            np.zeros(2), 2.0, 1e-3, 1.0 - 1e-3)
    q = np.zeros((1, 3))
    valid = np.zeros((1, 3), np.bool_)
    price_tree_into(parents, np.full(3, 0.5), 0, 1, *tables, False, edges, np.zeros(2),
                    np.zeros(2), 2.0, 1e-3, 1.0 - 1e-3, 0, q, valid, q.copy(), valid.copy(),
                    np.zeros(1, np.int64))
    lay_out(parents, ranked)
    read_tree(tokens, parents, depth, np.full(3, 0.5), q_raw, ranked, 3,
              np.array([5, 7, 1], np.int64))
