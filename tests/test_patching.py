"""The patch mechanism: one named patch per attribute, applied once."""

import logging
import sys
import types

import pytest

from vllm_plugins.bridge.patching import MARK, Patch, apply


@pytest.fixture
def target():
    """A throwaway module with a class to patch."""
    mod = types.ModuleType("vp_patch_target")

    class Thing:
        def run(self, x):
            return x + 1

        @property
        def size(self):
            return 3

    mod.Thing = Thing
    mod.helper = lambda: "vllm"
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def doubling(original):
    def run(self, x):
        return 2 * original(self, x)
    return run


def test_apply_replaces_marks_and_is_idempotent(target, caplog):
    patch = Patch("t.run", "vp_patch_target:Thing.run", "doubles", "pin", doubling)
    with caplog.at_level(logging.DEBUG, logger="vllm_plugins"):
        assert apply([patch]) == ["t.run"]
    assert target.Thing().run(1) == 4
    assert getattr(target.Thing.run, MARK) == "t.run" and patch.is_applied()
    assert "vp_patch_target:Thing.run" in caplog.text
    assert apply([patch]) == []  # a second install changes nothing
    assert target.Thing().run(1) == 4


def test_a_second_patch_of_one_attribute_is_refused(target):
    apply([Patch("t.run", "vp_patch_target:Thing.run", "", "pin", doubling)])
    other = Patch("t.other", "vp_patch_target:Thing.run", "", "pin", doubling)
    with pytest.raises(RuntimeError, match="already patched by 't.run'"):
        apply([other])
    assert target.Thing().run(1) == 4  # not doubled twice
    same_target = [Patch("a", "vp_patch_target:helper", "", "pin", lambda o: o),
                   Patch("b", "vp_patch_target:helper", "", "pin", lambda o: o)]
    with pytest.raises(RuntimeError, match="repeats a target"):
        apply(same_target)


def test_properties_module_functions_and_conditions(target):
    apply([
        Patch("t.size", "vp_patch_target:Thing.size", "", "pin",
              lambda old: property(lambda self: old.fget(self) + 1)),
        Patch("t.helper", "vp_patch_target:helper", "", "pin",
              lambda old: lambda: old() + "+ours"),
        Patch("t.never", "vp_patch_target:Thing.run", "", "pin", doubling,
              when=lambda: False),
    ])
    assert target.Thing().size == 4
    assert target.helper() == "vllm+ours"
    assert target.Thing().run(1) == 2


def test_added_attributes_must_be_ours_and_targets_must_exist(target):
    def add(_):
        return lambda self: "ours"

    apply([Patch("t.add", "vp_patch_target:Thing.extra", "", "pin", add, adds=True)])
    assert target.Thing().extra() == "ours"
    with pytest.raises(RuntimeError, match="would shadow vLLM's"):
        apply([Patch("t.clash", "vp_patch_target:Thing.run", "", "pin", add,
                     adds=True)])
    with pytest.raises(RuntimeError, match="missing from this vLLM"):
        apply([Patch("t.gone", "vp_patch_target:Thing.gone", "", "pin", doubling)])


def test_a_per_instance_patch_reaches_only_the_objects_it_is_put_on(target):
    from vllm_plugins.bridge.patching import apply_to, applied_to, rebuild

    patch = Patch("t.each", "vp_patch_target:Thing.run", "", "pin", doubling,
                  per_instance=True)
    run = target.Thing.run
    assert apply([patch]) == ["t.each"] and patch.is_applied()
    assert apply([patch]) == []
    assert target.Thing.run is run          # the class keeps vLLM's method
    chosen, other = target.Thing(), target.Thing()
    assert apply_to(patch, chosen) and not apply_to(patch, chosen)
    assert applied_to(patch, chosen) and not applied_to(patch, other)
    assert chosen.run(1) == 4 and other.run(1) == 2
    undo = rebuild(patch, lambda fn: lambda self, x: fn(self, x) + 100)
    later = target.Thing()
    apply_to(patch, later)
    assert later.run(1) == 104 and chosen.run(1) == 4
    undo()
    assert patch.replacement()(later, 1) == 4
    with pytest.raises(TypeError, match="Thing objects"):
        apply_to(patch, object())
    own = type("Own", (target.Thing,), {"run": lambda self, x: x})
    with pytest.raises(TypeError, match="Own overrides run"):
        apply_to(patch, own())
    # A class built again (a reloaded module) needs the patch built again.
    target.Thing = type("Thing", (), {"run": lambda self, x: x + 1})
    assert not patch.is_applied()
    with pytest.raises(RuntimeError, match="not an applied per-instance patch"):
        apply_to(patch, target.Thing())


def test_a_held_per_instance_patch_is_on_its_objects_only_between_on_and_off(target):
    from vllm_plugins.bridge.patching import applied_to, hold

    patch = Patch("t.held", "vp_patch_target:Thing.run", "", "pin", doubling,
                  per_instance=True)
    assert apply([patch]) == ["t.held"]
    chosen, other = [target.Thing(), target.Thing()], target.Thing()
    held = hold(patch, chosen)
    assert len(held) == 2 and held.patch is patch
    assert [t.run(1) for t in chosen] == [2, 2] and "run" not in vars(chosen[0])
    held.on()
    assert [t.run(1) for t in chosen] == [4, 4] and other.run(1) == 2
    assert all(applied_to(patch, t) for t in chosen) and not applied_to(patch, other)
    held.off()
    assert [t.run(1) for t in chosen] == [2, 2]
    assert not any("run" in vars(t) for t in chosen)
    held.off()   # twice is harmless
    with pytest.raises(TypeError, match="Thing objects"):
        hold(patch, [object()])
    own = target.Thing()
    own.run = lambda x: x
    with pytest.raises(RuntimeError, match="already carries its own run"):
        hold(patch, [own])
