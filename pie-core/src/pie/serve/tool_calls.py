"""Function calling: a request's ``tools`` and ``tool_choice`` checked, the calls a model writes read out of its
text, and the grammar that makes it write them where the request requires a call.

A model writes a tool call in the format its chat template teaches it; the template is read for which one
(:func:`call_format`). A format is one :class:`CallFormat`: the tags around a call and a function that reads the
text between them. Known here: Hermes's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(Qwen2.5, Qwen3, Hermes 2 and 3, and the templates made after them). Another (Llama 3's bare JSON, Mistral's
``[TOOL_CALLS]``) is one more :class:`CallFormat` in :data:`FORMATS`.

Reading is one pass over the text (:class:`CallReader`), fed the whole text or a stream's pieces alike, so that a
stream and a whole response say the same. Text that looks like a call but is not one (not JSON, a tool not given)
stays content.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pie.generation.constraints import JSON_STYLE, TOO_DEEP, GrammarSpec
from pie.serve.protocol import ChatCompletionRequest, TokenizeRequest, bad_request, quoted, refuse_unknown_keywords

TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""A function's name as OpenAI takes it."""
MAX_TOOLS = 128
"""OpenAI's limit on a request's tools; past it, rendering them and compiling their call grammar cost seconds (the
grammar engine gives up somewhere past a thousand)."""
FUNCTION_KEYS = ("name", "description", "parameters", "strict")
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
"""The arguments of a function given no ``parameters``: none (OpenAI: "an empty parameter list")."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text (an object), as OpenAI sends them."""
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


ReadCall = Callable[[str, Mapping[str, Any]], ToolCall | None]
"""Reads the text between a call's tags, given the tools by name: the call, or None where it is not one."""
CallGrammar = Callable[[Mapping[str, Any], bool], str]
"""The Lark grammar (llguidance's) of calls of the given tools (name to parameters), several or one (False)."""


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str
    end: str
    read: ReadCall
    grammar: CallGrammar


def _read_hermes(body: str, tools: Mapping[str, Any]) -> ToolCall | None:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(call["name"], json.dumps(arguments, ensure_ascii=False))


