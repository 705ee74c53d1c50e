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
