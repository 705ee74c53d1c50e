"""The per-request grammar spec: parsing, validation, compilation to llguidance.

A request asks for constrained decoding through ``SamplingParams.extra_args``::

    {"grammar": {"json_schema": {...}}}       # JSON Schema (dict, bool or JSON text)
    {"grammar": {"json_object": True}}        # any JSON object
    {"grammar": {"regex": "[0-9]{3}-[a-z]+"}} # whole output matches the regex
    {"grammar": {"lark": "start: ..."}}       # llguidance's Lark dialect

or the same dict as JSON text (``{"grammar": "{\\"regex\\": \\"a+\\"}"}``): the
OpenAI server's ``vllm_xargs`` carries only strings and numbers. Plus optional
settings::

    "whitespace_flexible": bool   # JSON kinds only. Default True (as vLLM's
                                  # structured output): any JSON whitespace
                                  # between tokens; False allows none
    "json_schema_faithful": bool  # json_schema only. Default False: the
                                  # language vLLM's native backend gives the
                                  # schema (objects closed where the schema
                                  # is silent, oneOf as anyOf, unimplemented
                                  # keywords ignored; see native_json). True:
                                  # JSON Schema's reading, and a schema that
                                  # cannot be fully enforced is refused
    "aligned": bool               # any kind. Default False. True: grammar-
                                  # aligned sampling (ASAp, see
                                  # logits_processors.asap) instead of
                                  # plain masking; needs temperature > 0
    "sampling": "mask" | "awrs"   # any kind. Default "mask": every step
                                  # masks the whole vocabulary. "awrs":
                                  # draw first, check the drawn token, mask
                                  # only after refusals (logits_processors.
                                  # awrs); the same output distribution
    "check": "name"               # a registered token check (grammar.
                                  # checks) applied on top of the grammar;
                                  # needs "sampling": "awrs". With a check
                                  # the grammar key may be left out (any
                                  # text)
    "weights": bool               # needs "sampling": "awrs" and plain
                                  # random sampling. True: the output
                                  # carries the summed log of each step's
                                  # estimated allowed mass (docs/grammar.md,
                                  # "Weights and SMC")
    "continue_tokens": [int, ...] # token ids the output already holds (the
                                  # prompt ends with them): the grammar and
                                  # the check start after them

This module imports neither torch nor vLLM: the frontend process runs
:func:`validate_grammar_request` once per request (through
``GrammarLogitsProcessor.validate_params``), and the tests use it directly.
Compilation never needs a tokenizer; the result is an llguidance grammar string
that any ``LLMatcher`` (built per request in the worker) accepts.
"""

from __future__ import annotations

import json
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance

from .native_json import NATIVE_JSON_OPTIONS, native_schema

#: The ``SamplingParams.extra_args`` key that switches the processor on.
GRAMMAR_KEY = "grammar"
#: Exactly one of these must be present in ``extra_args["grammar"]``.
GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "lark")
#: Optional settings and the kinds they apply to.
OPTION_KINDS = {
    "whitespace_flexible": ("json_schema", "json_object"),
    "json_schema_faithful": ("json_schema",),
    "aligned": GRAMMAR_KINDS,
    "sampling": GRAMMAR_KINDS,
    "check": GRAMMAR_KINDS,
    "weights": GRAMMAR_KINDS,
    "continue_tokens": GRAMMAR_KINDS,
}
#: Options that differ between requests of one grammar: left out of the
#: compiled grammar (and its cache key), read by :func:`request_options`.
PER_REQUEST_OPTIONS = ("weights", "continue_tokens")
#: Values of the ``"sampling"`` option.
SAMPLING_MODES = ("mask", "awrs")
#: The language of a request that gives a ``"check"`` and no grammar key.
ANY_TEXT_REGEX = "(?s:.*)"

_WHERE = f'extra_args["{GRAMMAR_KEY}"]'


class GrammarSpecError(ValueError):
    """A request's ``extra_args["grammar"]`` is malformed or does not compile.

    A ``ValueError`` so that vLLM turns it into ``VLLMValidationError``
    (HTTP 400 through the OpenAI server) when raised from ``validate_params``.
    """


