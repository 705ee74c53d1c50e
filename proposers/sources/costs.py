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

import numpy as np


class SourceCosts:
    HALF_LIFE = 64.0   # steps
    WARMUP = 32        # steps measured before any source goes off
    PROBE_GAP = 256    # steps an off source stays off
    PROBE_STEPS = 16   # steps it then runs to be measured again

    def __init__(self, count: int, enabled: bool = True):
        self.enabled = enabled
        self.on = np.ones(count, dtype=bool)
        self._decay = 0.5 ** (1.0 / self.HALF_LIFE)
        self._seconds = np.zeros(count)        # this step's, so far
        # Decayed sums over the steps a source ran, and their weight: means
        # that a probe starts afresh (the sums of its last time on are old).
        self._cost = np.zeros(count)
        self._alone = np.zeros(count)
        self._weight = np.zeros(count)
        self._step = np.zeros(3)               # tokens, seconds, weight: every step
        self._alone_before = np.zeros(count, dtype=np.int64)
        self._since = np.zeros(count, dtype=np.int64)   # steps in the current state
        self.steps = 0
        self.off_steps = np.zeros(count, dtype=np.int64)

    @property
    def cost_s(self) -> np.ndarray:
        """Mean host seconds a step, of the steps each source ran."""
        return self._cost / np.maximum(self._weight, 1e-12)

    @property
    def alone(self) -> np.ndarray:
        """Mean accepted tokens a step that only each source proposed."""
        return self._alone / np.maximum(self._weight, 1e-12)

    def add(self, k: int, seconds: float) -> None:
        """Source k worked ``seconds`` of host time in this step."""
        self._seconds[k] += seconds

    def end_step(self, tokens: int, step_seconds: float | None,
                 alone_total: np.ndarray) -> None:
        """The step is over: ``tokens`` it emitted, its engine seconds (None:
        not measured) and each source's running count of accepted tokens
        that only it proposed. Learns, then decides the next step's sources."""
        alone = alone_total - self._alone_before
        self._alone_before = alone_total.copy()
        seconds, self._seconds = self._seconds, np.zeros_like(self._seconds)
        self.steps += 1
        self.off_steps += ~self.on
        if not self.enabled or step_seconds is None or step_seconds <= 0:
            return
        d, on = self._decay, self.on
        self._step = d * self._step + (tokens, step_seconds, 1.0)
        self._cost[on] = d * self._cost[on] + seconds[on]
        self._alone[on] = d * self._alone[on] + alone[on]
        self._weight[on] = d * self._weight[on] + 1.0
        self._since += 1
        if self.steps >= self.WARMUP:
            self._decide()

    def _decide(self) -> None:
        tokens, step_s, _ = self._step
        pays = self.alone * step_s >= self.cost_s * tokens
        probe = ~self.on & (self._since >= self.PROBE_GAP)
        on = np.where(self.on, pays | (self._since < self.PROBE_STEPS), probe)
        if not on.any():   # the one that comes closest stays
            ratio = self.alone / np.maximum(self.cost_s, 1e-12)
            on[int(np.argmax(ratio))] = True
        self._cost[probe] = self._alone[probe] = self._weight[probe] = 0.0
        self._since[on != self.on] = 0
        self.on = on

    def table(self, names) -> dict:
        """Per source: on or off, mean host ms a step, tokens only it
        brought per step, steps spent off."""
        return {name: {"on": bool(self.on[k]),
                       "ms_per_step": round(1e3 * float(self.cost_s[k]), 4),
                       "alone_tokens_per_step": round(float(self.alone[k]), 4),
                       "off_steps": int(self.off_steps[k])}
                for k, name in enumerate(names)}
