"""OpenAI's Responses API (/v1/responses) through the official `openai` client: the same generation as the chat
completion it amounts to, its stream's events in their documented order, constrained output, function calls, and a
400 naming every field this server cannot honour."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

import pie.serve.app as app_module
import pie.serve.responses as responses_module
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings
from pie.testing.models import TOOLS_CHAT_TEMPLATE, make_gguf_model
from pie.testing.serve_process import ServeProcess, in_process
from test_long_prompts import _on_event_loop
from tool_requests import WEATHER

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")

TOOLS: list[Any] = [  # tool_requests' tools, in the Responses API's flat form
    {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "now", "description": "The time"},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The tiny model with a chat template that shows tools (and system messages)."""
    model = make_gguf_model(tmp_path_factory.mktemp("responses") / "tools.gguf", "F32", lm_head_scale=20.0,
                            chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=2048)
    with ServeProcess("--model", str(model), "--served-model-name", "tiny", "--kv-tokens", "8192") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], **options: Any) -> Any:
    return client.chat.completions.create(model="tiny", messages=messages, temperature=0, **options)  # type: ignore[arg-type]


def test_a_string_or_messages_answer_as_the_chat_completion_does(client: openai.OpenAI) -> None:
    expected = chat(client, [{"role": "user", "content": "Tell me about the fox."}], max_tokens=12)
    reply = client.responses.create(model="tiny", input="Tell me about the fox.", temperature=0, max_output_tokens=12)
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == "tiny"
    assert reply.output_text == expected.choices[0].message.content
    assert reply.usage is not None and reply.usage.input_tokens == expected.usage.prompt_tokens
    assert reply.usage.output_tokens == expected.usage.completion_tokens
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    (item,) = reply.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")

    messages = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi."},
                {"role": "user", "content": "Tell me about the fox."}]
    expected = chat(client, [{"role": "system", "content": "You are brief."}, *messages], max_tokens=12)
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hello."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi."}]},
             {"role": "user", "content": "Tell me about the fox."}]
    reply = client.responses.create(model="tiny", input=items, instructions="You are brief.", temperature=0,
                                    max_output_tokens=12)  # type: ignore[arg-type]
    assert reply.output_text == expected.choices[0].message.content
    assert reply.usage is not None and reply.usage.input_tokens == expected.usage.prompt_tokens
    without = client.responses.create(model="tiny", input=items, temperature=0, max_output_tokens=12)  # type: ignore[arg-type]
    assert without.usage is not None and without.usage.input_tokens < reply.usage.input_tokens


def test_max_output_tokens_makes_an_incomplete_response(client: openai.OpenAI) -> None:
    expected = chat(client, [{"role": "user", "content": "Count."}], max_tokens=3)
    assert expected.choices[0].finish_reason == "length"
    reply = client.responses.create(model="tiny", input="Count.", temperature=0, max_output_tokens=3)
    assert reply.status == "incomplete" and reply.incomplete_details is not None
    assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.usage is not None and reply.usage.output_tokens == 3


@pytest.mark.parametrize("limit", [3, 40])
def test_a_streams_events_come_in_order_and_say_what_the_whole_answer_says(client: openai.OpenAI,
                                                                           limit: int) -> None:
    options: dict[str, Any] = {"model": "tiny", "input": "Tell me about the fox.", "temperature": 0,
                               "max_output_tokens": limit}
    whole = client.responses.create(**options)
    events = list(client.responses.create(stream=True, **options))
    kinds = [event.type for event in events]
    deltas = kinds.count("response.output_text.delta")
    ending = "response.incomplete" if whole.status == "incomplete" else "response.completed"
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done", ending]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text and deltas >= 1
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == whole.output_text and final.status == whole.status
    assert final.usage == whole.usage and final.id == events[0].response.id  # type: ignore[union-attr]

    with client.responses.stream(**options) as stream:
        streamed = [event.type for event in stream]
        if whole.status == "completed":
            assert stream.get_final_response().output_text == whole.output_text
    assert streamed == kinds


def test_a_json_schema_format_makes_valid_json(client: openai.OpenAI) -> None:
    reply = client.responses.create(
        model="tiny", input="The weather?", temperature=1.0, max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}})
    assert reply.status == "completed", reply
    jsonschema.validate(json.loads(reply.output_text), WEATHER)
    anything = client.responses.create(model="tiny", input="JSON?", max_output_tokens=50,
                                       text={"format": {"type": "json_object"}})
    assert anything.text is not None and anything.text.format.type == "json_object"
    assert anything.output_text.startswith("{")  # (an object, cut at 50 tokens or whole)
    if anything.status == "completed":
        assert isinstance(json.loads(anything.output_text), dict)


