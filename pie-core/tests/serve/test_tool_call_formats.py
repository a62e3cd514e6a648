"""Function calling in Llama 3.1's JSON and Mistral's ``[TOOL_CALLS]`` formats through the official `openai` client:
the tiny model served with each family's chat template (in short), its calls read, tool_choice's required and named
calls constrained to be valid, streamed as the whole answer says, and a conversation with a call's result shown to
the template."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pie.testing.models import LLAMA_TOOLS_CHAT_TEMPLATE, MISTRAL_TOOLS_CHAT_TEMPLATE, make_gguf_model
from pie.testing.serve_process import ServeProcess
from tool_requests import PROMPT, SCHEMAS, TOOLS

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")

NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL = '{"name": "get_weather", "%s": {"city": "Paris", "days": 2}}'
FORMATS = {
    # the template, how a call is written in it, and the ids of the calls the server makes
    "llama": (LLAMA_TOOLS_CHAT_TEMPLATE, CALL % "parameters", re.compile(r"call_[0-9a-f]{24}")),
    "mistral": (MISTRAL_TOOLS_CHAT_TEMPLATE, f"[TOOL_CALLS] [{CALL % 'arguments'}]", re.compile(r"[A-Za-z0-9]{9}")),
}


def forced(text: str) -> dict[str, Any]:
    """Options that force the output to be ``text`` (for what tool_choice auto reads)."""
    return {"extra_body": {"guided_regex": re.escape(text)}}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def form(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, form: str) -> Iterator[ServeProcess]:
    model = make_gguf_model(tmp_path_factory.mktemp(form) / "tools.gguf", "F32", lm_head_scale=20.0,
                            chat_template=FORMATS[form][0], max_position_embeddings=2048)
    with ServeProcess("--model", str(model), "--served-model-name", "tiny", "--kv-tokens", "8192") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log


def valid_calls(choice: Any, form: str) -> list[tuple[str, dict[str, Any]]]:
    """The choice's calls as (name, arguments), each checked against its tool's parameters, their ids as the format
    takes them."""
    assert choice.finish_reason == "tool_calls", choice
    calls = []
    for call in choice.message.tool_calls:
        assert call.type == "function" and FORMATS[form][2].fullmatch(call.id), call
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


def test_a_named_function_is_called_once_with_valid_arguments(client: openai.OpenAI, form: str) -> None:
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, max_tokens=200, temperature=0,
                                           tool_choice=NAMED)
    (choice,) = reply.choices
    ((name, _),) = valid_calls(choice, form)
    assert name == "get_weather" and choice.message.content is None


def test_required_calls_are_valid(client: openai.OpenAI, form: str) -> None:
    for parallel in (True, False):
        reply = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=parallel, n=4, temperature=1.0, seed=7,
                                               max_tokens=300)
        finished = [valid_calls(choice, form) for choice in reply.choices if choice.finish_reason != "length"]
        assert finished and all(finished), reply
        if not parallel or form == "llama":  # Llama's template shows one call a turn
            assert all(len(calls) == 1 for calls in finished)


def test_auto_reads_a_call_and_none_leaves_it(client: openai.OpenAI, form: str) -> None:
    text = FORMATS[form][1]

    def ask(output: str, **options: Any) -> Any:
        return client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, max_tokens=100,
                                              **forced(output), **options).choices[0]

    auto = ask(text)
    assert valid_calls(auto, form) == [("get_weather", {"city": "Paris", "days": 2})]
    assert auto.message.content is None
    none = ask(text, tool_choice="none")
    assert none.message.content == text and not none.message.tool_calls and none.finish_reason == "stop"
    after = ask(f"Sure.\n{text}")  # a call after text: Mistral's tag opens one anywhere, Llama's JSON only at the start
    if form == "mistral":
        assert valid_calls(after, form) and after.message.content == "Sure."
    else:
        assert after.message.content == f"Sure.\n{text}" and after.finish_reason == "stop"
    unknown = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS[1:], max_tokens=100,
                                             **forced(text)).choices[0]  # get_weather is no tool of this request's
    assert unknown.message.content == text and unknown.finish_reason == "stop"


def said(choice: Any) -> tuple[Any, ...]:
    return (choice.finish_reason, choice.message.content or None,
            [(call.function.name, call.function.arguments) for call in choice.message.tool_calls or []])


@pytest.mark.parametrize("options", [
    {"tool_choice": NAMED},
    {"tool_choice": "required"},
    {"forced": True},
    {"tool_choice": "auto", "max_tokens": 40},  # the tiny model's own text, which calls nothing
])
def test_a_stream_says_what_the_whole_answer_says(client: openai.OpenAI, form: str, options: dict[str, Any]) -> None:
    options = {"max_tokens": 200, **options}
    if options.pop("forced", False):
        options.update(forced(FORMATS[form][1]))
    whole = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, temperature=0,
                                           **options).choices[0]
    content, finish = "", None
    calls: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, temperature=0,
                                                stream=True, **options):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                assert call.index not in calls  # each call whole in one entry
                calls[call.index] = [call.function.name, call.function.arguments]
                assert FORMATS[form][2].fullmatch(call.id)
            finish = choice.finish_reason or finish
    assert (finish, content or None, [tuple(calls[index]) for index in sorted(calls)]) == said(whole)
    assert bool(whole.message.tool_calls) == (options.get("tool_choice") != "auto")


def test_a_call_and_its_result_reach_the_template(client: openai.OpenAI, server: ServeProcess, form: str) -> None:
    """The server's own call sent back with its result, as a client does: the template shows both (Mistral's
    takes the call's id, which it checks)."""
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, tools=TOOLS, max_tokens=200, temperature=0,
                                           tool_choice=NAMED).choices[0].message
    (call,) = reply.tool_calls
    answered = [*PROMPT, reply.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "Rain, 14 C"}]
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    tokens = root.post("/tokenize", body={"messages": answered, "tools": TOOLS}, cast_to=object)["tokens"]
    shown = root.post("/detokenize", body={"tokens": tokens}, cast_to=object)["prompt"]
    arguments = json.dumps(json.loads(call.function.arguments))
    if form == "llama":
        assert f'{{"name": "get_weather", "parameters": {arguments}}}' in shown
        assert 'ipython<|end_header_id|>\n\n"Rain, 14 C"' in shown
    else:
        written = shown[shown.index("[TOOL_CALLS] ") + len("[TOOL_CALLS] "):shown.index("[TOOL_RESULTS]")]
        assert json.loads(written) == [{"name": "get_weather", "arguments": json.loads(arguments), "id": call.id}]
        assert f'[TOOL_RESULTS] {{"content": Rain, 14 C, "call_id": "{call.id}"}}[/TOOL_RESULTS]' in shown
    follow = client.chat.completions.create(model="tiny", messages=answered, tools=TOOLS, max_tokens=4)
    assert follow.usage.prompt_tokens == len(tokens)
    if form == "mistral":  # an id of OpenAI's kind, which Mistral's template refuses: a 400 in its words
        answered[1]["tool_calls"][0]["id"] = answered[2]["tool_call_id"] = "call_1"
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=answered, tools=TOOLS, max_tokens=4)
        assert "length 9" in refused.value.message
