"""The tools, and the question about them, that the function-calling tests send, in every call format."""

from __future__ import annotations

from typing import Any

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]},
                                             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]
SCHEMAS = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object"}) for tool in TOOLS}
"""Each tool's arguments' schema (a tool without parameters takes any object)."""
PROMPT: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
