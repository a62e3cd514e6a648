"""Function calling: a request's ``tools`` and ``tool_choice`` checked, the calls a model writes read out of its
text, and the grammar that makes it write them where the request requires a call.

A model writes a tool call in the format its chat template teaches it; the template is read for which one
(:func:`call_format`). A format is one :class:`CallFormat`: the tag that opens a call, the one that ends it (or none:
the calls run to the end of the reply), a function that reads the text between them, and the grammar of valid calls.
Known here, in :data:`FORMATS`:

- Hermes's ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (Qwen2.5, Qwen3, Hermes 2 and 3, and
  the templates made after them), anywhere in the reply, each call in its tags;
- Llama 3.1/3.2/3.3's JSON: the reply is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` read too), after an
  optional ``<|python_tag|>``, several separated by ``;``; only a reply that starts with it is a call;
- Mistral's ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (v3 and Nemo templates): its calls run from the
  tag to the end of the reply. The later ``[TOOL_CALLS]name[ARGS]{...}`` form is not read.

``<|python_tag|>`` and ``[TOOL_CALLS]`` are control tokens in those models' tokenizers, which the decoder leaves out of
the text: a reply that starts with the call itself (``{`` for Llama, ``[`` for Mistral) is read as if the tag opened it.

Reading is one pass over the text (:class:`CallReader`), fed the whole text or a stream's pieces alike, so that a
stream and a whole response say the same. Text that looks like a call but is not one (not JSON, a tool not given)
stays content.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    id: str

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


Call = tuple[str, str]
"""A call as read: the function's name and its arguments as JSON text."""
ReadCalls = Callable[[str, Mapping[str, Any]], list[Call] | None]
"""Reads the text a format's tags hold, given the tools by name: its calls (one for a format with an end tag), or
None where it is not calls."""
CallGrammar = Callable[[Mapping[str, Any], bool], str]
"""The Lark grammar (llguidance's) of calls of the given tools (name to parameters), several or one (False)."""


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str
    """The tag that opens a call (or, with no ``end``, the calls)."""
    end: str | None
    """The tag that ends a call; None: the calls run to the end of the reply."""
    read: ReadCalls
    grammar: CallGrammar
    bare: str = ""
    """With no ``end``: how the calls begin where ``start`` (a control token, left out of the text) is not written; a
    reply that starts with it is read as calls."""
    leading: bool = False
    """Calls only at the start of a reply (after whitespace): ``start`` later on is content."""
    marker: str = ""
    """The pattern (a regular expression) that a chat template teaching this format matches (``start`` where
    empty)."""
    call_id: Callable[[], str] = lambda: f"call_{secrets.token_hex(12)}"
    """A new call's id (Mistral's templates refuse one that is not 9 letters and digits)."""


