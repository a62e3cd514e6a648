"""The OpenAI API as the server speaks it: request bodies (checked by pydantic) and response JSON.

A field the server does not know is refused with a 400 that names it (see :class:`KnownFields`), as OpenAI
refuses one: a misspelt option would otherwise change nothing, silently. Fields the server understands but
cannot honour, and that would change the result (the older ``functions`` and ``function_call``, images,
``suffix``, ``best_of`` other than ``n``, OpenAI's options for its own models such as ``reasoning_effort``), are
refused by :func:`refuse_unsupported` and :func:`message_text` with a 400 that names them, never silently dropped.

Function calling: a chat's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are read by
:mod:`pie.serve.tool_calls`; the messages' ``tool_calls`` and ``tool_call_id`` by :func:`template_messages`.

Constrained output (:func:`requested_grammar`): OpenAI's ``response_format`` (``json_schema``,
``json_object``), and vLLM's extra fields: ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``, ``json_object``) and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
``guided_grammar``. One per request.
"""

from __future__ import annotations

import codecs
import json
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pie.generation.constraints import GrammarError, GrammarSpec
from pie.serve.engine import Delta, TokenLogprob

MAX_CHOICES = 64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
"""A stop string is a few words (OpenAI states no bound); each one is followed on every token."""
MAX_TOP_LOGPROBS = 20
MAX_QUOTED_CHARS = 100
"""The most of a client's value (a name, a key, a field) an error quotes: an 8 MiB model name is not sent back."""
MAX_MESSAGE_CHARS = 1000
"""The most of a 400's message sent, past which it is cut."""


