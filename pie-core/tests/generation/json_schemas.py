"""Fifty JSON schemas of increasing difficulty, for constrained generation's tests and benchmark.

From single values through flat and nested objects, bounded arrays, enums, string formats and
patterns, to ``anyOf``/``oneOf``, ``$ref`` and recursion, and schemas as pydantic and OpenAI's
strict mode write them. Each entry is ``(name, schema)``; the names are stable test ids.
``benchmarks/constrained_decode.py`` reads this file too.
"""

from __future__ import annotations

from typing import Any

_SHORT = {"type": "string", "maxLength": 12}

SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    # -- single values -------------------------------------------------------------------
    ("boolean", {"type": "boolean"}),
    ("null", {"type": "null"}),
    ("integer", {"type": "integer"}),
    ("number", {"type": "number"}),
    ("short_string", {"type": "string", "maxLength": 8}),
    ("string_enum", {"enum": ["red", "green", "blue"]}),
    ("const", {"const": "fixed value"}),
    ("integer_range", {"type": "integer", "minimum": -5, "maximum": 5}),
    ("number_range", {"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    ("string_length", {"type": "string", "minLength": 3, "maxLength": 6}),
    # -- flat objects and arrays ---------------------------------------------------------
    ("object_required", {
        "type": "object",
        "properties": {"name": _SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"],
    }),
    ("object_optional", {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "note": _SHORT, "done": {"type": "boolean"}},
        "required": ["id"],
        "additionalProperties": False,
    }),
    ("object_enum_field", {
        "type": "object",
        "properties": {"status": {"enum": ["open", "closed", "pending"]}, "count": {"type": "integer"}},
        "required": ["status", "count"],
        "additionalProperties": False,
    }),
    ("array_strings_bounded", {"type": "array", "items": _SHORT, "minItems": 1, "maxItems": 3}),
    ("array_integers_bounded", {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 2, "maxItems": 4,
    }),
    ("tuple_prefix_items", {
        "type": "array",
        "prefixItems": [{"type": "string", "maxLength": 5}, {"type": "integer"}, {"type": "boolean"}],
        "items": False,
    }),
    ("string_pattern", {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}),
    ("integer_multiple_of", {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
    ("exclusive_bounds", {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}),
    ("empty_array_allowed", {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}),
    # -- nested objects and string formats -----------------------------------------------
    ("nested_object", {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"first": _SHORT, "last": _SHORT},
                "required": ["first", "last"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    }),
    ("array_of_objects", {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"sku": {"type": "string", "pattern": "^[a-z]{3}[0-9]{2}$"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    }),
    ("format_date", {"type": "string", "format": "date"}),
    ("format_time", {"type": "string", "format": "time"}),
    ("format_date_time", {"type": "string", "format": "date-time"}),
    ("format_email", {"type": "string", "format": "email"}),
    ("format_uuid", {"type": "string", "format": "uuid"}),
    ("format_ipv4", {"type": "string", "format": "ipv4"}),
    ("format_ipv6", {"type": "string", "format": "ipv6"}),
    ("object_with_formats", {
        "type": "object",
        "properties": {
            "id": {"type": "string", "format": "uuid"},
            "born": {"type": "string", "format": "date"},
            "contact": {"type": "string", "format": "email"},
        },
        "required": ["id", "born", "contact"],
        "additionalProperties": False,
    }),
    # -- unions, references, maps --------------------------------------------------------
    ("any_of_primitives", {"anyOf": [{"type": "integer"}, {"type": "boolean"}, {"type": "null"}]}),
    ("nullable_type_list", {
        "type": "object",
        "properties": {"middle_name": {"type": ["string", "null"], "maxLength": 10}},
        "required": ["middle_name"],
        "additionalProperties": False,
    }),
    ("any_of_objects", {
        "anyOf": [
            {"type": "object", "properties": {"circle": {"type": "number", "minimum": 0}}, "required": ["circle"],
             "additionalProperties": False},
            {"type": "object", "properties": {"w": {"type": "integer"}, "h": {"type": "integer"}}, "required": ["w", "h"],
             "additionalProperties": False},
        ],
    }),
    ("one_of_discriminated", {
        "oneOf": [
            {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "maximum": 9}},
             "required": ["kind", "lives"], "additionalProperties": False},
            {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
             "required": ["kind", "good"], "additionalProperties": False},
        ],
    }),
    ("all_of_merge", {
        "allOf": [
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]},
        ],
    }),
    ("defs_and_ref", {
        "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "type": "object",
        "properties": {"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}},
        "required": ["start", "end"],
        "additionalProperties": False,
    }),
    ("map_of_integers", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
    ("mixed_enum", {"enum": [1, "two", None, True, 4.5]}),
    ("unique_tags", {"type": "array", "items": {"enum": ["a", "b", "c", "d"]}, "uniqueItems": True, "maxItems": 4}),
    ("min_max_properties", {
        "type": "object",
        "properties": {"p": {"type": "integer"}, "q": {"type": "integer"}, "r": {"type": "integer"}},
        "minProperties": 1,
        "maxProperties": 2,
        "additionalProperties": False,
    }),
    # -- deep, recursive, real-world shapes ----------------------------------------------
    ("deep_nesting", {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
            "c": {"type": "object", "properties": {"d": {"type": "integer"}}, "required": ["d"], "additionalProperties": False},
        }, "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"],
        "additionalProperties": False,
    }),
    ("matrix", {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2},
        "minItems": 2,
        "maxItems": 2,
    }),
    ("recursive_tree", {
        "$defs": {"node": {
            "type": "object",
            "properties": {"v": {"type": "integer"},
                           "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
            "required": ["v", "kids"],
            "additionalProperties": False,
        }},
        "$ref": "#/$defs/node",
    }),
    ("wide_record", {
        "type": "object",
        "properties": {f"f{i}": ({"type": "integer"} if i % 3 == 0 else {"type": "boolean"} if i % 3 == 1 else _SHORT)
                       for i in range(12)},
        "required": [f"f{i}" for i in range(12)],
        "additionalProperties": False,
    }),
    ("pydantic_model", {
        "$defs": {"Color": {"enum": ["red", "green"], "title": "Color", "type": "string"}},
        "properties": {
            "name": {"title": "Name", "type": "string", "maxLength": 10},
            "color": {"$ref": "#/$defs/Color"},
            "size": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "Size"},
        },
        "required": ["name", "color"],
        "title": "Item",
        "type": "object",
    }),
    ("openai_strict", {
        "type": "object",
        "properties": {
            "steps": {"type": "array", "items": {
                "type": "object",
                "properties": {"explanation": _SHORT, "output": _SHORT},
                "required": ["explanation", "output"],
                "additionalProperties": False,
            }, "maxItems": 2},
            "final_answer": _SHORT,
        },
        "required": ["steps", "final_answer"],
        "additionalProperties": False,
    }),
    ("event_record", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "minLength": 1, "maxLength": 16},
            "when": {"type": "string", "format": "date-time"},
            "where": {"anyOf": [{"type": "string", "format": "ipv4"}, {"type": "null"}]},
            "attendees": {"type": "array", "items": {"type": "string", "format": "email"}, "maxItems": 2},
            "priority": {"enum": ["low", "high"]},
        },
        "required": ["title", "when", "attendees", "priority"],
        "additionalProperties": False,
    }),
    ("geo_feature", {
        "type": "object",
        "properties": {
            "type": {"const": "Feature"},
            "geometry": {"type": "object", "properties": {
                "type": {"const": "Point"},
                "coordinates": {"type": "array", "prefixItems": [
                    {"type": "number", "minimum": -180, "maximum": 180},
                    {"type": "number", "minimum": -90, "maximum": 90},
                ], "items": False, "minItems": 2},
            }, "required": ["type", "coordinates"], "additionalProperties": False},
            "properties": {"type": "object", "additionalProperties": {"type": ["string", "number"], "maxLength": 8},
                           "maxProperties": 2},
        },
        "required": ["type", "geometry", "properties"],
        "additionalProperties": False,
    }),
    ("array_of_unions", {
        "type": "array",
        "items": {"anyOf": [
            {"type": "string", "pattern": "^[a-z]{1,4}$"},
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "object", "properties": {"k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": False},
        ]},
        "minItems": 1,
        "maxItems": 4,
    }),
    ("invoice", {
        "$defs": {
            "money": {"type": "object", "properties": {"amount": {"type": "number", "minimum": 0},
                                                       "currency": {"enum": ["EUR", "USD"]}},
                      "required": ["amount", "currency"], "additionalProperties": False},
            "line": {"type": "object", "properties": {"what": _SHORT, "price": {"$ref": "#/$defs/money"},
                                                      "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
                     "required": ["what", "price", "qty"], "additionalProperties": False},
        },
        "type": "object",
        "properties": {
            "number": {"type": "string", "pattern": "^INV-[0-9]{4}$"},
            "issued": {"type": "string", "format": "date"},
            "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 2},
            "total": {"$ref": "#/$defs/money"},
            "paid": {"type": "boolean"},
        },
        "required": ["number", "issued", "lines", "total", "paid"],
        "additionalProperties": False,
    }),
]

assert len(SCHEMAS) == 50, len(SCHEMAS)
assert len({name for name, _ in SCHEMAS}) == len(SCHEMAS)