@dataclass(frozen=True)
class CompiledGrammar:
    kind: str
    #: llguidance grammar text, the argument of ``llguidance.LLMatcher``.
    grammar: str
    #: warnings llguidance reported while validating (e.g. ignored keywords).
    warnings: tuple[str, ...] = ()
    #: ``"aligned": true``: sample with ASAp (``logits_processors.asap``) rather
    #: than plain masking.
    aligned: bool = False
    #: ``"sampling"``: "mask" (the whole mask every step) or "awrs" (draw,
    #: then check: ``logits_processors.awrs``).
    sampling: str = "mask"
    #: ``"check"``: the name of a registered token check (``grammar.checks``).
    check: str | None = None


@dataclass(frozen=True)
class RequestOptions:
    """A request's own options (:data:`PER_REQUEST_OPTIONS`)."""

    weights: bool = False
    continue_tokens: tuple[int, ...] = ()


def _as_dict(raw: Any) -> Any:
    """The spec as a dict when it is one or its JSON text naming a
    per-request option; else as given (a large schema's text is not parsed
    again just to find none)."""
    if isinstance(raw, str):
        if not any(f'"{k}"' in raw for k in PER_REQUEST_OPTIONS):
            return raw
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, RecursionError):
            return raw
    return raw


def request_options(raw: Any) -> RequestOptions:
    """The request's own options, validated (a GrammarSpecError names the bad one)."""
    raw = _as_dict(raw)
    if not isinstance(raw, dict) or not any(k in raw for k in PER_REQUEST_OPTIONS):
        return RequestOptions()
    weights = raw.get("weights", False)
    if not isinstance(weights, bool):
        raise GrammarSpecError(f'{_WHERE}["weights"] must be true or false, got {weights!r:.80}')
    if weights and raw.get("sampling") != "awrs":
        raise GrammarSpecError(f'{_WHERE}["weights"] needs "sampling": "awrs" (the weights '
                               f"are AWRS's estimates of each step's allowed mass)")
    cont = raw.get("continue_tokens", [])
    if (not isinstance(cont, list) or len(cont) > 1 << 20
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                       for t in cont)):
        raise GrammarSpecError(f'{_WHERE}["continue_tokens"] must be a list of token ids '
                               f"(non-negative integers), got {cont!r:.80}")
    if cont and raw.get("aligned"):
        raise GrammarSpecError(f'{_WHERE}["continue_tokens"] cannot be combined with '
                               f'"aligned": true (ASAp learns whole outputs from their start)')
    return RequestOptions(weights, tuple(cont))


def _shared_part(raw: Any) -> Any:
    """The spec without the per-request options (what compiles and is cached)."""
    spec = _as_dict(raw)
    if isinstance(spec, dict) and any(k in spec for k in PER_REQUEST_OPTIONS):
        return {k: v for k, v in spec.items() if k not in PER_REQUEST_OPTIONS}
    return raw


def grammar_request(extra_args: dict[str, Any] | None) -> Any | None:
    """The raw ``extra_args["grammar"]`` value, or None when the key is absent."""
    if not extra_args:
        return None
    return extra_args.get(GRAMMAR_KEY)


def _schema_text(value: Any, faithful: bool) -> str:
    """Canonical JSON text of a ``json_schema`` value (dict, bool or JSON text),
    rewritten to native's language unless ``faithful``."""
    where = f'{_WHERE}["json_schema"]'
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(f"{where} is a string but not valid JSON: {e}") from e
    if not isinstance(value, (dict, bool)):
        raise GrammarSpecError(
            f"{where} must be a JSON Schema (an object or a boolean), "
            f"got {type(value).__name__}"
        )
    if value is False:
        raise GrammarSpecError(f"{where} is false: no JSON value satisfies it")
    if value is True:
        value = {}  # llguidance applies options only to object schemas
    if not faithful:
        value = native_schema(value)
    try:
        return json.dumps(value, allow_nan=False)  # key order matters: llguidance emits properties in schema order
    except (TypeError, ValueError) as e:
        raise GrammarSpecError(f"{where} is not JSON-serializable: {e}") from e