class APIError(Exception):
    """An error answered as OpenAI's error JSON with its HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        if self.status == 401:
            return "authentication_error"
        if self.status >= 500:
            return "server_error"
        return "invalid_request_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def event_body(self) -> dict[str, Any]:
        """The body of the event that ends a stream with this error: :meth:`body` and its HTTP ``status``, which the
        stream's head (200, sent before it failed) could not carry; the Ray ingress counts a replica's failure by it."""
        body = self.body()
        body["error"]["status"] = self.status
        return body


def bad_request(param: str | None, message: str) -> APIError:
    """A 400; its message is cut past ``MAX_MESSAGE_CHARS`` (one may carry an error's own text, quoting a client's
    grammar or template) and its parameter past ``MAX_QUOTED_CHARS`` (a client's key may be part of it)."""
    return APIError(400, shortened(message, MAX_MESSAGE_CHARS), param=None if param is None else shortened(param),
                    code="invalid_value" if param else None)


def shortened(text: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """``text``, or as much of it as fits ``limit`` characters with an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def field_path(location: Iterable[str | int]) -> str | None:
    """Where a field is in the body, as OpenAI's errors name it in ``param`` (and as this server's own do): a list's
    items by their index in brackets, ``messages[0].content[1].text``; each name shortened, an empty one written
    ``""``. None for the body."""
    path = ""
    for part in location:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            name = shortened(part) or '""'
            path += f".{name}" if path else name
    return path or None


def quoted(value: str) -> str:
    """``value`` as an error quotes it: its repr, shortened."""
    return shortened(repr(value))


class RequestBody(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _unicode_text(cls, value: Any) -> Any:
        """JSON's escapes can spell half of a UTF-16 pair (``"\\ud800"``), which is no Unicode text: no tokenizer
        or encoder takes it, so it is refused with the field, not met later as a fault."""
        _check_unicode(value)
        return value


def _check_unicode(value: Any) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"holds a lone surrogate ({value[exc.start]!r}) at character {exc.start}: "
                             "not Unicode text") from None
    elif isinstance(value, list):
        if all(type(item) is int for item in value):  # token ids: no text to check, and there may be many
            return
        for item in value:
            _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class KnownFields(RequestBody):
    """A request's top level (and its ``stream_options``): every field is one this server knows, in its own JSON
    type. An unknown field (a typo, or another server's option such as ``min_tokens``) is refused, as OpenAI refuses
    it, rather than ignored; a string is not read as a boolean or a number. Messages keep extra fields: clients
    send back the assistant messages they received, with fields only the response has."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _names_are_text(cls, data: Any) -> Any:
        """A field's name that holds half a UTF-16 pair (``"\\ud800"``) is no Unicode text, which pydantic refuses
        naming no field ("Input should be a valid string"): it is spelled with its escapes, and refused by that name
        as the unknown field it is (every field this server knows is ASCII)."""
        if not isinstance(data, dict):
            return data
        return {key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else key: value
                for key, value in data.items()}

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """An explicit null for a field whose default is not null (``n``, ``stream``...) is that default, as at
        OpenAI (whose fields are all "or null") and vLLM: clients that write an unset option as null are served as
        if they had left it out. A field that needs a value still refuses null, and any other value keeps its type."""
        if not isinstance(data, dict):
            return data
        defaulted = {name for name, field in cls.model_fields.items()
                     if not field.is_required() and field.default is not None}
        return {key: value for key, value in data.items() if value is not None or key not in defaulted}


class StreamOptions(KnownFields):
    """What a stream carries besides its choices.

    ``include_usage`` (OpenAI's): a last chunk, with no choices, holds the whole request's usage.
    ``continuous_usage_stats`` (vLLM's, with vLLM's meaning): every chunk also holds a ``usage`` of the choice it
    carries: its prompt's tokens, the tokens that choice has made so far (this chunk's included) and their sum; a
    chat's first chunk of each choice, its role, holds 0 tokens made. It implies ``include_usage`` unless that is
    false (vLLM's default for it is true), and with ``include_usage: false`` it is refused, not left out.
    ``include_obfuscation`` (OpenAI's, padding that hides the chunks' lengths on the wire) is taken and ignored."""

    include_usage: bool | None = None
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None

    @property
    def usage_last(self) -> bool:
        """Whether a last chunk holds the request's usage."""
        return self.continuous_usage_stats if self.include_usage is None else self.include_usage


class SamplingFields(KnownFields):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    """At least 1, but for a text completion that echoes its prompt (see :func:`refuse_unsupported`)."""
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    """vLLM's extra field; 0 or -1: no limit."""
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    """vLLM's range, any signed 64-bit integer (see :func:`sampler_seed`)."""
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    """vLLM's extra field: the model's end-of-sequence tokens do not end a choice (fixed lengths, for benchmarks)."""
    min_tokens: int = Field(0, ge=0)
    """vLLM's extra field: no stop token or stop string ends a choice before it has this many tokens."""
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, le=2)
    """vLLM's extra field (the CTRL paper's penalty, as transformers and vLLM apply it): the logit of every token
    the prompt or the output holds is divided by it where positive, multiplied by it where negative; 1: none."""
    logit_bias: dict[str, float] | None = None
    cache_salt: str | None = Field(None, min_length=1)
    """vLLM's extra field: the prompt's cached pages serve only requests of the same salt, so that one tenant
    cannot tell from ``cached_tokens`` what another's prompts begin with."""
    # A chat's function calling (see pie.serve.tool_calls); refused in text completions (see refuse_unsupported).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    # Understood, and refused when they ask for something the server cannot do (see refuse_unsupported).
    functions: Any = None
    function_call: Any = None
    best_of: int | None = None
    # Constrained output (see requested_grammar).
    response_format: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    # OpenAI's fields that change nothing a model computes here: accepted and left alone.
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None
    prediction: Any = None

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise bad_request("stop", f"at most {MAX_STOP_STRINGS} stop strings, not {len(stops)}")
        for index, stop in enumerate(stops):
            if len(stop) > MAX_STOP_STRING_CHARS:
                raise bad_request("stop", f"a stop string has at most {MAX_STOP_STRING_CHARS} characters; "
                                          f"stop[{index}] has {len(stop)}")
        return tuple(s for s in stops if s)


class TextPart(RequestBody):
    type: str
    text: str | None = None


ChatRole = Literal["system", "developer", "user", "assistant", "tool", "function"]
"""The roles of OpenAI's chat API; the model's chat template decides which of them it can render."""


class ChatMessage(RequestBody):
    """One message of a conversation; the model's chat template is shown its role and text, an assistant's
    ``tool_calls`` and a tool message's ``tool_call_id`` and ``name`` (see :func:`template_messages`). The older
    ``function_call`` is refused (see :func:`message_text`), and another message's ``name`` is not shown."""

    role: ChatRole
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the reply goes on from the final message's text (an assistant's reply begun by the client)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """vLLM's: more of the chat template's variables (Qwen3's ``enable_thinking``, say); see
    :meth:`pie.model.tokenizer.Tokenizer.template_variables` for what is taken."""
    modalities: list[str] | None = None
    audio: Any = None
    # OpenAI's options for its own models and services: refused (see refuse_unsupported), not taken for misspellings.
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    # OpenAI's prompt cache's lifetime: changes nothing a model computes here (pages stay cached while there is room).
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    suffix: str | None = None


