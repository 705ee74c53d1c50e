"""Sample JSON documents for a JSON Schema: a small generator, checked by
``jsonschema``.

The grammar parity test needs, per schema, documents a grammar should accept
and documents that differ from them in one way (an extra key, other
whitespace). The generator writes values the way a model would (properties in
the schema's order, short strings, small numbers, well-known formats) and
keeps only those ``jsonschema`` validates, so a generator slip can cost a
document but never makes an invalid one count as valid.
"""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import jsonschema

FORMAT_EXAMPLES = {
    "date": "2024-05-17",
    "date-time": "2024-05-17T10:20:30Z",
    "time": "10:20:30Z",
    "email": "ann@example.com",
    "uri": "https://example.com/a",
    "uri-reference": "https://example.com/a",
    "url": "https://example.com/a",
    "uuid": "123e4567-e89b-12d3-a456-426614174000",
    "ipv4": "192.168.0.1",
    "ipv6": "2001:db8::1",
    "hostname": "example.com",
    "duration": "P3D",
}
WORDS = ["alpha", "blue", "Ann", "x", "New York", "ok", "value 7"]
EXTRA_KEY = "extra_key"


def _resolve(ref: str, root: dict) -> Any:
    if not ref.startswith("#"):
        raise LookupError(ref)
    node: Any = root
    for part in ref.lstrip("#").split("/"):
        if part:
            node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _merge(base: dict, extra: Any) -> dict:
    if not isinstance(extra, dict):
        return base
    out = dict(base)
    for k, v in extra.items():
        if k == "properties" and isinstance(out.get(k), dict) and isinstance(v, dict):
            out[k] = {**out[k], **v}
        elif k == "required" and isinstance(out.get(k), list) and isinstance(v, list):
            out[k] = out[k] + [r for r in v if r not in out[k]]
        else:
            out[k] = v
    return out


class _Gen:
    def __init__(self, root: Any, rng: random.Random):
        self.root = root
        self.rng = rng

    def value(self, s: Any, depth: int = 0) -> Any:
        if depth > 12:
            raise RecursionError("schema too deep for the sampler")
        if s is True or not isinstance(s, dict) or not s:
            return self.rng.choice([1, "x", True, None])
        if "$ref" in s:
            rest = {k: v for k, v in s.items() if k != "$ref"}
            return self.value(_merge(_resolve(s["$ref"], self.root), rest), depth + 1)
        if "const" in s:
            return copy.deepcopy(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return copy.deepcopy(self.rng.choice(s["enum"]))
        if isinstance(s.get("allOf"), list):
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for part in s["allOf"]:
                if isinstance(part, dict) and "$ref" in part:
                    part = _resolve(part["$ref"], self.root)
                merged = _merge(merged, part)
            return self.value(merged, depth + 1)
        for key in ("anyOf", "oneOf"):
            if isinstance(s.get(key), list) and s[key]:
                rest = {k: v for k, v in s.items() if k != key}
                return self.value(_merge(rest, self.rng.choice(s[key])), depth + 1)
        t = s.get("type")
        if isinstance(t, list):
            t = self.rng.choice(t) if t else None
        if t is None:
            t = ("object" if "properties" in s else
                 "array" if "items" in s or "prefixItems" in s else "string")
        return getattr(self, "_" + t)(s, depth)

    def _object(self, s, depth):
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        required = [r for r in s.get("required", []) if isinstance(r, str)]
        out = {}
        for name, sub in props.items():
            if name in required or self.rng.random() < 0.6:
                out[name] = self.value(sub, depth + 1)
        for name in required:
            if name not in out:
                out[name] = "x"
        addl = s.get("additionalProperties")
        if not props and isinstance(addl, dict):
            out["key1"] = self.value(addl, depth + 1)
        return out

    def _array(self, s, depth):
        prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
        out = [self.value(p, depth + 1) for p in prefix]
        items = s.get("items")
        if isinstance(items, dict):
            lo = s.get("minItems", 1)
            hi = s.get("maxItems", max(lo, 2))
            for _ in range(self.rng.randint(min(lo, hi), max(min(lo, hi), min(hi, 2)))):
                out.append(self.value(items, depth + 1))
        return out

    def _string(self, s, depth):
        if s.get("format") in FORMAT_EXAMPLES:
            return FORMAT_EXAMPLES[s["format"]]
        text = self.rng.choice(WORDS)
        lo, hi = s.get("minLength", 0), s.get("maxLength")
        while len(text) < lo:
            text += "a"
        return text[:hi] if isinstance(hi, int) else text

    def _number(self, s, depth, integer=False):
        lo = s.get("minimum", s.get("exclusiveMinimum", 0))
        hi = s.get("maximum", s.get("exclusiveMaximum", lo + 100))
        if integer:
            v = self.rng.randint(int(lo) + 1, max(int(lo) + 1, int(hi) - 1)) if hi - lo > 2 else int(lo)
        else:
            v = round(lo + (hi - lo) * self.rng.random(), 2)
        step = s.get("multipleOf")
        if isinstance(step, (int, float)) and step > 0:
            v = step * max(1, round(v / step))
            v = int(v) if integer or float(v).is_integer() and isinstance(step, int) else v
        return v

    def _integer(self, s, depth):
        return self._number(s, depth, integer=True)

    def _boolean(self, s, depth):
        return self.rng.random() < 0.5

    def _null(self, s, depth):
        return None


def valid_instances(schema: Any, n: int, seed: int = 0, tries: int = 12) -> list[Any]:
    """Up to ``n`` distinct documents that ``jsonschema`` validates against ``schema``."""
    rng = random.Random(seed)
    gen = _Gen(schema, rng)
    out, seen = [], set()
    validator = jsonschema.validators.validator_for(schema)(schema)
    for _ in range(tries):
        try:
            doc = gen.value(schema)
        except (LookupError, RecursionError, TypeError, ValueError, AttributeError):
            continue
        key = json.dumps(doc, sort_keys=False)
        if key in seen:
            continue
        try:
            if not validator.is_valid(doc):
                continue
        except (jsonschema.exceptions.SchemaError, jsonschema.exceptions.RefResolutionError):
            return out
        seen.add(key)
        out.append(doc)
        if len(out) >= n:
            break
    return out


def texts(doc: Any) -> dict[str, str]:
    """The document written compact, with spaces after separators, and
    indented: one language, three whitespace styles."""
    return {
        "compact": json.dumps(doc, ensure_ascii=False, separators=(",", ":")),
        "spaced": json.dumps(doc, ensure_ascii=False),
        "indented": json.dumps(doc, ensure_ascii=False, indent=2),
    }


def with_extra_keys(doc: Any) -> list[str]:
    """Texts of ``doc`` with one key the schema does not name: in the top
    object, and in the first nested object."""
    out = []
    if isinstance(doc, dict) and EXTRA_KEY not in doc:
        out.append(json.dumps({**doc, EXTRA_KEY: 1}, ensure_ascii=False))
        for k, v in doc.items():
            if isinstance(v, dict) and EXTRA_KEY not in v:
                out.append(json.dumps({**doc, k: {**v, EXTRA_KEY: 1}}, ensure_ascii=False))
                break
    return out
