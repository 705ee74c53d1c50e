"""The estimating controllers' per-step bookkeeping, compiled.

Around the estimator and the calibrations, each step reads what the last
one verified (its cut draft, its probes), bounds each request's draft,
probes and remembers what the next step will be read against, and counts
its decisions. As numpy these were some fifty array calls a step over a
handful of rows, where dispatch (twice as dear with the caches cold after
a forward) outweighed the arithmetic. These loops do the same over the
slot arrays in place; ``EstimatingController`` says what the numbers mean.

The per-step entry points take their state as flat arguments, not tuples:
numba types a tuple argument element by element on every call, about twice
as slowly as the same values passed one by one, and these run every step.
The controller calls the learning through ``learn_step_table`` and
``learn_bound_step_table``, whose state arrays come as one
``ArrayTable`` (``proposers/array_table.py``): thirty-odd arrays cost a
cold call more to enter than the learning costs to run.
"""

from __future__ import annotations

import numpy as np

from vllm_plugins.proposers.draft_length.calibration_kernels import (learn_kept, learn_prefix,
                                                                    remember_kept,
                                                                    remember_prefix)
from vllm_plugins.proposers.array_table import mat, vec
from vllm_plugins.proposers.draft_length.estimator_kernels import learn_rows, probs_rows
from vllm_plugins.proposers.jit import cached_njit

_I64, _F64 = np.int64, np.float64
# The learning's state as an ``ArrayTable`` (``EstimatingController._kernel_state``),
# (dtype, dimensions) by row: the slots' cut drafts and probes, the estimator,
# the prefix calibration, the confidence calibration, the bound's slots.
LEARN_TABLE = (
    (_I64, 1), (_I64, 1), (np.bool_, 1), (_I64, 1),                # cut_token .. probe_level
    (_F64, 2), (_F64, 2), (np.int16, 2), (np.int16, 2), (_I64, 1),  # acc_s .. win_pos
    (_F64, 1), (_F64, 1), (_F64, 1),                                # glob, gps, gpn
    (_F64, 2), (_F64, 1), (_F64, 1), (_F64, 1),                     # q_used, edges, ps, pe
    (np.float32, 2), (_F64, 1), (_F64, 1), (_F64, 2), (_F64, 2),    # conf_kept .. cpn
    (_F64, 1), (_F64, 1),                                           # cal_s, cal_e
    (_I64, 1), (np.bool_, 1),                                       # zero_streak, conf_seen
)
#: Its scalars, in a float64 vector, by position.
LEARN_SCALARS = ("depth", "gdecay", "prior", "decay", "ewma", "threshold", "strength", "eps",
                 "pdecay", "cstrength", "cgdecay", "cdecay")


@cached_njit
def step_outcomes(rows, info, trees, cut_token, cut_at, observe_cut, probing, probe_level,
                  n, m, peek_at, hit):
    """What each row's last drafts showed. ``info`` per row: tokens
    emitted, drafts verified, the last emitted token (-1: none); ``trees``
    (empty: none) marks rows whose drafts were trees, which teach no
    position. Writes ``n``/``m`` (positions observed, of which the first
    accepted) with the first cut draft added where the target's own token
    shows its outcome (``peek_at``: its position, -1 where not; ``hit``:
    accepted), consumes the stored cut draft, and settles probes: an
    accepted probe clears the row's backoff, a rejected one adds to it.
    Returns the number of cut drafts observed."""
    peeks = 0
    for i in range(len(rows)):
        row = rows[i]
        emitted = info[i, 0]
        ni = info[i, 1] if emitted > 0 else 0
        if len(trees) and trees[i]:
            ni = 0
        mi = min(max(emitted - 1, 0), ni)
        token = cut_token[row]
        at = cut_at[row]
        cut_token[row] = -1
        peek_at[i] = -1
        hit[i] = False
        if observe_cut and token >= 0 and emitted > 0 and mi == ni and at == ni:
            peek_at[i] = at
            hit[i] = info[i, 2] == token
            peeks += 1
            ni += 1
            if hit[i]:
                mi += 1
        n[i] = ni
        m[i] = mi
        if probing[row] and ni > 0:
            probe_level[row] = 0 if mi > 0 else probe_level[row] + 1
        probing[row] = False
    return peeks