def _sampling_options(raw: dict, aligned: bool) -> tuple[str, str | None]:
    """The ``"sampling"`` and ``"check"`` options, validated: (mode, check name)."""
    sampling = raw.get("sampling", "mask")
    if sampling not in SAMPLING_MODES:
        raise GrammarSpecError(
            f'{_WHERE}["sampling"] must be one of {", ".join(map(repr, SAMPLING_MODES))}, '
            f"got {sampling!r}")
    if aligned and sampling == "awrs":
        raise GrammarSpecError(
            f'{_WHERE}["sampling"] "awrs" cannot be combined with "aligned": true '
            f"(ASAp reweights the whole masked row)")
    check = raw.get("check")
    if check is None:
        return sampling, None
    if not isinstance(check, str) or not check:
        raise GrammarSpecError(f'{_WHERE}["check"] must be the name of a registered '
                               f"check, got {check!r:.80}")
    if sampling != "awrs":
        raise GrammarSpecError(
            f'{_WHERE}["check"] needs "sampling": "awrs" (a check is called per '
            f"drawn token; the mask mode cannot apply it to the whole vocabulary)")
    from .checks import check_function

    try:
        check_function(check)
    except ValueError as e:
        raise GrammarSpecError(f'{_WHERE}["check"]: {e}') from e
    return sampling, check


def _to_llguidance(raw: Any) -> tuple[str, str, bool]:
    """Check the shape of ``extra_args["grammar"]``; return (kind, llguidance grammar, aligned)."""
    if isinstance(raw, str):
        # The OpenAI server's ``vllm_xargs`` only carries strings and numbers,
        # so there the whole spec comes as JSON text.
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise GrammarSpecError(
                f"{_WHERE} is a string but not the JSON text of a dict: {e}"
            ) from e
    if not isinstance(raw, dict):
        raise GrammarSpecError(
            f"{_WHERE} must be a dict with one of the keys {', '.join(GRAMMAR_KINDS)}; "
            f"got {type(raw).__name__}"
        )
    unknown = sorted(k for k in raw if k not in GRAMMAR_KINDS and k not in OPTION_KINDS)
    if unknown:
        raise GrammarSpecError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in {_WHERE}; "
            f"allowed: {', '.join(GRAMMAR_KINDS + tuple(OPTION_KINDS))}"
        )
    kinds = [k for k in GRAMMAR_KINDS if k in raw]
    if not kinds and "check" in raw:  # a check alone: any text
        return ("regex", llguidance.LLMatcher.grammar_from_regex(ANY_TEXT_REGEX),
                raw.get("aligned") is True)
    if len(kinds) != 1:
        got = f"{len(kinds)} ({', '.join(kinds)})" if kinds else "none"
        raise GrammarSpecError(
            f"{_WHERE} must have exactly one of the keys {', '.join(GRAMMAR_KINDS)}; "
            f"got {got}"
        )
    kind = kinds[0]
    for opt, allowed_kinds in OPTION_KINDS.items():
        if opt in raw and kind not in allowed_kinds:
            raise GrammarSpecError(
                f'{_WHERE}["{opt}"] applies only to {" and ".join(allowed_kinds)}, '
                f"not to {kind}"
            )
    value = raw[kind]
    aligned = raw.get("aligned", False)
    if not isinstance(aligned, bool):
        raise GrammarSpecError(f'{_WHERE}["aligned"] must be true or false, got {aligned!r}')

    if kind in ("json_schema", "json_object"):
        flexible = raw.get("whitespace_flexible", True)
        if not isinstance(flexible, bool):
            raise GrammarSpecError(
                f'{_WHERE}["whitespace_flexible"] must be true or false, '
                f"got {flexible!r}"
            )
        faithful = raw.get("json_schema_faithful", False)
        if not isinstance(faithful, bool):
            raise GrammarSpecError(
                f'{_WHERE}["json_schema_faithful"] must be true or false, '
                f"got {faithful!r}"
            )
        options = {"whitespace_flexible": flexible}
        if kind == "json_object":
            if value is not True:
                raise GrammarSpecError(
                    f'{_WHERE}["json_object"] must be true, got {value!r}'
                )
            schema = '{"type": "object"}'  # any object, in both readings
        elif faithful:
            schema = _schema_text(value, faithful=True)
        else:
            options.update(NATIVE_JSON_OPTIONS)
            grammar = _json_grammar(kind, _schema_text(value, faithful=False), options)
            if not llguidance.LLMatcher.validate_grammar_with_warnings(grammar)[0]:
                return kind, grammar, aligned
            # Read as xgrammar reads it, the schema does not compile (e.g. an
            # allOf whose parts are closed objects): vLLM's auto backend falls
            # back to guidance, which reads the schema as JSON Schema does.
            schema = _schema_text(value, faithful=True)
        return kind, _json_grammar(kind, schema, options), aligned

    if not isinstance(value, str) or not value:
        raise GrammarSpecError(
            f'{_WHERE}["{kind}"] must be a non-empty string, got {value!r:.80}'
        )
    if kind == "regex":
        return kind, llguidance.LLMatcher.grammar_from_regex(value), aligned
    return kind, llguidance.LLMatcher.grammar_from_lark(value), aligned


