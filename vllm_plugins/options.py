"""Declared, validated options for our speculative methods.

vLLM's SpeculativeConfig forbids unknown keys, so our options are taken out of
the user's dict before vLLM sees it, validated here (one error naming the
option), and carried to the worker on the config object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Option:
    name: str
    default: Any
    kind: type | tuple[type, ...]
    check: Callable[[Any], bool] | None = None
    rule: str = ""
    choices: tuple | None = None

    def validate(self, method: str, value: Any) -> Any:
        where = f"speculative_config option '{self.name}' of method '{method}'"
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


def positive_int(name: str, default: int, rule: str = "a positive integer") -> Option:
    return Option(name, default, int, lambda v: v > 0, rule)


def unit_float(name: str, default: float) -> Option:
    return Option(name, default, (int, float), lambda v: 0.0 <= v <= 1.0, "in [0, 1]")


DRAFT_LENGTH_POLICIES = ("fixed", "acceptance", "confidence", "goodput")

# Options every method of ours takes.
COMMON_OPTIONS = (
    # "fixed" unless a method has measured goodput beating it end to end
    # (then it declares GOODPUT_BY_DEFAULT; docs/benchmarks.md, issue 3).
    Option("draft_length", "fixed", str, choices=DRAFT_LENGTH_POLICIES),
    Option("draft_length_options", None, (dict, type(None))),
)
# Token Recycling and ngram_adaptive (docs/benchmarks.md, issue 3): goodput
# ties fixed drafts at batch 1; at batch 8 and 16 it is 14-19% faster for
# Token Recycling with requests in flight (15% and 28% in static batches),
# and ties the n-gram lookup (-1% to +4%).
GOODPUT_BY_DEFAULT = Option("draft_length", "goodput", str, choices=DRAFT_LENGTH_POLICIES)


def resolve(method: str, declared: tuple[Option, ...], given: dict[str, Any]) -> dict:
    """Defaults overlaid with validated user values; unknown keys are errors."""
    by_name = {o.name: o for o in (*COMMON_OPTIONS, *declared)}
    unknown = sorted(set(given) - set(by_name))
    if unknown:
        raise ValueError(
            f"unknown speculative_config option(s) {unknown} for method "
            f"'{method}'; known options: {sorted(by_name)}"
        )
    out = {name: opt.default for name, opt in by_name.items()}
    for name, value in given.items():
        out[name] = by_name[name].validate(method, value)
    return out
