"""Reading tool calls out of a model's text (pie.serve.tool_calls), whole and in a stream's pieces, and the grammar
that makes a model write them."""

from __future__ import annotations

import json
import sys

import pytest

from pie.generation.constraints import GrammarSpec, GrammarVocabulary, grammar_available
from pie.model.tokenizer import Tokenizer
from pie.serve.protocol import APIError, ChatCompletionRequest, ChatMessage, TokenizeRequest, template_messages
from pie.serve.tool_calls import HERMES, CallReader, ToolCall, call_format, read_calls, requested_tools
from pie.testing.models import CHAT_TEMPLATE, TOOLS_CHAT_TEMPLATE, tiny_tokenizer

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                         "required": ["city"], "additionalProperties": False},
         "now": {"type": "object", "properties": {}}}


def call(name: str, arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def read(text: str, limit: int | None = None) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = read_calls(CallReader(HERMES, TOOLS, limit), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def read_in_pieces(text: str, size: int) -> tuple[str | None, list[ToolCall]]:
    reader = CallReader(HERMES, TOOLS)
    content, calls = "", []
    for start in range(0, len(text), size):
        piece, made = reader.push(text[start:start + size])
        content += piece
        calls += made
    content += reader.flush()
    return (content or None) if calls else content, calls


def test_the_format_is_read_from_the_chat_template() -> None:
    assert call_format(TOOLS_CHAT_TEMPLATE) is HERMES
    assert call_format(CHAT_TEMPLATE) is None


def test_a_template_in_another_format_shows_tools_but_reads_no_calls() -> None:
    """Llama 3's template shows tools and writes calls as bare JSON, which is not read here (yet): a chat that would
    read calls is a 400 naming tools, tool_choice "none" and /tokenize show them."""
    other = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}"
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}
    with pytest.raises(APIError) as refused:
        requested_tools(ChatCompletionRequest(**body), other)
    assert refused.value.param == "tools" and "format this server does not read" in refused.value.message
    shown = [requested_tools(ChatCompletionRequest(**body, tool_choice="none"), other),
             requested_tools(TokenizeRequest(**body), other)]
    assert all(tools is not None and not tools.reads_calls and tools.tools == body["tools"] for tools in shown)


def test_a_tool_result_is_shown_with_the_name_of_the_function_it_answers() -> None:
    """Hermes's own template shows a tool result with its function's name, which OpenAI's tool messages do not
    carry: it is the name of the call the message answers (by tool_call_id), or the message's own."""
    call = {"id": "call_7", "type": "function", "function": {"name": "now", "arguments": "{}"}}
    messages = [ChatMessage(role="assistant", tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="call_7", content="noon"),
                ChatMessage(role="tool", tool_call_id="call_8", name="later", content="dusk"),
                ChatMessage(role="tool", tool_call_id="call_9", content="?")]
    shown = template_messages(messages, TOOLS_CHAT_TEMPLATE, lambda text: None)
    assert shown[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert [m.get("name") for m in shown[1:]] == ["now", "later", None]
    assert [m["tool_call_id"] for m in shown[1:]] == ["call_7", "call_8", "call_9"]


def test_parameters_too_deep_for_the_grammar_are_a_400_naming_tools() -> None:
    """Writing the grammar of a required call writes each tool's parameters as JSON, which Python's writer does
    only so deep: past it, a 400 naming tools, not a 500."""
    deep: dict = {"type": "object"}
    for _ in range(sys.getrecursionlimit()):
        deep = {"type": "object", "properties": {"a": deep}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    body = ChatCompletionRequest.model_construct(messages=[], tools=tools, tool_choice="required")  # past pydantic's
    request = requested_tools(body, TOOLS_CHAT_TEMPLATE)
    assert request is not None
    with pytest.raises(APIError) as refused:
        request.grammar()
    assert refused.value.param == "tools" and "nested too deeply" in refused.value.message


def test_calls_and_the_text_around_them() -> None:
    weather = call("get_weather", {"city": "Paris"})
    assert read(weather) == (None, [("get_weather", {"city": "Paris"})])
    assert read(f"Let me look.\n{weather}\n{call('now', {})}\n") == \
        ("Let me look.", [("get_weather", {"city": "Paris"}), ("now", {})])
    assert read('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>') == (None, [("now", {})])
    assert read("no call here\n") == ("no call here\n", [])


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",
    call("rm_rf", {}),  # no tool of the request's
    '<tool_call>\n{"name": "now", "arguments": [1]}\n</tool_call>',
    "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>",
    '<tool_call>\n{"name": "now", "arguments": {}}',  # cut before its end
    "Ends with <tool_ca",
])
def test_what_is_not_a_call_stays_content(text: str) -> None:
    assert read(text) == (text, [])


def test_a_limit_of_one_call_leaves_the_rest_as_content() -> None:
    second = call("now", {})
    assert read(f"{call('get_weather', {'city': 'Tokyo'})}\n{second}", limit=1) == \
        (second, [("get_weather", {"city": "Tokyo"})])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_a_stream_reads_as_the_whole_text(size: int) -> None:
    text = (f"Sure. \n{call('get_weather', {'city': 'Paris'})}\n\n{call('nope', {})} <tool_call> "
            f"{call('now', {})}  and <tool_c then <tool_call>{{cut")
    whole_content, whole_calls = read_calls(CallReader(HERMES, TOOLS), text)
    content, calls = read_in_pieces(text, size)
    assert content == whole_content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert [c.name for c in calls] == ["get_weather", "now"]


@pytest.mark.skipif(not grammar_available(), reason="needs llguidance")
@pytest.mark.parametrize("several", [True, False])
def test_the_grammar_takes_the_calls_the_reader_reads(several: bool) -> None:
    tokenizer = Tokenizer(tiny_tokenizer(), bos_token_id=0, eos_token_ids=[2])
    grammar = GrammarVocabulary.for_tokenizer(tokenizer, tokenizer.vocab_size).compile(
        GrammarSpec.grammar(HERMES.grammar(TOOLS, several)))
    text = f"{call('get_weather', {'city': 'Paris'})}\n{call('now', {})}"
    matcher = grammar.matcher()
    ids = tokenizer.encode(text, add_special_tokens=False)
    taken = 0
    for token in ids:
        if not matcher.allows(token):
            break
        matcher.accept(token)
        taken += 1
    assert (taken == len(ids) and matcher.is_accepting) == several
    refused = grammar.matcher()
    bad = tokenizer.encode(call("get_weather", {"city": "Rome"}), add_special_tokens=False)
    assert not all(refused.allows(token) and refused.accept(token) is None for token in bad)
