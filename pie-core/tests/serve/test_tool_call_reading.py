"""Reading tool calls out of a model's text (pie.serve.tool_calls), whole and in a stream's pieces, and the grammar
that makes a model write them."""

from __future__ import annotations

import json
import sys

import pytest

from pie.generation.constraints import GrammarSpec, GrammarVocabulary, grammar_available
from pie.model.tokenizer import Tokenizer
from pie.serve.protocol import APIError, ChatCompletionRequest, ChatMessage, TokenizeRequest, template_messages
from pie.serve.tool_calls import (HERMES, LLAMA, MISTRAL, CallFormat, CallReader, ToolCall, call_format, read_calls,
                                  requested_tools)
from pie.testing.models import (CHAT_TEMPLATE, LLAMA_TOOLS_CHAT_TEMPLATE, MISTRAL_TOOLS_CHAT_TEMPLATE,
                                TOOLS_CHAT_TEMPLATE, tiny_tokenizer)

TOOLS = {"get_weather": {"type": "object", "properties": {"city": {"enum": ["Paris", "Tokyo"]}},
                         "required": ["city"], "additionalProperties": False},
         "now": {"type": "object", "properties": {}}}


def call(name: str, arguments: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def read(text: str, limit: int | None = None, form: CallFormat = HERMES) -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = read_calls(CallReader(form, TOOLS, limit), text)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def read_in_pieces(text: str, size: int, form: CallFormat = HERMES) -> tuple[str | None, list[ToolCall]]:
    reader = CallReader(form, TOOLS)
    content, calls = "", []
    for start in range(0, len(text), size):
        piece, made = reader.push(text[start:start + size])
        content += piece
        calls += made
    rest, made = reader.flush()
    content, calls = content + rest, calls + made
    return (content or None) if calls else content, calls


def test_the_format_is_read_from_the_chat_template() -> None:
    assert call_format(TOOLS_CHAT_TEMPLATE) is HERMES
    assert call_format(LLAMA_TOOLS_CHAT_TEMPLATE) is LLAMA
    assert call_format(MISTRAL_TOOLS_CHAT_TEMPLATE) is MISTRAL
    assert call_format("{{- '[TOOL_CALLS][' }}{% for tool in tools %}{% endfor %}") is MISTRAL  # Mistral Nemo's
    assert call_format("{{ '[TOOL_CALLS]' + message['content']|string }}") is MISTRAL  # vLLM's example's
    assert call_format(CHAT_TEMPLATE) is None
    # Mistral's later templates write [TOOL_CALLS]name[ARGS]{...}, a format not read here
    assert call_format("{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' + arguments }}") is None


def test_a_template_in_another_format_shows_tools_but_reads_no_calls() -> None:
    """A template that shows tools but teaches no format read here: a chat that would read calls is a 400 naming
    tools, tool_choice "none" and /tokenize show them."""
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
    calls = [{"id": f"call_{n}", "type": "function", "function": {"name": name, "arguments": "{}"}}
             for n, name in ((7, "now"), (8, "today"))]
    messages = [ChatMessage(role="assistant", tool_calls=calls),
                ChatMessage(role="tool", tool_call_id="call_7", content="noon"),
                ChatMessage(role="tool", tool_call_id="call_8", name="later", content="dusk"),
                ChatMessage(role="tool", content="?")]
    shown = template_messages(messages, TOOLS_CHAT_TEMPLATE, lambda text: None)
    assert shown[0]["tool_calls"][0]["function"]["arguments"] == {}
    assert [m.get("name") for m in shown[1:]] == ["now", "later", None]
    assert [m.get("tool_call_id") for m in shown[1:]] == ["call_7", "call_8", None]


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


def llama(name: str, arguments: object, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments})


def mistral(*calls: tuple[str, object]) -> str:
    return "[TOOL_CALLS] " + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls])


PARIS = ("get_weather", {"city": "Paris"})


