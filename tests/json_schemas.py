"""JSON schemas that constrained decoding is tested with, in the engine (tests/unit/engine/
test_grammar.py) and through the server (tests/integration/engine/test_structured_output.py):
nested objects, a bounded array, enums (untyped and typed) and bounded numbers."""

from __future__ import annotations

SCHEMAS = {
    "nested": {
        "type": "object",
        "required": ["user", "ok"],
        "properties": {
            "user": {
                "type": "object",
                "required": ["name", "id"],
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "id": {"type": "integer", "minimum": 1, "maximum": 999},
                },
            },
            "ok": {"type": "boolean"},
        },
    },
    "array": {
        "type": "object",
        "required": ["items"],
        "properties": {
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
            }
        },
    },
    "enum": {
        "type": "object",
        "required": ["color", "size"],
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L"]},
        },
    },
    "bounded": {
        "type": "object",
        "required": ["x", "p"],
        "properties": {
            "x": {"type": "integer", "minimum": 10, "maximum": 20},
            "p": {"type": "number", "minimum": 0, "maximum": 1},
        },
    },
}