def test_required_tools_make_function_calls_and_their_outputs_reach_the_prompt(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice="required", temperature=1.0, max_output_tokens=300,
                                    extra_body={"seed": 7})
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and calls, reply
    schemas = {tool["name"]: tool.get("parameters", {"type": "object"}) for tool in TOOLS}
    for call in calls:
        assert call.call_id.startswith("call_") and call.id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    named = client.responses.create(model="tiny", input="Weather?", tools=TOOLS, max_output_tokens=300,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [item.name for item in named.output if item.type == "function_call"] == ["get_weather"]

    streamed = list(client.responses.create(model="tiny", input="What is the weather in Paris?", tools=TOOLS,
                                            tool_choice="required", temperature=1.0, max_output_tokens=300,
                                            extra_body={"seed": 7},
                                            stream=True))
    final = streamed[-1].response  # type: ignore[union-attr]
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == \
        [(c.name, c.arguments) for c in calls]

    # The calls sent back as the client got them (with their ids and status), as agents do.
    turn = [{"role": "user", "content": "What is the weather in Paris?"}, *[c.model_dump() for c in calls]]
    asked = client.responses.create(model="tiny", input=turn, tools=TOOLS, max_output_tokens=5)  # type: ignore[arg-type]
    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C"} for c in calls]
    answered = client.responses.create(model="tiny", input=[*turn, *outputs], tools=TOOLS,  # type: ignore[arg-type]
                                       max_output_tokens=5)
    assert asked.usage is not None and answered.usage is not None
    assert answered.usage.input_tokens > asked.usage.input_tokens + 3


def test_a_function_call_output_answering_no_call_is_a_400_naming_its_call_id(client: openai.OpenAI) -> None:
    """A function_call_output's call_id names a function_call item before it (of the calls made last); one that names
    none is a 400 naming the item's call_id, not the chat's tool_call_id it becomes."""
    def call(call_id: str) -> dict[str, Any]:
        return {"type": "function_call", "call_id": call_id, "name": "now", "arguments": "{}"}

    def output(call_id: str) -> dict[str, Any]:
        return {"type": "function_call_output", "call_id": call_id, "output": "noon"}

    asked = {"role": "user", "content": "What time is it?"}
    for items, param, why in (
            ([asked, call("call_1"), call("call_2"), output("call_1"), output("call_9")], "input[4].call_id",
             "'call_9' answers none of the tool calls made last before it: give one of their ids, 'call_1', 'call_2'"),
            ([asked, output("call_1")], "input[1].call_id", "'call_1' answers no tool call: none is made before it")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model="tiny", input=items, instructions="Be brief.", tools=TOOLS,  # type: ignore[arg-type]
                                    max_output_tokens=1)
        assert refused.value.param == param and f"{param} {why}" in refused.value.message, refused.value.body
        assert "tool_call_id" not in refused.value.message


@pytest.mark.parametrize(("options", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameter": {}}]}, "tools[0].parameter"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file_1"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]}, "input[0].arguments"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strictly": True}}},
     "text.format.strictly"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens"),
    ({"temperatur": 0}, "temperatur"),
])
def test_what_this_server_cannot_honour_is_a_400_naming_it(server: ServeProcess, options: dict[str, Any],
                                                           param: str) -> None:
    reply = httpx.post(f"{server.url}/v1/responses", json={"model": "tiny", "input": "Hi", **options}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_store_is_taken_and_nothing_is_stored(client: openai.OpenAI) -> None:
    reply = client.responses.create(model="tiny", input="Hi", store=True, max_output_tokens=2)
    assert reply.store is False
    with pytest.raises(openai.NotFoundError, match="stores no responses"):
        client.responses.retrieve(reply.id)


def test_a_failure_in_a_stream_begun_ends_it_with_error_and_failed_events(tiny_model: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """As a chat's stream ends with an error event, a response's ends with OpenAI's error and response.failed."""
    made = {"chunks": 0}
    chunk_body = app_module.chunk_body

    def failing_third_chunk(*args: Any) -> dict[str, Any]:
        made["chunks"] += 1
        if made["chunks"] == 3:
            raise RuntimeError("a fault of the server's own")
        return chunk_body(*args)

    monkeypatch.setattr(app_module, "chunk_body", failing_third_chunk)
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    state = ServerState(ServeSettings(served_model_name="tiny"), llm)
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=200, stream=True,
                                              extra_body={"temperature": 0}))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-2:] == ["error", "response.failed"]
    assert events[-2].message == "internal error: RuntimeError: a fault of the server's own"  # type: ignore[union-attr]
    failed = events[-1].response  # type: ignore[union-attr]
    assert failed.status == "failed" and failed.error is not None
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert state.metrics.registry.get_sample_value("pie:request_errors_total", {"status": "500"}) == 1


def test_a_response_echoing_tools_is_encoded_off_the_event_loop(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # A stream's response.created, response.in_progress and last events echo the request's tools, and were built and
    # encoded on the event loop: 3.9 MB of tools held every other request for 50-150 ms at each of the three (the
    # chat route renders them off it, and a whole response was already built off it).
    built: list[bool] = []  # for each Response built, whether the event loop's thread built it
    build = responses_module.response_body

    def recording(*args: Any) -> dict[str, Any]:
        built.append(_on_event_loop())
        return build(*args)

    monkeypatch.setattr(responses_module, "response_body", recording)
    model = make_gguf_model(tmp_path / "tools.gguf", "F32", chat_template=TOOLS_CHAT_TEMPLATE,
                            max_position_embeddings=2048)
    state = ServerState(ServeSettings(served_model_name="tiny"), LLM.load(str(model), "cpu", max_cached_tokens=2048))
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        events = list(client.responses.create(model="tiny", input="Hi", tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                              max_output_tokens=2, stream=True))
        echoed = [event.response for event in events if hasattr(event, "response")]
        assert [event.type for event in events][:2] == ["response.created", "response.in_progress"]
        assert len(echoed) == 3 and all([t.name for t in r.tools] == ["get_weather", "now"] for r in echoed)  # type: ignore[union-attr]
        assert built == [False] * 3, built
        whole = client.responses.create(model="tiny", input="Hi", tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                        max_output_tokens=2)
        assert [tool.name for tool in whole.tools] == ["get_weather", "now"]  # type: ignore[union-attr]
        assert built == [False] * 4, built