class TokenizeRequest(KnownFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Any = None
    """As a chat's: the prompt with the tools shown."""
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(KnownFields):
    model: str | None = None
    tokens: list[int]


def refuse_unsupported(body: SamplingFields) -> None:
    """A 400 for every field that asks for something this server cannot do."""
    if isinstance(body, CompletionRequest):  # a chat's are read by pie.serve.tool_calls.requested_tools
        if body.tools:
            raise bad_request("tools", "tools (function calling) are for /v1/chat/completions, not text completions")
        if body.tool_choice not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice is for /v1/chat/completions, not text completions")
    if body.functions:
        raise bad_request("functions", "functions (the older form of tools) is not supported by this server: send "
                                       "tools")
    if body.function_call not in (None, "none"):
        raise bad_request("function_call", "function_call (the older form of tool_choice) is not supported by this "
                                           "server: send tool_choice")
    if body.best_of not in (None, body.n):
        raise bad_request("best_of", "best_of other than n is not supported: this server returns every choice it "
                                     "samples, unranked; ask for n choices (with logprobs to rank them)")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream: true")
    if body.stream_options is not None and body.stream_options.continuous_usage_stats \
            and body.stream_options.include_usage is False:
        raise bad_request("stream_options.continuous_usage_stats",
                          "stream_options.continuous_usage_stats needs include_usage, which this request sets false")
    if isinstance(body, ChatCompletionRequest):
        if body.modalities not in (None, ["text"]) or body.audio is not None:
            raise bad_request("modalities", "only text output is supported")
        if body.top_logprobs and not body.logprobs:
            raise bad_request("top_logprobs", "top_logprobs needs logprobs: true")
        if body.reasoning_effort is not None:
            raise bad_request("reasoning_effort", "reasoning_effort is OpenAI's option for its reasoning models, which "
                                                  "this server does not have; a chat template's own switch (gpt-oss's "
                                                  "reasoning_effort, Qwen3's enable_thinking) goes in "
                                                  "chat_template_kwargs")
        if body.verbosity is not None:
            raise bad_request("verbosity", "verbosity is OpenAI's option for its GPT-5 models, which this server does "
                                           "not have")
        if body.web_search_options is not None:
            raise bad_request("web_search_options", "web search is not supported by this server")
        if body.moderation is not None:
            raise bad_request("moderation", "moderation is not supported by this server: nothing would check the "
                                            "input or the output")
    if body.max_tokens == 0 and not (isinstance(body, CompletionRequest) and body.echo):
        raise bad_request("max_tokens", "max_tokens must be at least 1 (0 only for a text completion with echo, which "
                                        "scores its prompt)")
    if isinstance(body, CompletionRequest):
        if body.suffix:
            raise bad_request("suffix", "suffix (text after the completion, for fill-in-the-middle) is not supported "
                                        "by this server; for a model trained to fill in, write its own "
                                        "fill-in-the-middle prompt (the text before and after the gap between its "
                                        "markers) as the prompt")


STRUCTURED_OUTPUT_KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The keys of vLLM's ``structured_outputs`` this server follows."""
STRUCTURED_OUTPUT_NO_OPS = ("disable_fallback", "disable_any_whitespace")
"""vLLM's ``structured_outputs`` options that change nothing here: there is one grammar engine, and JSON output
has no free whitespace."""
RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type", "schema"), "json_schema": ("type", "json_schema")}
"""The keys of each ``response_format`` type (``schema`` in ``json_object``: llama.cpp's server takes one there)."""
JSON_SCHEMA_FORMAT_KEYS = ("name", "description", "schema", "strict")
SUBSCHEMA_KEYWORDS = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                      "unevaluatedItems", "unevaluatedProperties", "contentSchema")
"""JSON Schema's keywords (draft 2020-12) whose value is a schema (``items`` may also be a list of them, as before
2020-12)."""
SUBSCHEMA_LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems")
"""Those whose value is a list of schemas."""
SUBSCHEMA_MAP_KEYWORDS = ("$defs", "definitions", "properties", "patternProperties", "dependentSchemas")
"""Those whose value maps names to schemas (``definitions``: draft 7's ``$defs``, which generators still write)."""
JSON_SCHEMA_KEYWORDS = frozenset((
    *SUBSCHEMA_KEYWORDS, *SUBSCHEMA_LIST_KEYWORDS, *SUBSCHEMA_MAP_KEYWORDS,
    "$schema", "$id", "$ref", "$anchor", "$dynamicRef", "$dynamicAnchor", "$vocabulary", "$comment",  # core
    "type", "enum", "const", "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum",  # validation
    "maxLength", "minLength", "pattern", "maxItems", "minItems", "uniqueItems", "maxContains", "minContains",
    "maxProperties", "minProperties", "required", "dependentRequired",
    "title", "description", "default", "deprecated", "readOnly", "writeOnly", "examples",  # meta-data
    "format", "contentEncoding", "contentMediaType",
    "x-guidance",  # the grammar engine's options (JSON output's spacing, lenient mode), a client's opt-in
    "discriminator",  # OpenAPI's note beside a oneOf, which pydantic writes for a discriminated union
))
"""The keys a schema may hold under ``strict: true``: those of JSON Schema's vocabularies (draft 2020-12),
``x-guidance``, and ``discriminator`` (the OpenAI client's ``.parse()`` sends it, strict, for a pydantic model with a
discriminated union: its ``oneOf`` constrains the output already)."""


