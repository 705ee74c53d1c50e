"""Declared, validated options: one system for methods and draft-length policies.

vLLM's SpeculativeConfig forbids unknown keys, so a method's options are
taken out of the user's dict before vLLM sees it, validated here (one error
naming the option), and carried to the worker on the config object. A
draft-length policy's options (``"draft_length_options"``) are declared and
validated the same way, by the same ``resolve``.

Every size option states an upper bound, and an option that sizes a table
states the bytes the table takes (``table_bytes``): a configuration whose
table would exceed ``TABLE_MEMORY_CEILING_BYTES`` is refused at start-up
with the option and the bytes named, before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

# The most one option's table may allocate (per engine process).
TABLE_MEMORY_CEILING_BYTES = 4 << 30


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    kind: type | tuple[type, ...]
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    choices: tuple | None = None
    # Size options: the largest value accepted (also stated in ``rule``).
    upper: int | float | None = None
    # Options that size a table: its bytes, from all resolved options.
    table_bytes: Callable[[dict], int] | None = None

    def validate(self, where: str, value: Any) -> Any:
        if self.choices is not None:
            if value not in self.choices:
                raise ValueError(
                    f"{where} must be one of {list(self.choices)}, got {value!r}"
                )
            return value
        if isinstance(value, bool) and self.kind in (int, float, (int, float)):
            raise ValueError(f"{where} must be a number, got {value!r}")
        if not isinstance(value, self.kind):
            kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
            names = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"{where} must be {names}, got {value!r}")
        if self.check is not None and not self.check(value):
            raise ValueError(f"{where} must be {self.rule}, got {value!r}")
        if self.kind == (int, float):
            value = float(value)
        return value


def integer(name: str, default: int, lo: int, hi: int | None, rule: str = "",
            table_bytes: Callable[[dict], int] | None = None) -> Option:
    """An integer in [lo, hi] (hi None: no upper bound, for non-sizes such
    as seeds)."""
    if not rule:
        rule = f"an integer in [{lo}, {hi}]" if hi is not None else f"an integer >= {lo}"
    return Option(name, default, int,
                  lambda v: lo <= v and (hi is None or v <= hi), rule,
                  upper=hi, table_bytes=table_bytes)


def positive_int(name: str, default: int, upper: int) -> Option:
    return integer(name, default, 1, upper)


def number(name: str, default: float, lo: float | None = None, hi: float | None = None,
           *, lo_open: bool = False, hi_open: bool = False, rule: str = "") -> Option:
    """A finite number in the interval; stored as float."""
    def check(v: Any) -> bool:
        return (math.isfinite(v)
                and (lo is None or v > lo or (v == lo and not lo_open))
                and (hi is None or v < hi or (v == hi and not hi_open)))
    if not rule:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        if lo is not None and hi is not None:
            rule = f"in {left}{lo:g}, {hi:g}{right}"
        elif lo is not None:
            rule = f"a number {'>' if lo_open else '>='} {lo:g}"
        else:
            rule = "a finite number"
    return Option(name, default, (int, float), check, rule)


def unit_float(name: str, default: float) -> Option:
    return number(name, default, 0.0, 1.0)


def flag(name: str, default: bool) -> Option:
    return Option(name, default, bool)


def choice(name: str, default: Any, choices: tuple) -> Option:
    return Option(name, default, type(default), choices=choices)


def resolve(owner: str, declared: tuple[Option, ...], given: dict[str, Any], *,
            scope: str = "method", label: str = "speculative_config option") -> dict:
    """Defaults overlaid with validated user values; unknown keys are errors.

    Errors read ``{label} 'name' of {scope} 'owner' must be ...``.
    """
    by_name = {o.name: o for o in declared}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise ValueError(
            f"unknown {label}(s) {unknown} for {scope} '{owner}'; "
            f"known options: {sorted(by_name) or 'none'}"
        )
    out = {name: opt.default for name, opt in by_name.items()}
    for name, value in given.items():
        out[name] = by_name[name].validate(f"{label} '{name}' of {scope} '{owner}'", value)
    for opt in declared:
        if opt.table_bytes is None:
            continue
        nbytes = int(opt.table_bytes(out))
        if nbytes > TABLE_MEMORY_CEILING_BYTES:
            raise ValueError(
                f"{label} '{opt.name}' of {scope} '{owner}' = {out[opt.name]!r} "
                f"would allocate {nbytes} bytes ({nbytes / 2**30:.1f} GiB), above "
                f"the table memory ceiling of {TABLE_MEMORY_CEILING_BYTES} bytes "
                f"({TABLE_MEMORY_CEILING_BYTES / 2**30:.0f} GiB)")
    return out
