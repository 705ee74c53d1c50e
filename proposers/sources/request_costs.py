"""One running request's evidence of what each draft source costs it and
brings it, for ``SourceCosts`` to weigh.

A request's steps with a source are few (requests often run 60 to 120
steps) and its accepted-alone tokens come in lumps, so the sums here are
never read alone: ``SourceCosts`` adds the engine-wide mean of a few steps
to them. They are decayed over the request's own steps with the source, so
old evidence fades as the request's text changes, and they stand still
while the source is off for it (nothing is measured then).

The engine-wide mean is the population's: a request that switched a
source off still counts, each step, with what it had measured. Counting
only the requests that run a source would be counting the ones it pays
for, and every new request would start with every source on.
"""

from __future__ import annotations


class StepTally:
    """One step's sums over the requests, per source: what the requests
    that asked it measured (``cost``, ``alone``, ``asked``), and the
    per-step means of those that had it off after measuring it
    (``held_cost``, ``held_alone``, ``held``)."""

    __slots__ = ("cost", "alone", "asked", "held_cost", "held_alone", "held")

    def __init__(self, count: int):
        self.cost, self.alone, self.asked = [0.0] * count, [0.0] * count, [0] * count
        self.held_cost, self.held_alone, self.held = [0.0] * count, [0.0] * count, [0] * count


class RequestCosts:
    """Plain lists of a handful of sources: one request, every step."""

    __slots__ = ("active", "on", "asked", "seconds", "alone_read", "cost", "alone", "weight")

    def __init__(self, count: int, active: tuple[int, ...]):
        self.active = active              # the sources the request chose
        self.on = active                  # those it asks when it next drafts
        self.asked = ()                   # those it asked since the last step ended
        self.seconds = [0.0] * count      # ... and their propose seconds
        self.alone_read = None            # accepted tokens only each source proposed,
        #                                   read from its last drafts (a list), or None
        # Decayed sums over the request's steps that asked each source.
        self.cost = [0.0] * count         # host seconds: propose, and a share of learn/sent
        self.alone = [0.0] * count        # accepted tokens no other source proposed
        self.weight = [0.0] * count       # steps

    def learn(self, decay: float, share: list[float], tally: StepTally) -> None:
        """The step is over: each asked source's propose seconds and
        ``share[k]`` (its part of source k's learn and sent) into the sums,
        with the tokens only it brought, all into ``tally`` too; each
        source it had off, as measured before, into ``tally``'s held sums.
        A tree read late (the request sat out steps) brings its tokens to
        the step it is read in."""
        asked, seconds = self.asked, self.seconds
        own_cost, own_alone, weight = self.cost, self.alone, self.weight
        for k in asked:
            c = seconds[k] + share[k]
            seconds[k] = 0.0
            own_cost[k] = decay * own_cost[k] + c
            own_alone[k] *= decay
            weight[k] = decay * weight[k] + 1.0
            tally.cost[k] += c
            tally.asked[k] += 1
        if self.alone_read is not None:
            for k, a in enumerate(self.alone_read):
                if a:
                    own_alone[k] += a
                    tally.alone[k] += a
        if len(asked) < len(self.active):
            for k in self.active:
                w = weight[k]
                if w > 0 and k not in asked:
                    tally.held_cost[k] += own_cost[k] / w
                    tally.held_alone[k] += own_alone[k] / w
                    tally.held[k] += 1
        self.asked, self.alone_read = (), None

    def forget_step(self) -> None:
        """A step that was not measured: nothing of it is learned."""
        for k in self.asked:
            self.seconds[k] = 0.0
        self.asked, self.alone_read = (), None