def _refuse_unknown_keys(value: dict[str, Any], known: tuple[str, ...], param: str) -> None:
    """A 400 naming the first key of ``value`` that is not ``known``: a misspelt constraint would otherwise
    leave the output unconstrained."""
    for key in value:
        if key not in known:
            field = f"{param}.{shortened(key)}"
            raise bad_request(field, f"{field} is not a field this server knows; {param} takes {', '.join(known)}")


def refuse_unknown_keywords(schema: Any, param: str) -> None:
    """A 400 naming a key of ``schema``, or of a schema within it, that is not a JSON Schema keyword.

    JSON Schema ignores keys it does not define (they are annotations), so a misspelt keyword (``maxlength``,
    ``requried``) leaves the output unconstrained; ``strict: true`` asks for the schema to be followed as written,
    so there such a key is refused. Walked without recursion: a schema may be nested hundreds deep."""
    pending: deque[tuple[Any, str]] = deque([(schema, param)])
    while pending:
        node, path = pending.popleft()
        if not isinstance(node, dict):
            continue  # true or false (or a value the grammar engine will refuse, naming it)
        for key, value in node.items():
            where = f"{path}.{shortened(key)}"
            if key not in JSON_SCHEMA_KEYWORDS:
                raise bad_request(where, f"{where} is not a JSON Schema keyword; with strict: true a schema holds only "
                                         "JSON Schema's keywords (a misspelt one would constrain nothing)")
            if key in SUBSCHEMA_MAP_KEYWORDS and isinstance(value, dict):
                pending.extend((item, f"{where}.{shortened(name)}") for name, item in value.items())
            elif (key in SUBSCHEMA_LIST_KEYWORDS or key == "items") and isinstance(value, list):
                pending.extend((item, f"{where}[{index}]") for index, item in enumerate(value))
            elif key in SUBSCHEMA_KEYWORDS:
                pending.append((value, where))


