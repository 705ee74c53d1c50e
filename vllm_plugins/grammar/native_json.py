"""JSON Schema as vLLM's native structured output reads it, for llguidance.

For a JSON schema, vLLM's ``auto`` backend is xgrammar (guidance only where
vLLM's checks say xgrammar lacks a feature), and vLLM compiles it with
xgrammar's defaults: ``strict_mode=True`` and any JSON whitespace. llguidance
alone follows JSON Schema instead, so the same schema gives a different
language there: where a schema says nothing about ``additionalProperties``
the model may invent keys until the token budget runs out, where native
closes the object. The grammar processor's default is native's language,
rebuilt for llguidance here; ``"json_schema_faithful": true`` in the request
keeps JSON Schema's reading (``vllm_plugins.grammar.spec``).

What xgrammar's strict mode does, and the rewrite that gives it to llguidance
(``tests/test_grammar_native_parity.py`` feeds the same token sequences to
this grammar and to vLLM's own xgrammar backend, per dev schema):

* an object schema with ``properties``, ``patternProperties``, ``required``,
  ``minProperties`` or ``maxProperties`` and neither ``additionalProperties``
  nor ``unevaluatedProperties`` takes no other keys: ``"additionalProperties":
  false`` is added. ``required`` names the schema lists nowhere are ignored
  (xgrammar cannot write them once the object is closed). A bare
  ``{"type": "object"}`` stays any object, as in xgrammar;
* ``prefixItems`` without ``items``: no items after the prefix (``"items":
  false``);
* a schema without ``type`` that has ``properties`` is an object, one with
  ``items`` or ``prefixItems`` an array (xgrammar infers these two, nothing
  else);
* the first of ``$ref``, ``const``, ``enum``, ``anyOf``, ``oneOf``, ``allOf``
  a schema has is read alone: xgrammar ignores every other assertion beside
  it, where JSON Schema (and llguidance) intersect them;
* ``pattern`` and ``patternProperties`` keys match the whole string
  (xgrammar), not a substring (JSON Schema, llguidance);
* ``oneOf`` is compiled as ``anyOf`` (llguidance's ``coerce_one_of``; xgrammar
  does the same), and keywords llguidance does not implement are ignored
  with a warning (``lenient``; xgrammar ignores them too, e.g. ``not``).

Where the rewritten schema does not compile, ``spec`` compiles the schema as
JSON Schema reads it, as vLLM's ``auto`` falls back to guidance.
"""

from __future__ import annotations

import copy
from typing import Any

#: llguidance ``JsonCompileOptions`` of the native-parity default (the
#: whitespace option is set by the request).
NATIVE_JSON_OPTIONS = {"coerce_one_of": True, "lenient": True}

# Where sub-schemas live: maps of name -> schema, and schema or list-of-schema
# keywords. The rewrite reaches every schema through these.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas")
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "items",
               "prefixItems", "additionalItems", "unevaluatedItems", "allOf",
               "anyOf", "oneOf", "not", "if", "then", "else", "contains")
_OBJECT_KEYS = ("properties", "patternProperties", "required", "minProperties",
                "maxProperties")
# xgrammar reads the first of these a schema has and ignores every other
# assertion beside it (``{"type": "object", "properties": ..., "anyOf":
# [{"required": ["a"]}]}`` is the anyOf alone).
_EXCLUSIVE = ("$ref", "const", "enum", "anyOf", "oneOf", "allOf")
_ASSERTIONS = frozenset(_EXCLUSIVE + (
    "type", "properties", "patternProperties", "additionalProperties",
    "unevaluatedProperties", "required", "minProperties", "maxProperties",
    "propertyNames", "dependencies", "dependentRequired", "dependentSchemas",
    "items", "prefixItems", "additionalItems", "unevaluatedItems", "minItems",
    "maxItems", "uniqueItems", "contains", "minContains", "maxContains",
    "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "not", "if", "then",
    "else"))


def _types(node: dict) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


def subschemas(node: dict):
    """Every schema directly inside ``node``: the values of its maps of
    schemas and its schema-valued keywords (lists expanded)."""
    for key in _SCHEMA_MAPS:
        sub = node.get(key)
        if isinstance(sub, dict):
            yield from sub.values()
    for key in _SUBSCHEMAS:
        sub = node.get(key)
        if isinstance(sub, list):
            yield from sub
        elif isinstance(sub, dict):
            yield sub


def native_schema(schema: Any) -> Any:
    """A copy of ``schema`` that llguidance compiles to the language vLLM's
    native backend (xgrammar, strict mode) compiles it to."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        first = next((k for k in _EXCLUSIVE if k in node), None)
        if first is not None:
            for key in [k for k in node if k in _ASSERTIONS and k != first]:
                del node[key]
        if isinstance(node.get("pattern"), str):
            node["pattern"] = _full_match(node["pattern"])
        if isinstance(node.get("patternProperties"), dict):
            node["patternProperties"] = {
                _full_match(k): v for k, v in node["patternProperties"].items()}
        for sub in subschemas(node):
            walk(sub)

        if "type" not in node:
            if isinstance(node.get("properties"), dict):
                node["type"] = "object"
            elif "items" in node or "prefixItems" in node:
                node["type"] = "array"
        types = _types(node)
        if ("object" in types and any(k in node for k in _OBJECT_KEYS)
                and "additionalProperties" not in node
                and "unevaluatedProperties" not in node):
            node["additionalProperties"] = False
        if isinstance(node.get("required"), list) and "patternProperties" not in node:
            listed = node.get("properties")
            listed = listed if isinstance(listed, dict) else {}
            node["required"] = [r for r in node["required"] if r in listed]
        if ("array" in types or not types) and isinstance(node.get("prefixItems"), list) \
                and "items" not in node and "unevaluatedItems" not in node:
            node["items"] = False

    walk(schema)
    return schema


def _full_match(pattern: str) -> str:
    """xgrammar matches a ``pattern`` against the whole string; llguidance,
    as JSON Schema, searches for it unless it starts with ``^`` and ends with
    ``$`` (and takes anchors nowhere else), so the ends are anchored and the
    pattern's own end anchors dropped."""
    body = pattern[1:] if pattern.startswith("^") else pattern
    if body.endswith("$") and not _escaped_at(body, len(body) - 1):
        body = body[:-1]
    return f"^(?:{body})$"


def _escaped_at(text: str, i: int) -> bool:
    n = 0
    while i - 1 - n >= 0 and text[i - 1 - n] == "\\":
        n += 1
    return n % 2 == 1
