"""The one mechanism by which this package changes vLLM.

A ``Patch`` names one vLLM attribute (``module:Qualname.attr``), says why we
replace it and which pin test in tests/test_bridge_pins.py (for fixes to
vLLM's CPU build, tests/test_bridge_pins_cpu.py) covers the vLLM code it
relies on, and builds the replacement from the original. ``apply``
is idempotent per patch and refuses a second, different patch of the same
attribute: two wrappers of one function are how plugins silently undo each
other.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("vllm_plugins")

# The attribute our replacements carry: the name of the patch that made them.
MARK = "_vllm_plugins_patch"
_MISSING = object()


@dataclass(frozen=True)
class Patch:
    name: str
    target: str  # "vllm.module.path:Class.attr" or "vllm.module.path:function"
    why: str
    pin: str  # the test in tests/test_bridge_pins*.py that pins what we rely on
    # original attribute (None where ``adds``) -> the replacement
    build: Callable[[Any], Any]
    # The patch applies only where this holds (checked at apply time).
    when: Callable[[], bool] | None = None
    # True: the attribute is ours alone; vLLM must not define it.
    adds: bool = False

    @property
    def module(self) -> str:
        return self.target.partition(":")[0]

    @property
    def qualname(self) -> str:
        return self.target.partition(":")[2]

    def owner_and_attr(self) -> tuple[Any, str]:
        owner: Any = importlib.import_module(self.module)
        *path, attr = self.qualname.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, attr

    def current(self) -> Any:
        owner, attr = self.owner_and_attr()
        # The class's own entry: a property stays a property, a staticmethod
        # is not unwrapped, and an inherited attribute reads as its base's.
        for klass in getattr(owner, "__mro__", (owner,)):
            if attr in vars(klass):
                return vars(klass)[attr]
        return _MISSING

    def is_applied(self) -> bool:
        return _mark_of(self.current()) == self.name


def _mark_of(value: Any) -> str | None:
    fn = value.fget if isinstance(value, property) else value
    return getattr(fn, MARK, None)


def apply(patches: tuple[Patch, ...] | list[Patch]) -> list[str]:
    """Applies each patch once; returns the names applied by this call."""
    names = [p.name for p in patches]
    targets = [p.target for p in patches]
    for seen, label in ((names, "name"), (targets, "target")):
        dup = sorted({x for x in seen if seen.count(x) > 1})
        if dup:
            raise RuntimeError(f"vllm_plugins patch list repeats a {label}: {dup}")
    done = []
    for patch in patches:
        if patch.when is not None and not patch.when():
            continue
        original = patch.current()
        mark = _mark_of(original)
        if mark == patch.name:
            continue
        if mark is not None:
            raise RuntimeError(f"{patch.target} is already patched by '{mark}'; "
                               f"refusing to patch it again as '{patch.name}'")
        if patch.adds and original is not _MISSING:
            raise RuntimeError(f"{patch.target} exists in this vLLM; patch "
                               f"'{patch.name}' adds it and would shadow vLLM's")
        if not patch.adds and original is _MISSING:
            raise RuntimeError(f"{patch.target} is missing from this vLLM "
                               f"(patch '{patch.name}', pinned by {patch.pin})")
        replacement = patch.build(None if patch.adds else original)
        fn = replacement.fget if isinstance(replacement, property) else replacement
        setattr(fn, MARK, patch.name)
        owner, attr = patch.owner_and_attr()
        setattr(owner, attr, replacement)
        logger.debug("vllm_plugins: patched %s (%s): %s", patch.target, patch.name,
                     patch.why)
        done.append(patch.name)
    return done
