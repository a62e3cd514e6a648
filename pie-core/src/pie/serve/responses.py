"""OpenAI's Responses API (``POST /v1/responses``) as a view of a chat completion.

A Responses request is translated into the chat completion it amounts to (:func:`chat_request`): ``input`` (a string,
or message, ``function_call`` and ``function_call_output`` items) and ``instructions`` become the messages,
``max_output_tokens`` the chat's ``max_completion_tokens``, ``text.format`` its ``response_format``, the flat
function ``tools`` and ``tool_choice`` the chat's. The chat route runs it, with all its checks and its behaviour on
failure (an error before any output is an HTTP error; one after is an event that ends the stream), and its answer is
rewritten as a ``Response`` (:func:`response_body`) or as the Responses stream's events (:class:`EventWriter`); an
error the chat route raises has its field renamed to the one the client sent (:func:`renamed`).

This server keeps no responses: ``store`` is taken (OpenAI's default is true, which every client sends) but nothing
is stored, so ``previous_response_id`` is refused and ``GET /v1/responses/{id}`` answers 404. What would change the
result and cannot be honoured is refused with a 400 naming it: ``background``, ``reasoning``, ``include``,
``conversation``, ``prompt``, tools other than functions, images and files in the input.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.sse import format_sse_event
from pydantic import Field, ValidationError
from starlette.concurrency import run_in_threadpool

from pie.serve.protocol import APIError, ChatCompletionRequest, KnownFields, bad_request, field_path, now, quoted

ChatRoute = Callable[[ChatCompletionRequest, Request], Awaitable[Response]]
Made = TypeVar("Made")

NOT_STORED = ("this server stores no responses (store is accepted, but nothing is kept): send the whole "
              "conversation in input")
REFUSED = {
    "previous_response_id": NOT_STORED,
    "conversation": NOT_STORED,
    "background": "background responses are not supported by this server (it stores no responses to poll): leave "
                  "background out, or stream the response",
    "reasoning": "reasoning is OpenAI's option for its reasoning models, which this server does not have",
    "include": "include (extra output such as logprobs or encrypted reasoning) is not supported by this server",
    "prompt": "prompt templates are kept by OpenAI and not by this server: send the prompt's text in input",
    "top_logprobs": "top_logprobs is not supported on /v1/responses by this server: use /v1/chat/completions",
    "max_tool_calls": "max_tool_calls is not supported by this server",
    "context_management": "context_management is not supported by this server",
    "moderation": "moderation is not supported by this server: nothing would check the input or the output",
}
"""Fields OpenAI's API has that this server refuses when they are given (not null, false or empty), and why."""
ROLES = ("user", "system", "developer", "assistant")
"""The roles of an input message."""


class ResponsesRequest(KnownFields):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    """Not OpenAI's here (its chat API's), taken as there: a reproducible draw."""
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    truncation: str | None = None
    store: bool | None = None
    """Taken, and nothing is stored (see the module's notes)."""
    # OpenAI's fields that change nothing a model computes here: accepted and left alone.
    metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    service_tier: str | None = None
    # Refused when given (see REFUSED).
    previous_response_id: Any = None
    conversation: Any = None
    background: Any = None
    reasoning: Any = None
    include: Any = None
    prompt: Any = None
    top_logprobs: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None


def chat_request(body: ResponsesRequest) -> tuple[ChatCompletionRequest, list[str]]:
    """The chat completion ``body`` asks for, and where each of its messages came from (``instructions``,
    ``input[2]``), for :func:`renamed`; a 400 naming what this server cannot do."""
    for name, why in REFUSED.items():
        if getattr(body, name) not in (None, False, [], {}):
            raise bad_request(name, f"{name}: {why}")
    if body.truncation not in (None, "disabled"):
        raise bad_request("truncation", "truncation: only \"disabled\" is supported (this server drops no input to "
                                        "make room; a conversation too long is refused)")
    if set(body.stream_options or ()) - {"include_obfuscation"}:
        raise bad_request("stream_options", "stream_options takes include_obfuscation only")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream: true")
    messages, sources = _messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
                            "temperature": body.temperature, "top_p": body.top_p, "seed": body.seed,
                            "stream": body.stream, "parallel_tool_calls": body.parallel_tool_calls,
                            "response_format": _response_format(body.text)}
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    if body.tools is not None:
        chat["tools"] = [_chat_tool(tool, f"tools[{index}]") for index, tool in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None}), sources
    except ValidationError as exc:  # an input item's field of the wrong type, say
        problem = exc.errors()[0]
        where = field_path(problem["loc"][:3])  # messages[i].field: past it, the members of a union's type
        raise renamed(bad_request(where, f"{where}: {problem['msg']}"), sources) from None


