"""The one mechanism by which this package changes vLLM.

A ``Patch`` names one vLLM attribute (``module:Qualname.attr``), says why we
replace it and which pin test in tests/test_bridge_pins.py (for fixes to
vLLM's CPU build, tests/test_bridge_pins_cpu.py) covers the vLLM code it
relies on, and builds the replacement from the original. ``apply``
is idempotent per patch and refuses a second, different patch of the same
attribute: two wrappers of one function are how plugins silently undo each
other.

A patch made ``per_instance`` leaves the class as vLLM wrote it: ``apply``
checks the attribute and builds the replacement once, and the bridge puts
it on the objects that need it (``apply_to``). What runs in every engine
(an attention layer's forward, say) then costs nothing in the engines that
never use it. ``hold`` keeps such a patch ready for chosen objects, to put on
around the calls that need it and take off after: between them the objects
run vLLM's attribute with no frame of ours.
"""

from __future__ import annotations

import functools
import importlib
import logging
import types
from dataclasses import dataclass
from typing import Any, Callable

logger = logging.getLogger("vllm_plugins")

# The attribute our replacements carry: the name of the patch that made them.
MARK = "_vllm_plugins_patch"
_MISSING = object()
# Per-instance patches built by ``apply``: name -> (vLLM's attribute, the
# replacement built from it).
_BUILT: dict[str, tuple[Any, Any]] = {}


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
    # True: the class keeps vLLM's attribute; ``apply_to`` replaces it on
    # chosen instances only.
    per_instance: bool = False

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

    def replacement(self) -> Any:
        """What the patch puts in place of vLLM's attribute: the class's
        attribute, or a per-instance patch's function (``_MISSING`` until
        ``apply`` built it from the class's attribute as it is now)."""
        if not self.per_instance:
            return self.current()
        original, replacement = _BUILT.get(self.name, (_MISSING, _MISSING))
        return replacement if original is self.current() else _MISSING

    def is_applied(self) -> bool:
        return _mark_of(self.replacement()) == self.name


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
        if patch.per_instance and patch.is_applied():
            continue
        replacement = patch.build(None if patch.adds else original)
        fn = replacement.fget if isinstance(replacement, property) else replacement
        setattr(fn, MARK, patch.name)
        if patch.per_instance:
            _BUILT[patch.name] = (original, replacement)
        else:
            owner, attr = patch.owner_and_attr()
            setattr(owner, attr, replacement)
        logger.debug("vllm_plugins: patched %s (%s): %s", patch.target, patch.name,
                     patch.why)
        done.append(patch.name)
    return done


def apply_to(patch: Patch, obj: Any) -> bool:
    """Puts an applied per-instance patch's replacement on ``obj``, an
    instance of its class, bound to it; returns whether ``obj`` lacked it."""
    attr = _instance_attr(patch, obj)
    if applied_to(patch, obj):
        return False
    setattr(obj, attr, types.MethodType(patch.replacement(), obj))
    return True


def _instance_attr(patch: Patch, obj: Any) -> str:
    """The attribute an applied per-instance patch replaces on ``obj``;
    raises where it cannot go there."""
    if not patch.per_instance or not patch.is_applied():
        raise RuntimeError(f"patch '{patch.name}' is not an applied per-instance patch")
    owner, attr = patch.owner_and_attr()
    if not isinstance(obj, owner):
        raise TypeError(f"patch '{patch.name}' applies to {owner.__qualname__} "
                        f"objects, not {type(obj).__qualname__}")
    if getattr(type(obj), attr) is not getattr(owner, attr):
        # The replacement calls the class's attribute: it would drop the
        # subclass's own.
        raise TypeError(f"{type(obj).__qualname__} overrides {attr}, which patch "
                        f"'{patch.name}' replaces on {owner.__qualname__} objects")
    return attr


class Held:
    """An applied per-instance patch held ready for chosen objects
    (``hold``): ``on`` puts its replacement, bound to each, on them all,
    ``off`` takes it off again, so that outside the calls that need it they
    run the class's attribute with no frame of ours. Both are a dictionary
    write per object: cheap enough for every call that needs it."""

    __slots__ = ("patch", "attr", "objects", "bound")

    def __init__(self, patch: Patch, attr: str, objects: tuple, bound: tuple):
        self.patch, self.attr, self.objects, self.bound = patch, attr, objects, bound

    def __len__(self) -> int:
        return len(self.bound)

    def on(self) -> None:
        attr = self.attr
        for namespace, method in self.bound:
            namespace[attr] = method

    def off(self) -> None:
        attr = self.attr
        for namespace, _ in self.bound:
            namespace.pop(attr, None)


def hold(patch: Patch, objs, *leading) -> Held:
    """``patch`` held ready for ``objs`` (each an instance of its class, as
    ``apply_to`` checks), off until ``Held.on``; its replacement is bound to
    each object once, here. With ``leading`` arguments the replacement is
    called as ``replacement(obj, *leading, *args)``: what it needs of its
    caller's state travels with it, not through a lookup on every call."""
    objs = tuple(objs)
    attrs = {_instance_attr(patch, obj) for obj in objs}
    attr = attrs.pop() if attrs else patch.owner_and_attr()[1]
    for obj in objs:
        if attr in vars(obj):
            raise RuntimeError(f"{type(obj).__qualname__} object already carries its own "
                               f"{attr}; patch '{patch.name}' cannot be held for it")
    replacement = patch.replacement()

    def bind(obj):
        if leading:
            return functools.partial(replacement, obj, *leading)
        return types.MethodType(replacement, obj)

    return Held(patch, attr, objs, tuple((vars(obj), bind(obj)) for obj in objs))


def applied_to(patch: Patch, obj: Any) -> bool:
    """Whether ``obj`` carries ``patch``'s replacement itself."""
    _, attr = patch.owner_and_attr()
    return _mark_of(vars(obj).get(attr)) == patch.name


def rebuild(patch: Patch, wrap: Callable[[Any], Any]) -> Callable[[], None]:
    """Replaces a per-instance patch's replacement with ``wrap(it)`` for the
    objects it is applied to from now on (a profiler times it so); returns
    the undo."""
    original, before = _BUILT[patch.name]
    after = wrap(before)
    setattr(after, MARK, patch.name)
    _BUILT[patch.name] = (original, after)
    return lambda: _BUILT.__setitem__(patch.name, (original, before))