def requested_grammar(body: SamplingFields) -> tuple[GrammarSpec, str] | None:
    """What the output must follow, and the parameter that asked (for errors), or None; a 400 for a
    malformed request or more than one constraint."""
    asked: list[tuple[str, Any]] = []  # (parameter, what it holds), each turned into a spec below
    rf = body.response_format
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise bad_request("response_format", "response_format is an object with a type: text, json_object or json_schema")
        kind = rf["type"]
        if kind in RESPONSE_FORMAT_KEYS:
            _refuse_unknown_keys(rf, RESPONSE_FORMAT_KEYS[kind], "response_format")
        if kind == "json_schema":
            described = rf.get("json_schema")
            if not isinstance(described, dict) or not isinstance(described.get("schema"), (dict, bool)):
                raise bad_request("response_format", "response_format json_schema needs json_schema.schema, a JSON schema object")
            _refuse_unknown_keys(described, JSON_SCHEMA_FORMAT_KEYS, "response_format.json_schema")
            strict = described.get("strict")
            if strict is not None and not isinstance(strict, bool):
                raise bad_request("response_format.json_schema.strict",
                                  "response_format.json_schema.strict is true or false")
            if strict:
                refuse_unknown_keywords(described["schema"], "response_format.json_schema.schema")
            asked.append(("response_format.json_schema.schema", ("json", described["schema"])))
        elif kind == "json_object":  # llama.cpp's server also takes a schema here
            asked.append(("response_format", ("json", rf["schema"]) if "schema" in rf else ("json_object", True)))
        elif kind != "text":
            raise bad_request("response_format", f"response_format type {quoted(kind)} is not supported: use text, json_object or json_schema")
    outputs = body.structured_outputs
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise bad_request("structured_outputs", "structured_outputs is an object, as vLLM's")
        unsupported = ("structural_tag", "whitespace_pattern", "disable_additional_properties")
        _refuse_unknown_keys(outputs, (*STRUCTURED_OUTPUT_KINDS, *STRUCTURED_OUTPUT_NO_OPS, *unsupported),
                             "structured_outputs")
        for key in unsupported:
            if outputs.get(key) not in (None, False):
                raise bad_request(f"structured_outputs.{key}", f"structured_outputs.{key} is not supported")
        named = [(f"structured_outputs.{key}", (key, outputs[key])) for key in STRUCTURED_OUTPUT_KINDS
                 if outputs.get(key) not in (None, False)]
        if not named:
            raise bad_request("structured_outputs", f"structured_outputs names no constraint: give one of "
                                                    f"{', '.join(STRUCTURED_OUTPUT_KINDS)}")
        asked += named
    for key in ("json", "regex", "choice", "grammar"):
        value = getattr(body, f"guided_{key}")
        if value is not None:
            asked.append((f"guided_{key}", (key, value)))
    if not asked:
        return None
    if len(asked) > 1:
        raise bad_request(asked[1][0], f"give one output constraint, not {len(asked)}: {', '.join(p for p, _ in asked)}")
    param, (what, value) = asked[0]
    try:
        if what == "json":
            return GrammarSpec.json_schema(value), param
        if what == "json_object":
            return GrammarSpec.json_object(), param
        if what == "regex":
            return GrammarSpec.regex(value), param
        if what == "choice":
            return GrammarSpec.choice(value), param
        return GrammarSpec.grammar(value), param
    except GrammarError as exc:
        raise bad_request(param, f"{param}: {exc}") from None


def sampler_seed(seed: int | None) -> int | None:
    """A request's seed as the sampler takes it (an integer >= 0): a negative one is taken modulo 2**64, so
    every seed of the signed 64-bit range is its own, reproducible draw."""
    return None if seed is None else seed % 2**64