@cached_njit
def _probe_gap(row, gap, probe_level, max_backoff):
    return gap << min(probe_level[row], max_backoff)


@cached_njit
def length_bounds(rows, probs, threshold, zero_streak, probe_level, gap, max_backoff,
                  conf_seen, max_draft):
    """Each row's bound on kept drafts: the leading drafts whose prefix
    probability by history beats ``threshold``; at least 1 where a probe
    is due (``gap`` > 0: zero choices before one, doubled per failed probe
    up to ``max_backoff`` times); every draft for rows given confidences
    (``conf_seen``, empty: none), which arrive only with the drafts."""
    out = np.empty(len(rows), np.int64)
    for i in range(len(rows)):
        row = rows[i]
        q = 1.0
        bound = 0
        for j in range(probs.shape[1]):
            q *= probs[i, j]
            if q > threshold:
                bound += 1
        if gap > 0 and zero_streak[row] >= _probe_gap(row, gap, probe_level, max_backoff):
            bound = max(bound, 1)
        bound = min(max(bound, 0), max_draft)
        if len(conf_seen) and conf_seen[row]:
            bound = max_draft
        out[i] = bound
    return out


@cached_njit
def settle(rows, lengths, keep, bound, observe_cut, stochastic, zero_streak, probe_level,
           probing, gap, max_backoff, cut_at, kept, upto, cut_rows):
    """Probes, then the first cut draft: after enough zero choices in a
    row (``gap`` > 0, as in ``length_bounds``) an offered row keeps one
    draft, unless the next step observes its cut draft's outcome for free
    (``observe_cut``, and not ``stochastic``, empty: none); ``bound``
    marks rows ``max_length`` gave none, zero choices too. Writes ``kept``
    (at most ``lengths``), ``upto`` (kept, plus the first cut draft where
    observed, its position into ``cut_at``) and the batch rows with such a
    cut draft into ``cut_rows``. Returns (probes, cut drafts)."""
    probes = 0
    cuts = 0
    for i in range(len(rows)):
        row = rows[i]
        offered = lengths[i] > 0
        observable = observe_cut and offered and not (len(stochastic) and stochastic[i])
        k = keep[i]
        zero = (offered and k == 0) or bound[i]
        if offered and k > 0:
            probe_level[row] = 0
        if (gap > 0 and zero and offered and not observable
                and zero_streak[row] >= _probe_gap(row, gap, probe_level, max_backoff)):
            k = 1
            probing[row] = True
            probes += 1
            zero = False
        if zero:
            zero_streak[row] += 1
        elif offered:
            zero_streak[row] = 0
        k = min(k, lengths[i])
        kept[i] = k
        upto[i] = k
        if k < lengths[i] and observable:
            cut_at[row] = k
            upto[i] = k + 1
            cut_rows[cuts] = i
            cuts += 1
    return probes, cuts


@cached_njit
def count_decisions(lengths, keep, bound, hist):
    """Clips ``keep`` to [0, lengths] in place and counts the step's
    decisions into ``hist`` (index k: decisions keeping k). Returns (rows
    offered nothing by the proposer, decisions, zero choices, whether any
    row was offered a draft or bounded to none)."""
    no_draft = decisions = zeros = 0
    for i in range(len(lengths)):
        k = min(max(keep[i], 0), lengths[i])
        keep[i] = k
        offered = lengths[i] > 0
        if not offered and not bound[i]:
            no_draft += 1
            continue
        decisions += 1
        if k == 0 or bound[i]:
            zeros += 1
        hist[k] += 1
    return no_draft, decisions, zeros, decisions > 0