def input_messages(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The messages of a Responses request's JSON (``instructions`` and ``input``), as its chat completion's (the
    ``--ray`` ingress routes it by them); a 400 or a validation error where it is not one."""
    return _messages(ResponsesRequest.model_validate(payload))[0]


def _messages(body: ResponsesRequest) -> tuple[list[dict[str, Any]], list[str]]:
    messages: list[dict[str, Any]] = []
    sources: list[str] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
        sources.append("instructions")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise bad_request("input", "input is empty: give a string or a list of at least one message")
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise bad_request(where, f"{where} is an object: a message ({{\"role\": ..., \"content\": ...}}), a "
                                     "function_call or a function_call_output")
        kind = item.get("type", "message")
        if kind == "message":
            if item.get("role") not in ROLES:
                raise bad_request(f"{where}.role", f"{where}.role is one of {', '.join(ROLES)}")
            message = {"role": item["role"], "content": _content(item, where)}
        elif kind == "function_call":
            _require_text(item, where, ("call_id", "name", "arguments"))
            try:  # checked here too, so that the 400 names the item's field and not the chat's tool_calls
                arguments = json.loads(item["arguments"])
            except (ValueError, RecursionError):
                arguments = None
            if not isinstance(arguments, dict):
                raise bad_request(f"{where}.arguments", f"{where}.arguments is a JSON object, as text")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)  # an assistant's text and its calls: one turn
                continue
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
        elif kind == "function_call_output":
            _require_text(item, where, ("call_id",))
            message = {"role": "tool", "tool_call_id": item["call_id"], "content": _content(item, where, "output")}
        else:
            raise bad_request(f"{where}.type", f"{where}.type {quoted(str(kind))} is not supported by this server: "
                                               "input holds messages, function_call and function_call_output items")
        messages.append(message)
        sources.append(where)
    return messages, sources


def _require_text(item: dict[str, Any], where: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(item.get(key), str):
            raise bad_request(f"{where}.{key}", f"{where}.{key} is text (a {item['type']} item has "
                                                f"{', '.join(keys)})")


def _content(item: dict[str, Any], where: str, key: str = "content") -> Any:
    """A message's (or a function's output's) text, its parts' texts joined; images, files and audio refused."""
    content = item.get(key)
    if not isinstance(content, list):
        return content  # text, or what the chat's checks refuse
    texts = []
    for number, part in enumerate(content):
        at = f"{where}.{key}[{number}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"{at}.type", f"{at}: content parts of type {quoted(str(kind))} are not supported by "
                                            "this server (text only: input_text, or an assistant's output_text)")
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{at}.text", f"{at}.text is the part's text")
        texts.append(part["text"])
    return "".join(texts)


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    if text is None:
        return None
    for key in text:
        if key not in ("format", "verbosity"):
            raise bad_request(f"text.{key}", f"text.{key} is not a field this server knows; text takes format")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity", "text.verbosity is OpenAI's option for its GPT-5 models, which this "
                                            "server does not have")
    form = text.get("format")
    if form is None:
        return None
    if not isinstance(form, dict) or form.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format", "text.format is an object of type text, json_object or json_schema")
    if form["type"] != "json_schema":
        return form
    return {"type": "json_schema", "json_schema": {key: value for key, value in form.items() if key != "type"}}


def _chat_tool(tool: Any, where: str) -> Any:
    """A flat function tool (``{"type": "function", "name": ..., "parameters": ...}``) as the chat's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise bad_request(f"{where}.type", f"{where}: tools of type {quoted(str(kind))} are not supported by this "
                                           "server: only function tools, which the client runs")
    return {"type": "function", "function": {key: value for key, value in tool.items() if key != "type"}}


def _chat_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) <= {"type", "name"}:
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request("tool_choice", "tool_choice is \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                     "\"name\": ...} (only function tools are supported by this server)")


RENAMES = (
    (re.compile(r"response_format(\.json_schema)?"), "text.format"),
    (re.compile(r"max_completion_tokens"), "max_output_tokens"),
    (re.compile(r"(tools\[\d+\]|tool_choice)\.function"), r"\1"),
    (re.compile(r"\.tool_call_id\b"), ".call_id"),  # a tool message's: a function_call_output's call_id
)


