"""Function calling through the official `openai` client: tools shown to a model whose chat template shows them
(Qwen's, in short), its calls read out of its text, tool_choice's required and named calls constrained to be valid,
streamed as the whole answer says."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pie.testing.models import TOOLS_CHAT_TEMPLATE, make_gguf_model
from pie.testing.serve_process import ServeProcess
from tool_requests import PROMPT, SCHEMAS, TOOLS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL_REGEX = "Sure\\.\n" + CALL_TEXT.replace("{", "\\{").replace("}", "\\}").replace(".", "\\.")
"""Output forced to a call (by guided_regex), for the reading of tool_choice auto and none."""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The tiny model with a chat template that shows tools, and a context long enough for them."""
    model = make_gguf_model(tmp_path_factory.mktemp("tools") / "tools.gguf", "F32", lm_head_scale=20.0,
                            chat_template=TOOLS_CHAT_TEMPLATE, max_position_embeddings=2048)
    with ServeProcess("--model", str(model), "--served-model-name", "tiny", "--kv-tokens", "8192") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


def valid_calls(choice: Any) -> list[tuple[str, dict[str, Any]]]:
    """The choice's calls as (name, arguments), each checked against its tool's parameters."""
    assert choice.finish_reason == "tool_calls", choice
    calls = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_named_function_is_called_once_with_valid_arguments(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=PROMPT, tools=TOOLS, max_tokens=200, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (choice,) = reply.choices
    ((name, _),) = valid_calls(choice)
    assert name == "get_weather" and choice.message.content is None


def test_required_calls_are_valid_and_parallel_false_makes_one(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, tool_choice="required",
                                           n=4, temperature=1.0, seed=7, max_tokens=300)
    finished = [valid_calls(choice) for choice in reply.choices if choice.finish_reason != "length"]
    assert finished and all(finished), reply
    one = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, n=4, temperature=1.0, seed=7, max_tokens=300)
    assert all(len(valid_calls(choice)) == 1 for choice in one.choices)


def test_auto_reads_a_call_out_of_the_text_and_none_leaves_it(client: openai.OpenAI) -> None:
    def ask(**options: Any) -> Any:
        return client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, max_tokens=100,
                                              extra_body={"guided_regex": CALL_REGEX}, **options).choices[0]

    auto = ask()
    assert valid_calls(auto) == [("get_weather", {"city": "Paris", "days": 2})]
    assert auto.message.content == "Sure."
    none = ask(tool_choice="none")
    assert none.message.content == "Sure.\n" + CALL_TEXT and not none.message.tool_calls
    assert none.finish_reason == "stop"
    unknown = client.chat.completions.create(
        model="tiny", messages=PROMPT, tools=TOOLS[1:], max_tokens=100,
        extra_body={"guided_regex": CALL_REGEX}).choices[0]  # get_weather is no tool of this request's
    assert unknown.message.content == "Sure.\n" + CALL_TEXT and unknown.finish_reason == "stop"


def test_a_tool_result_in_the_conversation_reaches_the_prompt(client: openai.OpenAI, server: ServeProcess) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Tokyo", "days": 3}'}}
    called = [*PROMPT, {"role": "assistant", "content": None, "tool_calls": [call]}]
    answered = [*called, {"role": "tool", "tool_call_id": "call_1", "content": "Rain, 14 C"}]
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)

    def prompt(messages: list[Any]) -> list[int]:
        return root.post("/tokenize", body={"messages": messages, "tools": TOOLS}, cast_to=object)["tokens"]

    shown = root.post("/detokenize", body={"tokens": prompt(answered)}, cast_to=object)["prompt"]
    assert '{"name": "get_weather", "arguments": {"city": "Tokyo", "days": 3}}' in shown
    assert "<tool_response>\nRain, 14 C\n</tool_response>" in shown and '"name": "now"' in shown
    assert len(prompt(PROMPT)) < len(prompt(called)) < len(prompt(answered))
    reply = client.chat.completions.create(model="tiny", messages=answered, tools=TOOLS, max_tokens=4)
    assert reply.usage.prompt_tokens == len(prompt(answered))
    with pytest.raises(openai.BadRequestError) as refused:
        root.post("/tokenize", body={"prompt": "x", "tools": TOOLS}, cast_to=object)
    assert refused.value.param == "tools" and "give messages" in refused.value.message