def _call(call: Any, tools: Mapping[str, Any], key: str = "arguments") -> Call | None:
    """A call written as JSON, ``{"name": ..., key: {...}}`` (the arguments an object, or one as JSON text); None where
    it is not a call of one of the tools."""
    if not isinstance(call, dict) or call.get("name") not in tools:
        return None
    arguments = call.get(key, {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text, as OpenAI sends them
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def _read_hermes(body: str, tools: Mapping[str, Any]) -> list[Call] | None:
    call = _call(_json(body), tools)
    return None if call is None else [call]


def _read_llama(body: str, tools: Mapping[str, Any]) -> list[Call] | None:
    """One call or several separated by ``;``, each with its ``parameters`` (or ``arguments``)."""
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        call = _call(value, tools, "parameters" if isinstance(value, dict) and "parameters" in value else "arguments")
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if rest and not rest.startswith(";"):
            return None
        at = len(body) - len(rest[1:].lstrip()) if rest else len(body)
    return calls or None


def _read_mistral(body: str, tools: Mapping[str, Any]) -> list[Call] | None:
    """A JSON array of calls (one object alone read as well)."""
    value = _json(body)
    read = [_call(call, tools) for call in (value if isinstance(value, list) else [value])]
    calls = [call for call in read if call is not None]
    return calls if calls and len(calls) == len(read) else None


def _calls_grammar(tools: Mapping[str, Any], separator: str | None, key: str = "arguments", around: str = "",
                   inside: tuple[str, str] = ("", "")) -> str:
    """The grammar of calls ``{"name": ..., key: {...}}`` of the tools: one, or several with ``separator`` between
    them (None: one); each inside the tags ``inside``, all inside the two halves of ``around`` ("[]")."""
    more = f" ({json.dumps(separator)} call)*" if separator is not None else ""
    calls = f"call{more}"
    if around:
        calls = f"{json.dumps(around[0])} {calls} {json.dumps(around[1])}"
    rules = [f"start: {calls}", "call: " + " | ".join(f"call_{i}" for i in range(len(tools)))]
    for i, (name, parameters) in enumerate(tools.items()):
        head = json.dumps(inside[0] + json.dumps({"name": name, key: 0})[:-2])  # up to the arguments
        rules.append(f"call_{i}: {head} arguments_{i} {json.dumps('}' + inside[1])}")
        rules.append(f"arguments_{i}: %json {json.dumps({'x-guidance': JSON_STYLE, **parameters})}")
    return "\n".join(rules) + "\n"


def _hermes_grammar(tools: Mapping[str, Any], several: bool) -> str:
    return _calls_grammar(tools, "\n" if several else None, inside=("<tool_call>\n", "\n</tool_call>"))


def _llama_grammar(tools: Mapping[str, Any], several: bool) -> str:
    """One call, whatever ``several`` says: Llama 3.1's template shows one call a turn (it refuses more)."""
    return _calls_grammar(tools, None, "parameters")


def _mistral_grammar(tools: Mapping[str, Any], several: bool) -> str:
    """The array the tag opens, without the tag (a control token, which the text of a grammar cannot name)."""
    return _calls_grammar(tools, ", " if several else None, around="[]")


def _mistral_id() -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", _read_hermes, _hermes_grammar)
MISTRAL = CallFormat("mistral", "[TOOL_CALLS]", None, _read_mistral, _mistral_grammar, bare="[", call_id=_mistral_id,
                     marker=r"(?s)\A(?!.*\[ARGS\]).*\[TOOL_CALLS\]")
LLAMA = CallFormat("llama", "<|python_tag|>", None, _read_llama, _llama_grammar, bare="{", leading=True,
                   marker='"parameters"')
FORMATS = (HERMES, MISTRAL, LLAMA)
"""In the order a template is tried against them. Mistral's marker is its tag, in a template that never writes
``[ARGS]``: the later templates that write ``[TOOL_CALLS]name[ARGS]`` teach a format not read here. Llama's marker
is ``"parameters"`` in quotes: Meta's 3.1, 3.2 and 3.3 templates (and vLLM's llama3_json one) write a call's
arguments under that key and teach it in the prompt ("Respond in the format {"name": function name, "parameters":
...}"), where ``<|python_tag|>`` is only in those with built-in tools. It is the loosest marker (a template that
writes JSON Schemas out by hand may spell it), so it comes last."""


def call_format(chat_template: str) -> CallFormat | None:
    """The format the model writes calls in, as its chat template shows them; None for one not known here."""
    return next((known for known in FORMATS if re.search(known.marker or re.escape(known.start), chat_template)), None)


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
                                   "write them, Llama 3.1's JSON and Mistral's [TOOL_CALLS]); tool_choice \"none\" "
                                   "shows the tools without reading calls")
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
    is held until it is known: with a format whose calls run to the end of the reply, from their start to the end. A
    call that is not one (not JSON, a tool not given) is content; so is one past ``limit`` in a format with an end
    tag, where a format without one keeps the first ``limit`` calls of its one block of them and drops the others."""

    def __init__(self, form: CallFormat, tools: Mapping[str, Any], limit: int | None = None):
        self.form = form
        self.tools = tools
        self.limit = limit
        self.calls = 0
        self._tail = ""
        self._after_call = False
        self._started = False
        """Whether the reply's start is known (a format without an end tag reads it for a bare call)."""
        self._to_end = False
        """Whether the rest of the text is held, as calls (a format without an end tag)."""

    def push(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content that ``text`` (the next piece) lets out, and the calls it completes."""
        self._tail += text
        if self.form.end is None:
            return self._push_to_end(), []
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
            read = None
            if self.limit is None or self.calls < self.limit:
                read = self.form.read(self._tail[start + len(start_tag):end].strip(), self.tools)
            if read is None:
                content.append(self._tail[:after])
            else:
                content.append(self._tail[:start].rstrip())
                calls += self._made(read)
                self._after_call = True
            self._tail = self._tail[after:]
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """The content held at the end of the text, and the calls it ends (a format without an end tag's)."""
        rest, self._tail = ("" if self._after_call else self._tail), ""
        if not self._to_end:
            return rest, []
        body = rest.lstrip()
        body = body[len(self.form.start):] if body.startswith(self.form.start) else body
        read = self.form.read(body.strip(), self.tools)
        return ("", self._made(read[:self.limit])) if read else (rest, [])

    def _made(self, read: list[Call]) -> list[ToolCall]:
        self.calls += len(read)
        return [ToolCall(name, arguments, self.form.call_id()) for name, arguments in read]

    def _push_to_end(self) -> str:
        """The content let out where the calls run from their start to the end of the reply."""
        if self._to_end:
            return ""
        if not self._started:
            begun = self._tail.lstrip()
            if begun.startswith(self.form.start) or (self.form.bare and begun.startswith(self.form.bare)):
                self._to_end = True
                return ""
            if self.form.start.startswith(begun):  # whitespace, or what may be the start of the tag
                return ""
            self._started = True
        if self.form.leading:
            content, self._tail = self._tail, ""
            return content
        start = self._tail.find(self.form.start)
        if start < 0:
            held = self._partial_tag()
        else:
            held = len(self._tail[:start].rstrip())
            self._to_end = True
        content, self._tail = self._tail[:held], self._tail[held:]
        return content

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
    rest, more = reader.flush()
    content, calls = content + rest, calls + more
    return (content or None) if calls else content, calls