def _json_grammar(kind: str, schema: str, options: dict) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    except (ValueError, TypeError) as e:
        raise GrammarSpecError(f'{_WHERE}["{kind}"] is not usable: {e}') from e


def _cache_key(raw: Any) -> str | None:
    try:
        return json.dumps(raw, allow_nan=False)  # order-preserving: property order is meaningful
    except (TypeError, ValueError, RecursionError):
        return None  # not cacheable; compile_grammar_request reports the error


class _LRU(OrderedDict):
    def __init__(self, size: int):
        super().__init__()
        self.size = size
        # The engine core compiles on threads (grammar.compile_cache) while
        # its loop reads this too: dict operations under the lock, make() not.
        self._lock = threading.Lock()

    def get_or(self, key, make):
        if key is not None:
            with self._lock:
                if key in self:
                    self.move_to_end(key)
                    return self[key]
        value = make()
        if key is not None:
            with self._lock:
                self[key] = value
                while len(self) > self.size:
                    self.popitem(last=False)
        return value


# Compiled grammars (or the error they raised), by canonical request text. Both
# the frontend (one validation per request) and the worker (one matcher per
# request) hit it; repeated schemas are the common case in serving.
_COMPILED: _LRU = _LRU(512)


def _compile_uncached(raw: Any) -> CompiledGrammar | GrammarSpecError:
    try:
        kind, grammar, aligned = _to_llguidance(raw)
        sampling, check = _sampling_options(
            json.loads(raw) if isinstance(raw, str) else raw, aligned)
    except GrammarSpecError as e:
        return e
    except RecursionError:
        # Python's json (reading or writing the spec) gives up on deep nesting
        # before llguidance's own depth limit is reached: a bad grammar too.
        return GrammarSpecError(nested_too_deeply(_WHERE))
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        msg = messages[0].strip() if messages else "unknown error"
        what = {
            "json_schema": "is not a JSON Schema that llguidance can compile",
            "json_object": "does not compile",
            "regex": "is not a valid regex",
            "lark": "is not a valid llguidance Lark grammar",
        }[kind]
        return GrammarSpecError(f'{_WHERE}["{kind}"] {what}: {msg}')
    return CompiledGrammar(kind, grammar, tuple(messages), aligned, sampling, check)


def nested_too_deeply(where: str) -> str:
    return (f"{where} is nested too deeply to compile (more levels than "
            f"Python's recursion limit, {sys.getrecursionlimit()}, allows)")


def compile_grammar_request(raw: Any) -> CompiledGrammar:
    """Compile ``extra_args["grammar"]`` to an llguidance grammar (cached).

    Raises :class:`GrammarSpecError` naming what is wrong: not a dict, unknown
    key, zero or two grammar keys, a bad option, nesting too deep to read,
    or llguidance's own compile error (bad schema, unsupported keyword, bad
    regex, bad Lark, a grammar over its size or depth limits).
    """
    from .compile_cache import on_deep_stack  # llguidance recursion: see there

    raw = _shared_part(raw)
    result = _COMPILED.get_or(_cache_key(raw),
                              lambda: on_deep_stack(lambda: _compile_uncached(raw)))
    if isinstance(result, GrammarSpecError):
        raise GrammarSpecError(str(result))
    return result


def validate_grammar_request(extra_args: dict[str, Any] | None) -> CompiledGrammar | None:
    """None for requests without the key; else the compiled grammar or an error."""
    raw = grammar_request(extra_args)
    if raw is None:
        if extra_args and GRAMMAR_KEY in extra_args:
            raise GrammarSpecError(f"{_WHERE} is null; leave the key out instead")
        return None
    compiled = compile_grammar_request(raw)
    request_options(raw)
    return compiled