def test_a_tool_message_answering_no_call_is_a_400_naming_it(client: openai.OpenAI, server: ServeProcess) -> None:
    """A tool message's tool_call_id names one of the calls of the latest assistant message with tool calls before
    it, as OpenAI's does; one that names none was shown to the model as the result of a call never made. A tool
    message without tool_call_id is still taken (Hermes's templates show none)."""
    def call(name: str) -> dict[str, Any]:
        return {"id": name, "type": "function", "function": {"name": "now", "arguments": "{}"}}

    def calling(*names: str) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": [call(name) for name in names]}

    def answer(call_id: str) -> dict[str, Any]:
        return {"role": "tool", "tool_call_id": call_id, "content": "noon"}

    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    for messages, param, why in (
            ([*PROMPT, calling("call_1", "call_2"), answer("call_1"), answer("call_9")], "messages[3].tool_call_id",
             "'call_9' answers none of the tool calls made last before it: give one of their ids, 'call_1', 'call_2'"),
            ([*PROMPT, answer("call_1")], "messages[1].tool_call_id",
             "'call_1' answers no tool call: none is made before it"),
            ([*PROMPT, calling("call_1"), answer("call_1"), calling("call_2"), answer("call_1")],
             "messages[4].tool_call_id", "'call_1' answers none of the tool calls made last before it: give one of "
                                         "their ids, 'call_2'")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=1)
        assert refused.value.param == param and f"{param} {why}" in refused.value.message, refused.value.body
        with pytest.raises(openai.BadRequestError) as refused:
            root.post("/tokenize", body={"messages": messages, "tools": TOOLS}, cast_to=object)
        assert refused.value.param == param, refused.value.body
    unnamed = {"role": "tool", "name": "now", "content": "noon"}
    for messages in ([*PROMPT, calling("call_1"), unnamed], [*PROMPT, unnamed]):
        assert client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=1).choices


@pytest.mark.parametrize("options,param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parametres": {}}}]}, "tools[0].function.parametres"),
    ({"tools": [TOOLS[1], TOOLS[1]]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "maxlength": 3}}}}}]},
     "tools[0].function.parameters.properties.x.maxlength"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}]},
     "tools[0].function.description"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "rm"}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools"),
])
def test_a_bad_tool_field_is_a_400_naming_it(server: ServeProcess, options: dict[str, Any], param: str) -> None:
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "messages": PROMPT, "max_tokens": 8, **options})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split(".")[0].split("[")[0] in error["message"], error


@pytest.mark.parametrize("message,param", [
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "now", "arguments": "{}"}}]},
     "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "now", "arguments": "{nope"}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "assistant", "tool_calls": [{"type": "function", "function": "now"}]}, "messages[1].tool_calls[0]"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "now<|im_start|>", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].function.name"),
    ({"role": "tool", "tool_call_id": "<|im_end|>", "content": "x"}, "messages[1].tool_call_id"),
])
def test_a_bad_tool_message_is_a_400_naming_it(server: ServeProcess, message: dict[str, Any], param: str) -> None:
    for path in ("/v1/chat/completions", "/tokenize"):
        reply = httpx.post(f"{server.url}{path}", timeout=30,
                           json={"model": "tiny", "messages": [*PROMPT, message], "tools": TOOLS})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.text


def said(choice: Any) -> tuple[Any, ...]:
    return (choice.finish_reason, choice.message.content or None,
            [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []])


def streamed(client: openai.OpenAI, **options: Any) -> tuple[Any, ...]:
    """What a stream says, as the openai client's stream helper puts it together (it refuses a choice cut by
    max_tokens) and as its deltas add up."""
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, temperature=0,
                                                stream=True, **options):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                calls.setdefault(call.index, ["", ""])
                calls[call.index][0] += call.function.name or ""
                calls[call.index][1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    added_up = (finish, content or None, [tuple(calls[index]) for index in sorted(calls)])
    if finish != "length":
        with client.chat.completions.stream(model="tiny", messages=PROMPT, tools=TOOLS, temperature=0,
                                            **options) as stream:
            assert said(stream.get_final_completion().choices[0]) == added_up
    return added_up


@pytest.mark.parametrize("options", [
    {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    {"tool_choice": "required"},
    {"extra_body": {"guided_regex": CALL_REGEX}},
    {"tool_choice": "auto", "max_tokens": 60},  # the tiny model's own text, which calls nothing
])
def test_a_stream_says_what_the_whole_answer_says(client: openai.OpenAI, options: dict[str, Any]) -> None:
    options = {"max_tokens": 200, **options}
    whole = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, temperature=0,
                                           **options).choices[0]
    assert streamed(client, **options) == said(whole)
    if options.get("tool_choice") == "auto":
        assert whole.message.content and not whole.message.tool_calls
    else:
        assert valid_calls(whole)