@cached_njit
def learn_step(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej, ec, ex,
               cut_token, cut_at, probing, probe_level,
               acc_s, acc_n, win_n, win_m, win_pos, glob, gps, gpn, depth, gdecay, prior, decay,
               ewma, threshold, strength, eps,
               q_used, edges, ps, pe, pdecay,
               conf_kept, gs, gn, cps, cpn, cal_s, cal_e, cstrength, cgdecay, cdecay):
    """A step's learning in one call: ``step_outcomes`` into ``outcomes``
    (n, m, peek_at, hit), then the prefix calibration (``q_used``..``pdecay``,
    ``q_used`` None: off), the estimator (``acc_s``..``eps``), the
    confidence calibration (``conf_kept``..``cdecay``, ``conf_kept`` None:
    off; ``er``, ``ej``, ``ec``, ``ex``: outcomes read elsewhere, as
    ``learn_outcomes`` takes them). With ``foresee``, ``foreseen`` gets each
    observed cut draft's acceptance as the estimate gave it before this
    step. The state is ``EstimatingController._kernel_state``'s tuples,
    flattened (``_learn_state``). Returns (cut drafts observed, rows the
    change detector reset)."""
    n, m, peek_at, hit = outcomes[0], outcomes[1], outcomes[2], outcomes[3]
    peeks = step_outcomes(rows, info, trees, cut_token, cut_at, observe_cut, probing,
                          probe_level, n, m, peek_at, hit)
    if foresee and peeks:
        rate = (glob[0] + prior) / (glob[1] + 1.0)
        for i in range(len(rows)):
            if peek_at[i] >= 0:
                p = probs_rows(rows[i:i + 1], acc_s, acc_n, win_n, win_m, ewma, rate, gps, gpn,
                               strength, eps)
                foreseen[i] = p[0, min(max(peek_at[i], 0), depth - 1)]
    if q_used is not None:
        learn_prefix(rows, n, m, q_used, edges, ps, pe, pdecay)
    changes = learn_rows(rows, n, m, depth, acc_s, acc_n, win_n, win_m, win_pos, glob, gps,
                         gpn, gdecay, prior, decay, ewma, threshold)
    if conf_kept is not None:
        learn_kept(rows, n, m, conf_kept, er, ej, ec, ex, gs, gn, cps, cpn, cal_s, cal_e,
                   cstrength, cgdecay, cdecay)
    return peeks, changes


@cached_njit
def learn_bound_step(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej, ec,
                     ex, cut_token, cut_at, probing, probe_level,
                     acc_s, acc_n, win_n, win_m, win_pos, glob, gps, gpn, depth, gdecay, prior,
                     decay, ewma, threshold, strength, eps,
                     q_used, edges, ps, pe, pdecay,
                     conf_kept, gs, gn, cps, cpn, cal_s, cal_e, cstrength, cgdecay, cdecay,
                     bound_threshold, gap, max_backoff, max_draft, zero_streak, conf_seen):
    """``learn_step``, then ``bound_step`` on the learned estimates, in one
    call: after a forward has evicted the caches, a compiled call's entry
    costs by its array arguments, and the two share most of theirs. Returns
    (cut drafts observed, rows the change detector reset, the rows'
    acceptance estimates, their bounds)."""
    peeks, changes = learn_step(
        rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej, ec, ex,
        cut_token, cut_at, probing, probe_level,
        acc_s, acc_n, win_n, win_m, win_pos, glob, gps, gpn, depth, gdecay, prior, decay,
        ewma, threshold, strength, eps,
        q_used, edges, ps, pe, pdecay,
        conf_kept, gs, gn, cps, cpn, cal_s, cal_e, cstrength, cgdecay, cdecay)
    probs, bound = bound_step(rows, bound_threshold, gap, max_backoff, max_draft, zero_streak,
                              probe_level, conf_seen, acc_s, acc_n, win_n, win_m, win_pos, glob,
                              gps, gpn, depth, gdecay, prior, decay, ewma, threshold, strength,
                              eps)
    return peeks, changes, probs, bound


