"""The JSON schemas of the structured-outputs benchmark, and the check of an output against its
schema. No imports beyond the standard library (jsonschema when present): the vLLM side
(benchmarks/vllm_structured.py, run with vLLM's own site-packages) reads this file too.

Four shapes an application asks for: a user record, an order with line items, a calendar event
with attendees, a product review. Every string has a maxLength and every array a maxItems, so
that an output ends within a few hundred tokens; integers are bounded; all properties required.
"""

from __future__ import annotations

import json
from random import Random

SCHEMAS: list[dict] = [
    {
        "title": "user",
        "type": "object",
        "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "minLength": 3, "maxLength": 64},
            "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
            "active": {"type": "boolean"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 6},
            "address": {
                "type": "object",
                "properties": {
                    "street": {"type": "string", "maxLength": 60},
                    "city": {"type": "string", "maxLength": 40},
                    "postcode": {"type": "string", "maxLength": 10},
                    "country": {"type": "string", "enum": ["DE", "FR", "GB", "US", "JP", "BR", "IN"]},
                },
                "required": ["street", "city", "postcode", "country"],
            },
        },
        "required": ["name", "age", "email", "role", "active", "tags", "address"],
    },
    {
        "title": "order",
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "minLength": 6, "maxLength": 20},
            "customer": {"type": "string", "maxLength": 50},
            "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "minLength": 4, "maxLength": 16},
                        "description": {"type": "string", "maxLength": 60},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                        "unit_price_cents": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    },
                    "required": ["sku", "description", "quantity", "unit_price_cents"],
                },
            },
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "customer", "status", "items", "gift"],
    },
    {
        "title": "event",
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 80},
            "day": {"type": "integer", "minimum": 1, "maximum": 31},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
            "duration_minutes": {"type": "integer", "minimum": 5, "maximum": 600},
            "priority": {"type": "string", "enum": ["low", "normal", "high", "urgent"]},
            "attendees": {
                "type": "array",
                "minItems": 1,
                "maxItems": 6,
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "maxLength": 40},
                        "optional": {"type": "boolean"},
                    },
                    "required": ["name", "optional"],
                },
            },
            "notes": {"type": "string", "maxLength": 200},
        },
        "required": ["title", "day", "month", "duration_minutes", "priority", "attendees", "notes"],
    },
    {
        "title": "review",
        "type": "object",
        "properties": {
            "product": {"type": "string", "minLength": 1, "maxLength": 50},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "pros": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 5},
            "cons": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 5},
            "summary": {"type": "string", "minLength": 10, "maxLength": 300},
            "recommend": {"type": "boolean"},
        },
        "required": ["product", "rating", "pros", "cons", "summary", "recommend"],
    },
]


def assign(num_seqs: int, fraction: float, seed: int = 0) -> list[int | None]:
    """Which schema each request of the workload gets (None: unconstrained): a fixed random
    `fraction` of the requests, the schemas in turn among them."""
    chosen = sorted(Random(seed).sample(range(num_seqs), round(num_seqs * fraction)))
    out: list[int | None] = [None] * num_seqs
    for k, i in enumerate(chosen):
        out[i] = k % len(SCHEMAS)
    return out


def _check(value, schema: dict, path: str) -> str | None:
    """A small validator for the keywords SCHEMAS use (where jsonschema is not installed)."""
    t = schema.get("type")
    if "enum" in schema and value not in schema["enum"]:
        return f"{path}: {value!r} not in enum"
    if t == "object":
        if not isinstance(value, dict):
            return f"{path}: not an object"
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            if k not in value:
                return f"{path}: missing {k}"
        for k, v in value.items():
            if k not in props:
                return f"{path}: unexpected {k}"
            err = _check(v, props[k], f"{path}.{k}")
            if err:
                return err
    elif t == "array":
        if not isinstance(value, list):
            return f"{path}: not an array"
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 60):
            return f"{path}: {len(value)} items"
        for i, v in enumerate(value):
            err = _check(v, schema["items"], f"{path}[{i}]")
            if err:
                return err
    elif t == "string":
        if not isinstance(value, str):
            return f"{path}: not a string"
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 60):
            return f"{path}: length {len(value)}"
    elif t == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{path}: not an integer"
        if not schema.get("minimum", -(1 << 63)) <= value <= schema.get("maximum", 1 << 63):
            return f"{path}: {value} out of range"
    elif t == "boolean" and not isinstance(value, bool):
        return f"{path}: not a boolean"
    return None


def validate(text: str, schema_index: int) -> str | None:
    """None when `text` is JSON (strict: no raw control characters in strings) that validates
    against SCHEMAS[schema_index]; else why not."""
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"not JSON: {e}"
    schema = SCHEMAS[schema_index]
    try:
        import jsonschema
    except ImportError:
        return _check(value, schema, "$")
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(value), key=str)
    return f"{errors[0].json_path}: {errors[0].message}" if errors else None


def validator_name() -> str:
    try:
        import jsonschema

        return f"jsonschema {jsonschema.__version__}" if hasattr(jsonschema, "__version__") else "jsonschema"
    except ImportError:
        return "json.loads + structured_schemas._check"