@pytest.mark.parametrize("form,text,said", [
    (LLAMA, llama(*PARIS), (None, [PARIS])),
    (LLAMA, f"<|python_tag|>{llama(*PARIS, key='arguments')}", (None, [PARIS])),
    (LLAMA, f"  \n{llama(*PARIS)}; {llama('now', {})}\n", (None, [PARIS, ("now", {})])),
    (LLAMA, f"Let me look: {llama(*PARIS)}", (f"Let me look: {llama(*PARIS)}", [])),  # not at the start
    (MISTRAL, mistral(PARIS, ("now", {})), (None, [PARIS, ("now", {})])),
    (MISTRAL, f"Let me look.\n{mistral(PARIS)}", ("Let me look.", [PARIS])),
    (MISTRAL, json.dumps([{"name": "now", "arguments": "{}"}]), (None, [("now", {})])),  # the tag a control token
])
def test_calls_without_an_end_tag_and_the_text_around_them(form: CallFormat, text: str, said: tuple) -> None:
    assert read(text, form=form) == said
    for size in (1, 2, 3, 7):
        content, calls = read_in_pieces(text, size, form)
        assert (content, [(c.name, json.loads(c.arguments)) for c in calls]) == said


@pytest.mark.parametrize("form,text", [
    (LLAMA, '{"name": "get_weather", "parameters": {"city": "Paris"}'),  # cut before its end
    (LLAMA, llama("rm_rf", {})),
    (LLAMA, f"{llama(*PARIS)} and then {llama('now', {})}"),
    (LLAMA, '{"name": "now", "parameters": [1]}'),
    (LLAMA, "{" * 100_000),
    (LLAMA, "<|python_tag|>print(1)"),
    (LLAMA, "<|python_ta"),
    (LLAMA, "{}"),
    (MISTRAL, "[TOOL_CALLS] [{not json}]"),
    (MISTRAL, "Before [TOOL_CALLS] " + json.dumps([{"name": "now", "arguments": {}}, {"name": "rm_rf"}])),
    (MISTRAL, "[TOOL_CALLS] []"),
    (MISTRAL, "[1, 2] is a list"),
    (MISTRAL, "Ends with [TOOL_CA"),
])
def test_what_is_not_a_call_without_an_end_tag_stays_content(form: CallFormat, text: str) -> None:
    assert read(text, form=form) == (text, [])
    for size in (1, 2, 3, 7):
        assert read_in_pieces(text, size, form) == (text, [])


def test_a_limit_keeps_the_first_calls_of_a_format_without_an_end_tag() -> None:
    assert read(mistral(PARIS, ("now", {})), limit=1, form=MISTRAL) == (None, [PARIS])
    assert read(f"{llama(*PARIS)};{llama('now', {})}", limit=1, form=LLAMA) == (None, [PARIS])


def test_mistral_call_ids_are_what_its_template_takes() -> None:
    """Mistral's templates refuse a call id that is not 9 letters and digits (the others take OpenAI's)."""
    (made,) = read_calls(CallReader(MISTRAL, TOOLS), mistral(PARIS))[1]
    assert len(made.id) == 9 and made.id.isalnum() and made.id.isascii()
    (hermes,) = read_calls(CallReader(HERMES, TOOLS), call(*PARIS))[1]
    assert hermes.id.startswith("call_")


@pytest.mark.skipif(not grammar_available(), reason="needs llguidance")
@pytest.mark.parametrize("form,several,text", [
    (LLAMA, False, llama(*PARIS)),
    (MISTRAL, True, json.dumps([{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "now", "arguments": {}}])),
    (MISTRAL, False, json.dumps([{"name": "now", "arguments": {}}])),
])
def test_the_grammar_of_a_format_without_an_end_tag_takes_what_its_reader_reads(form: CallFormat, several: bool,
                                                                               text: str) -> None:
    tokenizer = Tokenizer(tiny_tokenizer(), bos_token_id=0, eos_token_ids=[2])
    grammar = GrammarVocabulary.for_tokenizer(tokenizer, tokenizer.vocab_size).compile(
        GrammarSpec.grammar(form.grammar(TOOLS, several)))
    matcher = grammar.matcher()
    for token in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.allows(token), text
        matcher.accept(token)
    assert matcher.is_accepting
    assert read_calls(CallReader(form, TOOLS), text)[1]