def message_text(message: ChatMessage, index: int) -> str:
    """A message's text; parts other than text are refused, and so is a system, developer or user message
    without content (an assistant's may have none, as OpenAI allows). The older ``function_call`` is refused: its
    clients send ``functions``, which this server does not take; ``tool_calls`` say the same."""
    if message.function_call:
        raise bad_request(f"messages[{index}].function_call", f"messages[{index}].function_call (the older form "
                                                              "of a tool call) is not supported by this server: "
                                                              "send tool_calls")
    if message.content is None:
        if message.role in ("system", "developer", "user"):
            raise bad_request(f"messages[{index}].content", f"a {message.role} message needs content")
        return ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for number, part in enumerate(message.content):
        if part.type != "text":
            raise bad_request(f"messages[{index}].content", f"content parts of type {quoted(part.type)} are not supported")
        if part.text is None:
            where = f"messages[{index}].content[{number}]"
            raise bad_request(f"{where}.text", f"{where} is of type 'text' but has no 'text' field")
        texts.append(part.text)
    return "".join(texts)


def template_messages(messages: list[ChatMessage], chat_template: str | None,
                      control_token_in: Callable[[str], str | None]) -> list[dict[str, Any]]:
    """The conversation as the chat template is shown it: each message's role (see :func:`template_role`) and text
    (see :func:`message_text`), an assistant's tool calls (see :func:`template_tool_calls`) and a tool message's
    ``tool_call_id`` (one of the calls made last before it: see :func:`refuse_unanswered`) and ``name``: the
    function's, as given or as the call it answers names it (Hermes's template shows a result with its function's
    name, and OpenAI's tool messages carry none). These the template writes as its own text, where a control token
    spelled in them would be read as one: one that spells a control token (``control_token_in``, the tokenizer's)
    is refused."""
    shown: list[dict[str, Any]] = []
    latest: dict[str, str] | None = None  # the calls made last (each id to its function's name); None: no call yet
    for index, message in enumerate(messages):
        entry: dict[str, Any] = {"role": template_role(message.role, chat_template),
                                 "content": message_text(message, index)}
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(message, index, chat_template)
            latest = {call["id"]: call["function"]["name"] for call in entry["tool_calls"] if "id" in call}
        if message.role == "tool":
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            name = message.name or (latest or {}).get(message.tool_call_id or "")
            if name is not None:
                entry["name"] = name
        refuse_control_tokens({key: value for key, value in entry.items() if key != "content"},
                              f"messages[{index}]", control_token_in)
        if message.role == "tool" and message.tool_call_id is not None:
            refuse_unanswered(message.tool_call_id, f"messages[{index}].tool_call_id", latest)
        shown.append(entry)
    return shown


def refuse_unanswered(call_id: str, where: str, calls: dict[str, str] | None) -> None:
    """A 400 naming ``where``, a tool message's ``tool_call_id``, where it is the id of none of ``calls``: those of
    the latest assistant message with tool calls before it (None: there is none), as OpenAI's ``tool_call_id`` names
    a call of the message it answers. A tool message without one is taken (Hermes's templates show none, and some
    clients send only the function's name)."""
    if calls is None:
        raise bad_request(where, f"{where} {quoted(call_id)} answers no tool call: none is made before it")
    if call_id not in calls:
        answerable = f"give one of their ids, {', '.join(map(quoted, calls))}" if calls else "they carry no id"
        raise bad_request(where, f"{where} {quoted(call_id)} answers none of the tool calls made last before it: "
                                 f"{answerable}")


def template_tool_calls(message: ChatMessage, index: int, chat_template: str | None) -> list[dict[str, Any]]:
    """An assistant's tool calls as transformers' chat templates take them: OpenAI's, with each function's
    ``arguments`` an object, not JSON text (Qwen's and Llama's templates write it with ``tojson``)."""
    where = f"messages[{index}].tool_calls"
    if message.role != "assistant":
        raise bad_request(where, f"{where}: only an assistant message holds tool calls")
    if chat_template is None or "tool_calls" not in chat_template:
        raise bad_request(where, f"{where}: this model's chat template cannot show tool calls (it never mentions "
                                 "them)")
    calls = []
    for number, call in enumerate(message.tool_calls or []):
        at = f"{where}[{number}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(function.get("name"), str):
            raise bad_request(at, f"{at} is {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": ..., "
                                  f"\"arguments\": ...}}}}")
        if not isinstance(call.get("id", ""), str):
            raise bad_request(f"{at}.id", f"{at}.id is text")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise bad_request(f"{at}.function.arguments", f"{at}.function.arguments is a JSON object, as text")
        calls.append({**call, "type": "function", "function": {**function, "arguments": arguments}})
    return calls


