"""What each draft source costs the engine, request by request, against what
it alone brings that request.

The hybrid asks every source for every request each step, and the engine
waits for that host time: on a fast host it is a fair share of the step. A
source that pays for one request (prompt lookup on a request that quotes
its prompt) may bring nothing to another, so the question is asked per
request r and source k. Without k for r, a step of T seconds and N tokens
(the engine's, every request's) would be c_kr seconds shorter and a_kr
tokens poorer: c_kr is k's propose time for r plus r's share of k's learn
and sent (engine-wide calls, split among the requests that asked k), a_kr
the accepted tokens of r that no other source proposed (what another
source also proposed stays). The engine's tokens per second are higher
with k for r while N / T >= (N - a_kr) / (T - c_kr), that is while

    a_kr * T  >=  c_kr * N.

A request's own evidence is thin (tens of steps, tokens in lumps), so its
decayed sums are read with the engine-wide means per request-step added
for ``PRIOR_STEPS`` steps (the population's: requests that had the source
off count with what they had measured, ``request_costs``). So a new
request starts where the engine stands (a source the engine knows does
not pay is not run again for every new request, one that pays for most is
on from the first step), and its own steps take over as they come. An off
source measures nothing for that request; it comes back for it only as
the engine-wide means move, since a probe of its own could cost a short
request more than it returns. A source off for every running request
runs no learn and no sent (it catches up from the context, as after a
resting step), and the engine-wide probe brings it back to every request
for ``PROBE_STEPS`` steps, measured afresh, after a gap its cost sets: its
probes take at most ``PROBE_SHARE`` of the engine's time. At batch 1 the
first requests set what every later one starts from; a cheap source that
one of them found no use for comes back within a few steps, and a costly
one that brings nothing is seldom asked. One of a request's sources
always stays on, the closest to paying: the draft-length policy decides
whether drafting pays at all.
"""

from __future__ import annotations

import math

from vllm_plugins.proposers.sources.request_costs import RequestCosts, StepTally


