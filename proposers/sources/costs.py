"""What each draft source costs the engine, against what it alone brings.

The hybrid runs every source on every request each step: a source's host
time (its ``learn``, ``propose`` and ``sent``) is paid by every step, on a
fast host as a fair share of it. Without source k a step would be c_k
seconds shorter and a_k tokens poorer, where a_k counts the accepted tokens
no other source proposed (what another source also proposed stays). With N
tokens in a step of T seconds, the engine's tokens per second with the
source beat those without it while

    a_k / N  >=  c_k / T

(N / T >= (N - a_k) / (T - c_k)). ``SourceCosts`` keeps decayed per-step
means of c_k, a_k, N and T and switches off a source that fails this; an
off source is neither asked nor taught (sources catch up from the context,
as after a resting step) and comes back for a few probing steps now and
then, so that a source that starts to pay is heard again. One source
always stays on: the draft-length policy decides whether drafting pays at
all.
"""

from __future__ import annotations

class SourceCosts:
    """Plain lists, not arrays: a handful of sources, every step, where
    numpy's dispatch would cost more than the arithmetic."""

    HALF_LIFE = 64.0   # steps
    WARMUP = 32        # steps measured before any source goes off
    PROBE_GAP = 256    # steps an off source stays off
    PROBE_STEPS = 16   # steps it then runs to be measured again

    def __init__(self, count: int, enabled: bool = True):
        self.enabled = enabled
        self.on = [True] * count
        self._decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self._seconds = [0.0] * count          # this step's, so far
        # Decayed sums over the steps a source ran, and their weight: means
        # that a probe starts afresh (the sums of its last time on are old).
        self._cost = [0.0] * count
        self._alone = [0.0] * count
        self._weight = [0.0] * count
        self._tokens = self._step_s = 0.0      # decayed sums over every step
        self._alone_before = [0] * count
        self._since = [0] * count              # steps in the current state
        self.steps = 0
        self.off_steps = [0] * count

    @property
    def cost_s(self) -> list[float]:
        """Mean host seconds a step, of the steps each source ran."""
        return [c / w if w > 0 else 0.0 for c, w in zip(self._cost, self._weight)]

    @property
    def alone(self) -> list[float]:
        """Mean accepted tokens a step that only each source proposed."""
        return [a / w if w > 0 else 0.0 for a, w in zip(self._alone, self._weight)]

    def add(self, k: int, seconds: float) -> None:
        """Source k worked ``seconds`` of host time in this step."""
        self._seconds[k] += seconds

    def end_step(self, tokens: int, step_seconds: float | None, alone_total) -> None:
        """The step is over: ``tokens`` it emitted, its engine seconds (None:
        not measured) and each source's running count of accepted tokens
        that only it proposed. Learns, then decides the next step's sources."""
        alone_total = [int(a) for a in alone_total]
        alone = [a - b for a, b in zip(alone_total, self._alone_before)]
        self._alone_before = alone_total
        seconds, self._seconds = self._seconds, [0.0] * len(self._seconds)
        self.steps += 1
        for k, on in enumerate(self.on):
            if not on:
                self.off_steps[k] += 1
        if not self.enabled or step_seconds is None or step_seconds <= 0:
            return
        d = self._decay
        self._tokens = d * self._tokens + tokens
        self._step_s = d * self._step_s + step_seconds
        for k, on in enumerate(self.on):
            self._since[k] += 1
            if on:
                self._cost[k] = d * self._cost[k] + seconds[k]
                self._alone[k] = d * self._alone[k] + alone[k]
                self._weight[k] = d * self._weight[k] + 1.0
        if self.steps >= self.WARMUP:
            self._decide()

    def _decide(self) -> None:
        cost, alone = self.cost_s, self.alone
        on = []
        for k, was_on in enumerate(self.on):
            if was_on:   # pays, or still probing
                on.append(alone[k] * self._step_s >= cost[k] * self._tokens
                          or self._since[k] < self.PROBE_STEPS)
            else:
                on.append(self._since[k] >= self.PROBE_GAP)
                if on[k]:   # a probe measures afresh
                    self._cost[k] = self._alone[k] = self._weight[k] = 0.0
        if not any(on):   # the one that comes closest stays; the cheapest of equals
            k = max(range(len(on)), key=lambda k: (alone[k] / max(cost[k], 1e-12), -cost[k]))
            on[k] = True
        for k in range(len(on)):
            if on[k] != self.on[k]:
                self._since[k] = 0
        self.on = on

    def table(self, names) -> dict:
        """Per source: on or off, mean host ms a step, tokens only it
        brought per step, steps spent off."""
        cost, alone = self.cost_s, self.alone
        return {name: {"on": self.on[k],
                       "ms_per_step": round(1e3 * cost[k], 4),
                       "alone_tokens_per_step": round(alone[k], 4),
                       "off_steps": self.off_steps[k]}
                for k, name in enumerate(names)}