def renamed(error: APIError, sources: list[str]) -> APIError:
    """``error`` (the chat route's) with the chat's fields named as the Responses request's."""

    def rename(text: str) -> str:
        for pattern, replacement in RENAMES:
            text = pattern.sub(replacement, text)
        text = re.sub(r"messages\[(\d+)\]", lambda m: sources[int(m[1])] if int(m[1]) < len(sources) else m[0], text)
        return re.sub(r"\bmessages\b", "input", text)

    error.message = rename(error.message)
    error.args = (error.message,)
    if error.param is not None:
        error.param = rename(error.param)
    return error


# -- answers -------------------------------------------------------------------


def response_body(body: ResponsesRequest, response_id: str, model: str, created: int, output: list[dict[str, Any]],
                  finish_reason: str | None, usage: dict[str, Any] | None) -> dict[str, Any]:
    """A ``Response``: ``status`` in_progress until the choice finished (``finish_reason``), then completed, or
    incomplete where it was cut at its length."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    return {
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "background": False, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": None, "reasoning": None, "store": False,
        "temperature": body.temperature, "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
        "truncation": "disabled", "usage": None if usage is None else _usage(usage),
        "user": body.user, "metadata": body.metadata or {},
    }


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def message_item(text: str, status: str) -> dict[str, Any]:
    return {"id": f"msg_{secrets.token_hex(16)}", "type": "message", "role": "assistant", "status": status,
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict[str, Any], arguments: str) -> dict[str, Any]:
    """A chat's tool call as a ``function_call`` item (``arguments`` as far as known)."""
    return {"id": f"fc_{secrets.token_hex(16)}", "type": "function_call", "status": "completed",
            "call_id": call["id"], "name": call["function"]["name"], "arguments": arguments}


def whole_response(body: ResponsesRequest, response_id: str, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """The chat completion ``chat`` as a ``Response``."""
    (choice,) = chat["choices"]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    reason = choice["finish_reason"]
    output = []
    if message["content"] or not calls:
        output.append(message_item(message["content"] or "", "incomplete" if reason == "length" else "completed"))
    output += [call_item(call, call["function"]["arguments"]) for call in calls]
    return response_body(body, response_id, model, chat["created"], output, reason, chat["usage"])


class EventWriter:
    """The Responses stream's events, each numbered (``sequence_number``), from a chat stream's chunks."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str):
        self.body = body
        self.response_id = response_id
        self.model = model
        self.created = now()
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.text: list[str] | None = None
        """The open message item's text so far; None while no message item is open."""
        self.finish_reason: str | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return format_sse_event(event=kind, data_str=json.dumps(data, ensure_ascii=False))

    def response(self, usage: dict[str, Any] | None = None) -> dict[str, Any]:
        return response_body(self.body, self.response_id, self.model, self.created, self.output, self.finish_reason, usage)

    def start(self) -> list[bytes]:
        return [self.event("response.created", response=self.response()),
                self.event("response.in_progress", response=self.response())]

    def chunk(self, chunk: dict[str, Any]) -> list[bytes]:
        """The events of one chat chunk: its text, its tool calls, its end; its usage ends the response."""
        events = []
        for choice in chunk.get("choices", ()):
            delta = choice.get("delta", {})
            if delta.get("content"):
                events += self._open_message()
                assert self.text is not None
                self.text.append(delta["content"])
                events.append(self.event("response.output_text.delta", **self._at(), content_index=0,
                                         delta=delta["content"], logprobs=[]))
            for call in delta.get("tool_calls") or ():
                events += self._close_message()
                item = call_item(call, "")
                events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
                self.output.append(item)
                arguments = call["function"]["arguments"]
                item["arguments"] = arguments
                events.append(self.event("response.function_call_arguments.delta", **self._at(), delta=arguments))
                events.append(self.event("response.function_call_arguments.done", **self._at(), name=item["name"],
                                         arguments=arguments))
                events.append(self.event("response.output_item.done", output_index=len(self.output) - 1, item=item))
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        if chunk.get("usage") is not None:
            if not self.output:
                events += self._open_message()  # no text and no calls: an empty message, as a whole response has
            events += self._close_message()
            final = self.response(chunk["usage"])
            events.append(self.event("response.incomplete" if final["status"] == "incomplete" else
                                     "response.completed", response=final))
        return events

    def failure(self, error: dict[str, Any]) -> list[bytes]:
        """The events that end a stream whose generation failed: OpenAI's ``error`` (with the HTTP ``status`` that
        the chat's error event carries, which the stream's head could not: the ``--ray`` ingress counts a replica's
        failures by it), then ``response.failed``."""
        failed = self.response()
        failed.update(status="failed", error={"code": error.get("code") or "server_error",
                                              "message": error.get("message", "")})
        return [self.event("error", code=error.get("code"), message=error.get("message", ""),
                           param=error.get("param"), status=error.get("status")),
                self.event("response.failed", response=failed)]

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1}

    def _open_message(self) -> list[bytes]:
        if self.text is not None:
            return []
        self.text = []
        item = message_item("", "in_progress")
        item["content"] = []
        events = [self.event("response.output_item.added", output_index=len(self.output), item=dict(item))]
        self.output.append(item)
        events.append(self.event("response.content_part.added", **self._at(), content_index=0,
                                 part=_text_part("")))
        return events

    def _close_message(self) -> list[bytes]:
        if self.text is None:
            return []
        text, self.text = "".join(self.text), None
        item = self.output[-1]
        item["content"] = [_text_part(text)]
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        return [self.event("response.output_text.done", **self._at(), content_index=0, text=text, logprobs=[]),
                self.event("response.content_part.done", **self._at(), content_index=0, part=_text_part(text)),
                self.event("response.output_item.done", output_index=len(self.output) - 1, item=item)]