class SourceCosts:
    """Plain lists, not arrays: a handful of sources and the running
    requests, every step, where numpy's dispatch would cost more than the
    arithmetic."""

    HALF_LIFE = 64.0   # steps
    WARMUP = 32        # engine steps measured before any source goes off
    PROBE_STEPS = 16   # steps a source off for every request runs when probed
    PROBE_SHARE = 0.01  # of the engine's time, at most, its probes take
    MAX_PROBE_GAP = 4096   # steps: a source is measured again at least this often
    PRIOR_STEPS = 8.0  # steps of engine-wide means added to each request's sums

    def __init__(self, count: int, enabled: bool = True):
        self.enabled = enabled
        self.count = count
        self.on = [True] * count      # on for some running request: learn, sent run
        self.requests: dict[str, RequestCosts] = {}
        self._decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self._seconds = [0.0] * count          # learn and sent, since the step began
        # Engine-wide decayed sums over the steps each source ran: host
        # seconds, accepted tokens only it proposed, steps. A probe starts
        # them afresh, as it does the population's below.
        self._cost = [0.0] * count
        self._alone = [0.0] * count
        self._weight = [0.0] * count
        # The same per request-step, of the requests that asked it and of
        # those that had it off after measuring it (``StepTally``).
        self._pop_cost = [0.0] * count
        self._pop_alone = [0.0] * count
        self._pop_n = [0.0] * count
        self._tokens = self._step_s = 0.0      # decayed sums over every step
        self._steps_w = 0.0                    # ... and their decayed count
        # The engine's means, ``PRIOR_STEPS`` steps of them: each request's prior.
        self._prior_cost = [0.0] * count
        self._prior_alone = [0.0] * count
        self._off_for = [0] * count            # steps off for every request
        self._probe_left = [0] * count
        self.steps = 0
        self.off_steps = [0] * count           # request-steps a chosen source sat out

    @property
    def cost_s(self) -> list[float]:
        """Mean host seconds a step, of the steps each source ran."""
        return [c / w if w > 0 else 0.0 for c, w in zip(self._cost, self._weight)]

    @property
    def alone(self) -> list[float]:
        """Mean accepted tokens a step that only each source proposed."""
        return [a / w if w > 0 else 0.0 for a, w in zip(self._alone, self._weight)]

    # ------------------------------------------------------------ a step
    def add(self, k: int, seconds: float) -> None:
        """Source k's engine-wide work (learn, sent) took ``seconds``."""
        self._seconds[k] += seconds

    def join(self, req_id: str, active: tuple[int, ...]) -> None:
        """A running request that may draft, with the sources it chose: a
        new one starts from the engine-wide decision."""
        rec = self.requests.get(req_id)
        if rec is None:
            rec = self.requests[req_id] = RequestCosts(self.count, active)
        elif rec.active == active:
            return
        rec.active = rec.on = active
        if self.enabled and self.steps >= self.WARMUP:
            self._decide(rec)
        for k in rec.on:
            self.on[k] = True

    def ask(self, req_id: str) -> RequestCosts:
        """A joined request drafts now: its record, whose ``on`` it asks and
        whose ``seconds`` take each source's propose time."""
        rec = self.requests[req_id]
        rec.asked = rec.on
        if len(rec.on) < len(rec.active):
            for k in rec.active:
                if k not in rec.on:
                    self.off_steps[k] += 1
        return rec

    def outcomes(self, req_ids, alone_rows) -> None:
        """Per request, the accepted tokens only each source proposed in its
        last drafts (``Merger.outcomes_step``'s rows, as lists)."""
        requests = self.requests
        for req_id, row in zip(req_ids, alone_rows):
            rec = requests.get(req_id)
            if rec is not None:
                rec.alone_read = row

    def end_step(self, tokens: int, step_seconds: float | None) -> None:
        """The step is over: ``tokens`` it emitted, its engine seconds (None:
        not measured). Learns, then decides each request's sources."""
        self.steps += 1
        shared, self._seconds = self._seconds, [0.0] * self.count
        pending = [rec for rec in self.requests.values()
                   if rec.asked or rec.alone_read is not None]
        if not self.enabled or step_seconds is None or step_seconds <= 0:
            for rec in pending:
                rec.forget_step()
            return
        d = self._decay
        self._tokens = d * self._tokens + tokens
        self._step_s = d * self._step_s + step_seconds
        self._steps_w = d * self._steps_w + 1.0
        asked = [0] * self.count
        for rec in pending:
            for k in rec.asked:
                asked[k] += 1
        share = [s / n if n else 0.0 for s, n in zip(shared, asked)]
        t = StepTally(self.count)
        for rec in pending:
            rec.learn(d, share, t)
        for k, n in enumerate(asked):
            if n:
                self._cost[k] = d * self._cost[k] + t.cost[k]
                self._alone[k] = d * self._alone[k] + t.alone[k]
                self._weight[k] = d * self._weight[k] + 1.0
            else:   # a step no request asked it: its time waits for one that does
                self._seconds[k] += shared[k]
                self._alone[k] += t.alone[k]
            if n or t.held[k]:
                self._pop_cost[k] = d * self._pop_cost[k] + t.cost[k] + t.held_cost[k]
                self._pop_alone[k] = d * self._pop_alone[k] + t.alone[k] + t.held_alone[k]
                self._pop_n[k] = d * self._pop_n[k] + n + t.held[k]
        if self.steps >= self.WARMUP:
            self._probe()
            self._set_prior()
            for rec in self.requests.values():
                self._decide(rec)
            self._union()

    def free(self, req_id: str) -> None:
        """A finished request's evidence goes with it; the engine-wide
        means keep what it measured."""
        if self.requests.pop(req_id, None) is not None:
            self._union()

    # ------------------------------------------------------------ decisions
    def probe_gap(self, k: int) -> int:
        """Steps source k stays off for every request before it is probed:
        ``PROBE_STEPS`` of its mean host time a step, as last measured, are
        ``PROBE_SHARE`` of the engine's time over the gap."""
        step_s = self._step_s / self._steps_w if self._steps_w > 0 else 0.0
        if step_s <= 0.0:
            return self.MAX_PROBE_GAP
        gap = self.PROBE_STEPS * self.cost_s[k] / (self.PROBE_SHARE * step_s)
        return max(1, min(self.MAX_PROBE_GAP, math.ceil(gap - 1e-9)))   # not a float's last bit

    def _probe(self) -> None:
        """A source off for every request comes back to all of them for a
        while, measured afresh."""
        for k in range(self.count):
            if self._probe_left[k]:
                self._probe_left[k] -= 1
            elif self.on[k]:
                self._off_for[k] = 0
            else:
                self._off_for[k] += 1
                if self._off_for[k] >= self.probe_gap(k):
                    self._off_for[k] = 0
                    self._probe_left[k] = self.PROBE_STEPS
                    self._cost[k] = self._alone[k] = self._weight[k] = 0.0
                    self._pop_cost[k] = self._pop_alone[k] = self._pop_n[k] = 0.0

    def _set_prior(self) -> None:
        """``PRIOR_STEPS`` request-steps of the population's sums, the
        same for every request this step."""
        for k, n in enumerate(self._pop_n):
            w = self.PRIOR_STEPS / n if n > 0 else 0.0
            self._prior_cost[k] = w * self._pop_cost[k]
            self._prior_alone[k] = w * self._pop_alone[k]

    def _decide(self, rec: RequestCosts) -> None:
        """Request r keeps source k while a_kr * T >= c_kr * N, its sums and
        the prior read as one (their common weight cancels)."""
        tokens, seconds = self._tokens, self._step_s
        cost, alone, probing = self._prior_cost, self._prior_alone, self._probe_left
        own_cost, own_alone = rec.cost, rec.alone
        on = []
        for k in rec.active:
            if probing[k] or (own_alone[k] + alone[k]) * seconds \
                    >= (own_cost[k] + cost[k]) * tokens:
                on.append(k)
        rec.on = tuple(on) if on else (max(rec.active, key=lambda k: self._closeness(rec, k)),)

    def _closeness(self, rec: RequestCosts, k: int) -> tuple[float, float]:
        """Tokens a second of host time, then cheapness: the source a
        request keeps when none pays."""
        a, c = rec.alone[k] + self._prior_alone[k], rec.cost[k] + self._prior_cost[k]
        w = rec.weight[k] + (self.PRIOR_STEPS if self._pop_n[k] > 0 else 0.0)
        return a / max(c, 1e-12), -c / max(w, 1e-12)

    def _union(self) -> None:
        """Engine-wide on: probing, or on for some running request."""
        if not self.enabled:
            return
        on = [n > 0 for n in self._probe_left]
        for rec in self.requests.values():
            for k in rec.on:
                on[k] = True
        self.on = on

    # ------------------------------------------------------------ report
    def table(self, names) -> dict:
        """Per source: on for some running request, for how many, mean host
        ms a step, tokens only it brought per step, request-steps off."""
        cost, alone = self.cost_s, self.alone
        requests_on = [0] * self.count
        for rec in self.requests.values():
            for k in rec.on:
                requests_on[k] += 1
        return {name: {"on": self.on[k],
                       "requests_on": requests_on[k],
                       "ms_per_step": round(1e3 * cost[k], 4),
                       "alone_tokens_per_step": round(alone[k], 4),
                       "off_steps": self.off_steps[k]}
                for k, name in enumerate(names)}