def refuse_control_tokens(value: Any, where: str, control_token_in: Callable[[str], str | None]) -> None:
    """A 400 naming the first text in ``value`` (JSON: its keys too) that spells a control token; ``where`` is the
    field ``value`` is. Walked without recursion: a tool's schema may be nested deep."""
    pending: deque[tuple[Any, str]] = deque([(value, where)])
    while pending:
        node, path = pending.popleft()
        if isinstance(node, dict):
            for key, item in node.items():
                pending.append((key, path))
                pending.append((item, f"{path}.{shortened(str(key))}"))
        elif isinstance(node, list):
            pending.extend((item, f"{path}[{number}]") for number, item in enumerate(node))
        elif isinstance(node, str):
            spelled = control_token_in(node)
            if spelled is not None:
                raise bad_request(path, f"{path} spells the control token {spelled!r}, which the chat template "
                                        "would write as its own")


def template_role(role: str, chat_template: str | None) -> str:
    """The role a message of ``role`` is shown to ``chat_template`` with: a developer message is a system message
    where the template never names the developer role. OpenAI's developer messages are the system messages of its
    newer models (its clients send them in their place), and a template that knows no such role refuses the
    conversation, or leaves the message out without a word."""
    if role == "developer" and chat_template is not None and "developer" not in chat_template:
        return "system"
    return role


# -- responses -----------------------------------------------------------------


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


TokenBytes = Callable[[int], bytes]
"""A function ``token id -> its bytes`` (the tokenizer's :meth:`~pie.model.tokenizer.Tokenizer.token_bytes`)."""


def token_string(raw: bytes) -> str:
    """A token as log-probabilities name it: its text, or, where its bytes are not UTF-8 on their own (part of a
    character), OpenAI's ``bytes:\\xf0\\x9f``, so tokens that are parts of different characters keep apart."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


def chat_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    def one(token_id: int, logprob: float | None) -> dict[str, Any]:  # (None only for an echoed prompt)
        raw = token_bytes(token_id)
        return {"token": token_string(raw), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [
            {**one(entry.token_id, entry.logprob), "top_logprobs": [one(t, lp) for t, lp in entry.top]}
            for entry in entries
        ]
    }


class TextOffsets:
    """Where each token of one choice starts in its text, in characters, from the tokens' bytes: a token that
    starts inside a character (its first bytes in the token before) points at that character's start. The
    text is decoded as the choice's own is, with U+FFFD for bytes that make no character. A control token
    (``control_ids``: the BOS a prompt begins with, a chat marker) is not in the text: it takes no place."""

    def __init__(self, control_ids: frozenset[int]) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0
        self._control_ids = control_ids

    def start(self, token_id: int, raw: bytes) -> int:
        """The offset of the token ``token_id``, whose bytes are ``raw``; the next call's token follows it."""
        if token_id in self._control_ids:
            return self._chars
        pending = self._utf8.getstate()[0]
        text = self._utf8.decode(raw)
        start = self._chars
        if pending and text.startswith("\ufffd") and not (pending + raw).startswith("\ufffd".encode()):
            start += 1  # the character begun before was cut off by this token: it is one U+FFFD, then this token
        self._chars += len(text)
        return start


def completion_logprobs(entries: list[TokenLogprob], token_bytes: TokenBytes, offsets: TextOffsets) -> dict[str, Any]:
    """The legacy form: each ``top_logprobs`` holds the sampled token too (up to ``logprobs`` + 1 entries, as
    OpenAI's and vLLM's do), most likely first."""

    def top(entry: TokenLogprob) -> dict[str, float] | None:
        if entry.logprob is None:  # an echoed prompt's first token
            return None
        listed = dict(entry.top)
        listed.setdefault(entry.token_id, entry.logprob)
        return {token_string(token_bytes(t)): lp for t, lp in sorted(listed.items(), key=lambda pair: -pair[1])}

    raws = [token_bytes(entry.token_id) for entry in entries]
    return {
        "tokens": [token_string(raw) for raw in raws],
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [top(entry) for entry in entries],
        "text_offset": [offsets.start(entry.token_id, raw) for entry, raw in zip(entries, raws, strict=True)],
    }


