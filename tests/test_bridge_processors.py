"""The bridge's lookup of our logits processors among a runner's
(``vllm_plugins.bridge.processors.of_kind``): kept per holder, found again
for a new holder, and dropped with its holder."""

import gc

from vllm_plugins.bridge import processors
from vllm_plugins.bridge.processors import of_kind


class Mine:
    pass


class Theirs:
    pass


class Holder:
    """A stand-in for V1's ``LogitsProcessors``: counts its listings."""

    def __init__(self, procs):
        self.procs, self.listed = procs, 0

    @property
    def all(self):
        self.listed += 1
        return iter(self.procs)


class Unreferenceable:
    __slots__ = ("all",)

    def __init__(self, procs):
        self.all = procs


def test_processors_of_a_kind_are_listed_once_per_holder_in_their_order():
    a, b = Mine(), Mine()
    holder = Holder([a, Theirs(), b])
    assert of_kind(holder, Mine) == (a, b)
    assert of_kind(holder, Mine) == (a, b)
    assert holder.listed == 1
    assert of_kind(holder, Theirs)[0].__class__ is Theirs
    assert holder.listed == 2   # each kind is looked up once
    other = Holder([b])
    assert of_kind(other, Mine) == (b,)


def test_a_holder_that_goes_takes_its_entry_and_a_new_one_is_looked_up():
    before = len(processors._FOUND)
    holder = Holder([Mine()])
    of_kind(holder, Mine)
    assert len(processors._FOUND) == before + 1
    del holder
    gc.collect()
    assert len(processors._FOUND) == before
    fresh = Holder([])
    assert of_kind(fresh, Mine) == ()
    assert fresh.listed == 1


def test_a_holder_without_weak_references_is_looked_up_every_time():
    p = Mine()
    holder = Unreferenceable([p])
    assert of_kind(holder, Mine) == (p,)
    holder.all = []
    assert of_kind(holder, Mine) == ()