@cached_njit
def _learn_state(t, x, prefix_on, calibrate_on):
    """``learn_step``'s state arguments (``cut_token`` .. ``cdecay``) from
    the table ``t`` (``LEARN_TABLE``) and scalars ``x`` (``LEARN_SCALARS``);
    ``prefix_on``/``calibrate_on`` None: that calibration is off (its
    arguments None, as ``learn_step`` takes them)."""
    head = (vec(t, 0, _I64), vec(t, 1, _I64), vec(t, 2, np.bool_), vec(t, 3, _I64),
            mat(t, 4, _F64), mat(t, 5, _F64), mat(t, 6, np.int16), mat(t, 7, np.int16),
            vec(t, 8, _I64), vec(t, 9, _F64), vec(t, 10, _F64), vec(t, 11, _F64),
            int(x[0]), x[1], x[2], x[3], x[4] != 0.0, x[5], x[6], x[7])
    if prefix_on is None:
        prefix = (None, None, None, None, None)
    else:
        prefix = (mat(t, 12, _F64), vec(t, 13, _F64), vec(t, 14, _F64), vec(t, 15, _F64), x[8])
    if calibrate_on is None:
        calibrate = (None, None, None, None, None, None, None, None, None, None)
    else:
        calibrate = (mat(t, 16, np.float32), vec(t, 17, _F64), vec(t, 18, _F64),
                     mat(t, 19, _F64), mat(t, 20, _F64), vec(t, 21, _F64), vec(t, 22, _F64),
                     x[9], x[10], x[11])
    return head + prefix + calibrate


@cached_njit
def learn_step_table(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej, ec,
                     ex, t, x, prefix_on, calibrate_on):
    """``learn_step`` with its state as a table (``_learn_state``)."""
    return learn_step(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej, ec,
                      ex, *_learn_state(t, x, prefix_on, calibrate_on))


@cached_njit
def learn_bound_step_table(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej,
                           ec, ex, t, x, prefix_on, calibrate_on, bound_threshold, gap,
                           max_backoff, max_draft):
    """``learn_bound_step`` with its state as a table (``_learn_state``;
    ``zero_streak`` and ``conf_seen`` its last rows)."""
    return learn_bound_step(rows, info, trees, observe_cut, foresee, outcomes, foreseen, er, ej,
                            ec, ex, *_learn_state(t, x, prefix_on, calibrate_on),
                            bound_threshold, gap, max_backoff, max_draft, vec(t, 23, _I64),
                            vec(t, 24, np.bool_))


@cached_njit
def bound_step(rows, threshold, gap, max_backoff, max_draft, zero_streak, probe_level,
               conf_seen, acc_s, acc_n, win_n, win_m, win_pos, glob, gps, gpn, depth, gdecay,
               prior, decay, ewma, change_threshold, strength, eps):
    """(each row's acceptance estimates, its ``length_bounds``), the
    estimator's state flattened as ``learn_step`` takes it."""
    rate = (glob[0] + prior) / (glob[1] + 1.0)
    probs = probs_rows(rows, acc_s, acc_n, win_n, win_m, ewma, rate, gps, gpn, strength, eps)
    return probs, length_bounds(rows, probs, threshold, zero_streak, probe_level, gap,
                                max_backoff, conf_seen, max_draft)


@cached_njit
def settle_step(rows, lengths, keep, bound, observe_cut, stochastic, gap, max_backoff, out,
                q_used, q_raw, conf, zero_streak, probe_level, probing, cut_at, conf_kept,
                conf_seen):
    """``settle`` into ``out`` (kept, upto, cut rows), then what the next
    step's outcomes are matched with: the prefix probabilities ``q_raw``
    up to ``upto`` into ``q_used`` (None: not kept), the kept confidences
    (``conf_kept``/``conf_seen``: the confidence calibration's slot arrays,
    None: off; ``conf`` empty: none given, stored as NaN). Returns (probes,
    cut drafts)."""
    kept, upto, cut_rows = out[0], out[1], out[2]
    probes, cuts = settle(rows, lengths, keep, bound, observe_cut, stochastic, zero_streak,
                          probe_level, probing, gap, max_backoff, cut_at, kept, upto, cut_rows)
    if q_used is not None:
        remember_prefix(rows, q_raw, upto, q_used)
    if conf_kept is not None:
        if conf.shape[0] > 0:
            remember_kept(rows, conf, upto, conf_kept, conf_seen)
        else:
            for i in range(len(rows)):
                for j in range(conf_kept.shape[1]):
                    conf_kept[rows[i], j] = np.nan
    return probes, cuts