async def _echoing(body: ResponsesRequest, make: Callable[[], Made]) -> Made:
    """``make()``, which builds and encodes a ``Response`` (:func:`response_body`), echoing ``body``'s tools: on a
    worker thread where there are tools, which may run to megabytes (every other request would wait for their
    encoding; the chat route renders them off the event loop too)."""
    return await run_in_threadpool(make) if body.tools else make()


async def _events(chat_stream: AsyncIterator[bytes], writer: EventWriter) -> AsyncIterator[bytes]:
    """The chat stream's SSE as the Responses stream's; keep-alive comments pass as they are. The events that hold
    the whole response (the first two, the last) are written by :func:`_echoing`."""
    try:
        for event in await _echoing(writer.body, writer.start):
            yield event
        async for raw in chat_stream:
            raw = raw if isinstance(raw, bytes) else raw.encode()
            if not raw.startswith(b"data: "):
                yield raw
                continue
            data = raw[len(b"data: "):].strip()
            if data == b"[DONE]":
                continue
            chunk = json.loads(data)
            if "error" in chunk:
                for event in await _echoing(writer.body, partial(writer.failure, chunk["error"])):
                    yield event
                return
            last = chunk.get("usage") is not None  # its events end with the whole response
            for event in await _echoing(writer.body, partial(writer.chunk, chunk)) if last else writer.chunk(chunk):
                yield event
    finally:
        await chat_stream.aclose()  # type: ignore[attr-defined]  # the chat route's generator


def install_responses_routes(app: FastAPI, chat: ChatRoute) -> None:
    """``POST /v1/responses``, answered by the chat route ``chat``; ``GET`` and ``DELETE /v1/responses/{id}``
    answer 404: no response is stored."""

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        chat_body, sources = chat_request(body)
        try:
            answer = await chat(chat_body, request)
        except APIError as error:
            raise renamed(error, sources) from None
        if answer.status_code != 200:  # 499: the client left
            return answer
        response_id = "resp_" + answer.headers["x-request-id"].rsplit("-", 1)[-1]  # the chat's own id
        model = request.app.state.pie.served_model_name
        if not body.stream:
            def build() -> str:
                whole = whole_response(body, response_id, model, json.loads(bytes(answer.body)))
                return json.dumps(whole, ensure_ascii=False)

            return Response(await _echoing(body, build), media_type="application/json",
                            headers={"x-request-id": response_id})
        # A ReleasingStream: its request is released however it ends, whatever its body becomes.
        answer.body_iterator = _events(answer.body_iterator, EventWriter(body, response_id, model))  # type: ignore[attr-defined]
        answer.headers["x-request-id"] = response_id
        return answer

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"no response {quoted(response_id)}: {NOT_STORED}", param="response_id",
                       code="not_found")
