"""vLLM's own structured-output spec -> the llguidance grammar to draft with.

Grammar-forced drafts follow each request's grammar with a matcher of our own,
in the worker; vLLM's grammar lives in the scheduler and checks our drafts
again there (``StructuredOutputManager.validate_tokens``). Drafts are only
proposals, so a difference between the two grammars can cost accepted tokens,
never correctness. To force as much as vLLM's grammar forces, and nothing it
does not, we rebuild the grammar as the request's backend builds it:

* ``json`` / ``json_object``: whitespace as the engine's
  ``structured_outputs_config.disable_any_whitespace`` says (vLLM's default:
  any JSON whitespace). xgrammar (vLLM's ``auto`` choice for JSON) compiles in
  strict mode, where objects without ``additionalProperties`` take no extra
  keys; guidance does the same only with ``disable_additional_properties``.
  We add ``"additionalProperties": false`` in exactly those cases.
* ``regex``: as is. ``grammar``: Lark or GBNF (llguidance converts GBNF).
  ``choice``: one alternative per string.
* ``structural_tag`` and anything else: no grammar; the request gets its inner
  proposer's draft only.

JSON schemas and regexes compile through ``spec`` (the same cached compiler
the grammar logits processor uses).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance

from vllm_plugins.grammar.native_json import subschemas
from vllm_plugins.grammar.spec import (
    CompiledGrammar,
    GrammarSpecError,
    compile_grammar_request,
    nested_too_deeply,
)


def close_objects(schema: Any) -> Any:
    """A copy where every object schema with ``properties`` and no
    ``additionalProperties`` gets ``"additionalProperties": false`` (what
    xgrammar's strict mode, vLLM's default, enforces)."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if not isinstance(node, dict):
            return
        for sub in subschemas(node):
            walk(sub)
        if "additionalProperties" not in node and (
                isinstance(node.get("properties"), dict)
                or isinstance(node.get("patternProperties"), dict)):
            node["additionalProperties"] = False

    walk(schema)
    return schema


def backend_closes_objects(backend: str | None, so_config: Any) -> bool:
    """Whether the request's backend refuses keys the schema does not list."""
    if backend is None:
        return False
    if backend.startswith("xgrammar"):
        return True
    if backend.startswith("guidance"):
        return bool(getattr(so_config, "disable_additional_properties", False))
    return False


def grammar_for(structured_outputs: Any, so_config: Any = None) -> CompiledGrammar | None:
    """The llguidance grammar for a request's ``StructuredOutputsParams``, or
    None when it has none we can follow. Raises ``GrammarSpecError`` when the
    spec does not compile for llguidance (vLLM may still serve it, e.g. with
    xgrammar; the caller then drafts without the grammar), nesting too deep
    for Python to read included."""
    if structured_outputs is None:
        return None
    try:
        return _grammar_for(structured_outputs, so_config)
    except RecursionError:
        raise GrammarSpecError(nested_too_deeply("structured_outputs")) from None


def _grammar_for(structured_outputs: Any, so_config: Any) -> CompiledGrammar | None:
    so = structured_outputs
    flexible = not bool(getattr(so_config, "disable_any_whitespace", False))
    backend = getattr(so, "_backend", None) or getattr(so_config, "backend", None)
    if so.json is not None:
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise GrammarSpecError(f"structured_outputs.json is not JSON: {e}") from e
        if isinstance(schema, dict) and backend_closes_objects(backend, so_config):
            schema = close_objects(schema)
        # spec's default reading is xgrammar's (native_json); guidance reads
        # the schema as JSON Schema does.
        xgrammar = bool(backend) and backend.startswith("xgrammar")
        return compile_grammar_request({"json_schema": schema,
                                        "whitespace_flexible": flexible,
                                        "json_schema_faithful": not xgrammar})
    if so.json_object:
        return compile_grammar_request({"json_object": True,
                                        "whitespace_flexible": flexible})
    if so.regex is not None:
        return compile_grammar_request({"regex": so.regex})
    if so.grammar is not None:
        return _checked("grammar", llguidance.grammar_from("grammar", so.grammar))
    if so.choice is not None:
        return _checked("choice", llguidance.grammar_from("choice", list(so.choice)))
    return None


def _checked(kind: str, grammar: str) -> CompiledGrammar:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        msg = messages[0].strip() if messages else "unknown error"
        raise GrammarSpecError(f"structured_outputs.{kind} does not compile: {msg}")
    return CompiledGrammar(kind, grammar, tuple(messages))