class ChoiceState:
    """What one choice has produced so far (for a whole response, or the usage of a stream)."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.tokens = 0
        self.finish_reason: str | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs += delta.logprobs
        self.tokens += delta.generated
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason


Kind = Literal["chat", "completion"]


CallsOf = Callable[[str], tuple[str | None, list[dict[str, Any]]]]
"""A chat choice's text to its content and its tool calls (see :mod:`pie.serve.tool_calls`)."""


def response_json(
    kind: Kind,
    request_id: str,
    model: str,
    fingerprint: str,
    choices: list[ChoiceState],
    usage_body: dict[str, Any],
    token_bytes: TokenBytes,
    control_ids: frozenset[int],
    with_logprobs: bool,
    calls_of: CallsOf | None = None,
) -> bytes:
    """The whole (non-streaming) response as JSON, made a choice at a time (each choice's objects are dropped once
    it is encoded) and encoded in pieces (see :data:`ENCODE_SLICE`); ``calls_of`` reads a chat choice's tool calls,
    where the request's tools are read."""
    head = _json({
        "id": request_id,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "created": now(),
        "model": model,
        "system_fingerprint": fingerprint,
    })
    parts = [head[:-1], b',"choices":[']  # the head without its closing brace: the choices and usage follow
    for position, choice in enumerate(choices):
        if position:
            parts.append(b",")
        _encode(_choice_body(kind, choice, token_bytes, control_ids, with_logprobs, calls_of), parts)
    parts += [b'],"usage":', _json(usage_body), b"}"]
    return b"".join(parts)


def _choice_body(
    kind: Kind, choice: ChoiceState, token_bytes: TokenBytes, control_ids: frozenset[int], with_logprobs: bool,
    calls_of: CallsOf | None,
) -> dict[str, Any]:
    text = "".join(choice.text)
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = choice.finish_reason
        content, calls = calls_of(text) if calls_of is not None else (text, [])
        if calls:
            message = {"role": "assistant", "content": content, "tool_calls": calls}
            reason = tool_calls_finish(reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": chat_logprobs(choice.logprobs, token_bytes) if with_logprobs else None,
            "finish_reason": reason,
        }
    logprobs = completion_logprobs(choice.logprobs, token_bytes, TextOffsets(control_ids)) if with_logprobs else None
    return {"index": choice.index, "text": text, "logprobs": logprobs, "finish_reason": choice.finish_reason}


def tool_calls_finish(reason: str | None) -> str | None:
    """The finish reason of a choice that called tools: ``tool_calls`` where the model ended it (OpenAI's), the
    reason where something else cut it (``length``)."""
    return "tool_calls" if reason == "stop" else reason


ENCODE_SLICE = 256
"""Items of a long list (a choice's tokens and their log-probabilities) given to the JSON encoder in one call: a call
holds the GIL throughout, and one on a whole choice of thousands of tokens kept the event loop waiting."""


def _encode(value: Any, parts: list[bytes]) -> None:
    """Append ``value``'s JSON to ``parts``: dictionaries key by key, long lists a slice at a time."""
    if isinstance(value, dict):
        parts.append(b"{")
        for position, (key, item) in enumerate(value.items()):
            parts.append((b"," if position else b"") + _json(key) + b":")
            _encode(item, parts)
        parts.append(b"}")
    elif isinstance(value, list) and len(value) > ENCODE_SLICE:
        slices = [_json(value[start:start + ENCODE_SLICE])[1:-1] for start in range(0, len(value), ENCODE_SLICE)]
        parts.append(b"[" + b",".join(slices) + b"]")
    else:
        parts.append(_json(value))


def _json(value: Any) -> bytes:
    """``value`` as JSON, as Starlette's ``JSONResponse`` renders it."""
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def chunk_body(kind: Kind, request_id: str, created: int, model: str, fingerprint: str,
               choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
        "created": created,
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": choices,
    }