def _hermes_grammar(tools: Mapping[str, Any], several: bool) -> str:
    more = ' ("\\n" call)*' if several else ""
    rules = [f"start: call{more}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools.items()):
        head = json.dumps(f'<tool_call>\n{{"name": "{name}", "arguments": ')
        rules.append(f'call_{i}: {head} arguments_{i} "}}\\n</tool_call>"')
        rules.append(f"arguments_{i}: %json {json.dumps({'x-guidance': JSON_STYLE, **parameters})}")
    return "\n".join(rules) + "\n"


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", _read_hermes, _hermes_grammar)
FORMATS = (HERMES,)


def call_format(chat_template: str) -> CallFormat | None:
    """The format the model writes calls in, as its chat template shows them; None for one not known here."""
    return next((known for known in FORMATS if known.start in chat_template), None)


def shows_tools(chat_template: str | None) -> bool:
    """Whether a chat template can show the tools it is given (it names them)."""
    return chat_template is not None and "tools" in chat_template


Choice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools, as its chat template is shown them, and what it asks the model to do with them."""

    tools: list[dict[str, Any]]
    parameters: dict[str, Any]
    """Each tool's name to its arguments' JSON schema."""
    choice: Choice
    named: str | None
    """The one function ``tool_choice`` names."""
    parallel: bool
    format: CallFormat | None

    @property
    def reads_calls(self) -> bool:
        return self.choice != "none"

    def grammar(self) -> GrammarSpec | None:
        """The constraint that makes the output calls: for tool_choice required (one or more, or one where
        parallel_tool_calls is false) or a named function (one call of it)."""
        if self.choice not in ("required", "named") or self.format is None:
            return None
        chosen = {self.named: self.parameters[self.named]} if self.named else self.parameters
        try:
            return GrammarSpec.grammar(self.format.grammar(chosen, self.parallel and not self.named))
        except RecursionError:  # a schema nested deeper than Python's JSON writer goes
            raise bad_request("tools", f"tools: {TOO_DEEP}") from None

    def reader(self) -> CallReader:
        assert self.format is not None
        return CallReader(self.format, self.parameters, 1 if self.named or not self.parallel else None)


def requested_tools(body: ChatCompletionRequest | TokenizeRequest, chat_template: str | None) -> ToolRequest | None:
    """The request's tools, checked (a 400 naming the field of what is wrong), or None where it gives none.
    /tokenize takes ``tools`` alone, to show them: the rest is a chat's."""
    parallel = body.parallel_tool_calls if isinstance(body, ChatCompletionRequest) else None
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", "parallel_tool_calls is true or false")
    choice_given = body.tool_choice if isinstance(body, ChatCompletionRequest) else "none"
    if body.tools is None:
        if choice_given not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice needs tools: this request gives none")
        return None
    if not isinstance(body.tools, list) or not body.tools:
        raise bad_request("tools", "tools is a list of at least one tool: {\"type\": \"function\", \"function\": "
                                   "{\"name\": ..., \"parameters\": {...}}}")
    if len(body.tools) > MAX_TOOLS:
        raise bad_request("tools", f"tools holds {len(body.tools)} tools; at most {MAX_TOOLS} are taken (as at OpenAI)")
    if not shows_tools(chat_template):
        raise bad_request("tools", "this model's chat template cannot show tools (it never mentions them): the "
                                   "model would not see them; send the request without tools")
    tools, parameters = [], {}
    for index, tool in enumerate(body.tools):
        name, schema = _checked_tool(tool, f"tools[{index}]")
        if name in parameters:
            raise bad_request(f"tools[{index}].function.name", f"tools[{index}].function.name: two tools are named "
                                                               f"{quoted(name)}")
        tools.append(tool)
        parameters[name] = schema
    choice, named = _checked_choice(choice_given, parameters)
    form = call_format(chat_template or "")
    if choice != "none" and form is None:
        raise bad_request("tools", "this model's chat template writes tool calls in a format this server does not "
                                   "read (it reads Hermes's <tool_call> tags, as Qwen's and Hermes's templates "
                                   "write them); tool_choice \"none\" shows the tools without reading calls")
    if choice in ("required", "named"):
        for other in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar"):
            if getattr(body, other) is not None:
                asked = '"required"' if choice == "required" else "naming a function"
                raise bad_request(other, f"{other} cannot be given with tool_choice {asked}: the output is then the "
                                         "tool calls")
    return ToolRequest(tools, parameters, choice, named, parallel is not False, form)


def _checked_tool(tool: Any, where: str) -> tuple[str, dict[str, Any]]:
    """A tool's name and its arguments' schema; a 400 naming what is wrong in it."""
    if not isinstance(tool, dict):
        raise bad_request(where, f"{where} is an object: {{\"type\": \"function\", \"function\": {{...}}}}")
    if tool.get("type") != "function":
        raise bad_request(f"{where}.type", f"{where}.type must be \"function\" (the only kind of tool this server "
                                           "calls)")
    for key in tool:
        if key not in ("type", "function"):
            raise bad_request(f"{where}.{key}", f"{where}.{key} is not a field this server knows; a tool has type "
                                                "and function")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise bad_request(f"{where}.function", f"{where}.function is an object with the function's name")
    for key in function:
        if key not in FUNCTION_KEYS:
            raise bad_request(f"{where}.function.{key}", f"{where}.function.{key} is not a field this server knows; "
                                                         f"a function has {', '.join(FUNCTION_KEYS)}")
    name = function.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad_request(f"{where}.function.name", f"{where}.function.name is 1 to 64 letters, digits, _ and -")
    if not isinstance(function.get("description", ""), str):
        raise bad_request(f"{where}.function.description", f"{where}.function.description is text")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict", f"{where}.function.strict is true or false")
    parameters = function.get("parameters", NO_PARAMETERS)
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad_request(f"{where}.function.parameters", f"{where}.function.parameters is a JSON Schema of an object "
                                                          "(type \"object\"): the arguments")
    if strict:
        refuse_unknown_keywords(parameters, f"{where}.function.parameters")
    return name, parameters


def _checked_choice(choice: Any, parameters: Mapping[str, Any]) -> tuple[Choice, str | None]:
    if choice is None or choice == "auto":
        return "auto", None
    if choice in ("none", "required"):
        return choice, None
    if isinstance(choice, dict) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in parameters:
            raise bad_request("tool_choice.function.name", f"tool_choice.function.name names no tool of this "
                                                           f"request's ({', '.join(parameters)})")
        return "named", name
    raise bad_request("tool_choice", "tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                     "\"function\": {\"name\": ...}}")


class CallReader:
    """Reads tool calls out of a choice's text as it comes: :meth:`push` each piece, then :meth:`flush`.

    Content is the text outside the calls, less the whitespace that touches a call (the newline before one, those
    between calls). Text that may yet start or hold a call (a partial tag, a call whose end has not come, whitespace)
    is held until it is known; a call that is not one (not JSON, a tool not given, one past ``limit``) is content."""

    def __init__(self, form: CallFormat, tools: Mapping[str, Any], limit: int | None = None):
        self.form = form
        self.tools = tools
        self.limit = limit
        self.calls = 0
        self._tail = ""
        self._after_call = False

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content that ``text`` (the next piece) lets out, and the calls it completes."""
        self._tail += text
        start_tag, end_tag = self.form.start, self.form.end
        content: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._after_call:
                self._tail = self._tail.lstrip()
                if not self._tail:
                    break
                self._after_call = False
            start = self._tail.find(start_tag)
            if start < 0:
                held = self._partial_tag()
                content.append(self._tail[:held])
                self._tail = self._tail[held:]
                break
            end = self._tail.find(end_tag, start + len(start_tag))
            if end < 0:
                before = len(self._tail[:start].rstrip())
                content.append(self._tail[:before])
                self._tail = self._tail[before:]
                break
            start = self._tail.rfind(start_tag, start, end)  # an earlier start tag, left open, is content
            after = end + len(end_tag)
            call = None
            if self.limit is None or self.calls < self.limit:
                call = self.form.read(self._tail[start + len(start_tag):end].strip(), self.tools)
            if call is None:
                content.append(self._tail[:after])
            else:
                content.append(self._tail[:start].rstrip())
                calls.append(call)
                self.calls += 1
                self._after_call = True
            self._tail = self._tail[after:]
        return "".join(content), calls

    def flush(self) -> str:
        """The content held at the end of the text."""
        rest, self._tail = ("" if self._after_call else self._tail), ""
        return rest

    def _partial_tag(self) -> int:
        """Where the held end of the tail starts: its whitespace, and what may be the start of a call's tag."""
        tail, tag = self._tail, self.form.start
        cut = len(tail)
        for size in range(min(len(tag) - 1, len(tail)), 0, -1):
            if tail.endswith(tag[:size]):
                cut -= size
                break
        return len(tail[:cut].rstrip())


def read_calls(reader: CallReader, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole text's content (None where nothing is left of it) and its calls."""
    content, calls = reader.push(text)
    content += reader.flush()
    return (content or None) if calls else content, calls
