"""Chat templates: the Jinja programs models ship to turn a conversation into a prompt.

Rendered the way transformers renders them (sandboxed, `trim_blocks`, `lstrip_blocks`, a
`raise_exception` helper and a `tojson` that leaves non-ASCII text alone) so that a model's
template produces the same prompt here as it does there.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, NoReturn

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import ChatTemplateError


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template plus the special-token strings templates refer to."""

    def __init__(self, source: str, special_tokens: Mapping[str, str | None]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"chat template does not compile: {exc.message} (line {exc.lineno})") from exc
        self.source = source
        self._special_tokens = dict(special_tokens)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        try:
            return self._template.render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **self._special_tokens)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template rejected the conversation: {exc}") from exc
