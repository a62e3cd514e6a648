"""Constrained output through the official `openai` client: response_format, vLLM's extra fields, `.parse()`."""

from __future__ import annotations

import asyncio
import json
import re

from collections.abc import Callable, Iterator

import httpx
import openai
import pydantic
import pytest
from pie.testing.serve_process import ServeProcess, named_bytes

from pie.testing.models import make_gguf_model

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    """The tiny model with its logits left flat (no lm_head_scale): sampled choices really differ."""
    model = make_gguf_model(tmp_path_factory.mktemp("constrained") / "flat.gguf", "F32", seed=1)
    with ServeProcess("--model", str(model), "--served-model-name", "tiny", "--kv-tokens", "4096") as process:
        process.wait_ready()
        yield process
        assert process.stop() == 0, process.log

PROMPT = [{"role": "user", "content": "Describe the fox as JSON."}]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["quick", "brown", "lazy"]}, "maxItems": 2},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


def schema_format(schema: dict[str, object], strict: object = True) -> dict[str, object]:
    return {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": strict}}


def finished(choices: list, text_of=lambda c: c.message.content) -> list[str]:
    """The texts of the choices that ended with "stop"; fails unless there is at least one."""
    texts = [text_of(c) for c in choices if c.finish_reason == "stop"]
    assert texts, f"no choice finished: {[c.finish_reason for c in choices]}"
    return texts


def test_json_schema_outputs_validate_across_choices(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, response_format=schema_format(PERSON),
                                           n=6, temperature=1.0, seed=3, max_tokens=120)
    texts = finished(reply.choices)
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 1, "six sampled choices, each with its own matcher, all alike"


def test_parse_fills_a_pydantic_model(client: openai.OpenAI) -> None:
    class Fox(pydantic.BaseModel):
        colour: str = pydantic.Field(max_length=6)
        legs: int = pydantic.Field(ge=0, le=9)
        lazy: bool

    reply = client.chat.completions.parse(model="tiny", messages=PROMPT, response_format=Fox, temperature=0,
                                          max_tokens=60)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Fox)
    assert Fox.model_validate_json(choice.message.content) == choice.message.parsed


def test_hitting_max_tokens_is_length_never_a_claimed_whole(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, response_format=schema_format(PERSON),
                                           temperature=0, max_tokens=3)
    (choice,) = reply.choices
    assert choice.finish_reason == "length" and reply.usage.completion_tokens == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(choice.message.content)
    with pytest.raises(openai.LengthFinishReasonError):
        client.chat.completions.parse(model="tiny", messages=PROMPT, response_format=schema_format(PERSON),
                                      temperature=0, max_tokens=3)


def test_json_object_in_completions_and_chat(client: openai.OpenAI) -> None:
    text = client.completions.create(model="tiny", prompt="The fox as JSON:", max_tokens=80, temperature=0.8, seed=1,
                                     n=4, extra_body={"response_format": {"type": "json_object"}})
    for body in finished(text.choices, lambda c: c.text):
        assert isinstance(json.loads(body), dict)
    chat = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=80, temperature=0,
                                          response_format={"type": "json_object"})
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(chat.choices[0].message.content), dict)


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"regex": r"[a-z]{3}-[0-9]{2}"}},
    {"guided_regex": r"[a-z]{3}-[0-9]{2}"},
])
def test_regex_outputs_match_in_every_fork(client: openai.OpenAI, extra: dict[str, object]) -> None:
    reply = client.completions.create(model="tiny", prompt="Code:", max_tokens=20, temperature=1.0, seed=5, n=8,
                                      extra_body=extra)
    assert all(c.finish_reason == "stop" for c in reply.choices)
    texts = [c.text for c in reply.choices]
    assert all(re.fullmatch(r"[a-z]{3}-[0-9]{2}", text) for text in texts), texts
    assert len(set(texts)) > 1, "forks that shared one matcher would not diverge (nor all match)"


@pytest.mark.parametrize("extra", [
    {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}},
    {"guided_choice": ["yes", "no", "maybe so"]},
    {"structured_outputs": {"grammar": 'root ::= "yes" | "no" | "maybe so"'}},
])
def test_choice_and_grammar(client: openai.OpenAI, extra: dict[str, object]) -> None:
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=10, temperature=1.0, seed=2, n=6,
                                           extra_body=extra)
    assert {c.finish_reason for c in reply.choices} == {"stop"}
    assert {c.message.content for c in reply.choices} <= {"yes", "no", "maybe so"}


def test_streamed_constrained_output_equals_the_whole(client: openai.OpenAI) -> None:
    options = dict(model="tiny", messages=PROMPT, response_format=schema_format(PERSON), temperature=0.7, seed=11,
                   max_tokens=120)
    whole = client.chat.completions.create(**options)
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason


def test_concurrent_requests_keep_their_own_grammars(make_aclient: Callable[[], openai.AsyncOpenAI]) -> None:
    """A batch of requests under different constraints: each output follows its own."""
    patterns = [r"[0-9]{4}", r"[a-c]{5}", r"(red|green|blue)!", r"x[yz]{2,3}"]

    async def one(aclient: openai.AsyncOpenAI, index: int) -> tuple[str, str]:
        pattern = patterns[index % len(patterns)]
        reply = await aclient.completions.create(model="tiny", prompt="Go:", max_tokens=12, temperature=1.0,
                                                 seed=index, extra_body={"structured_outputs": {"regex": pattern}})
        return pattern, reply.choices[0].text

    async def run() -> list[tuple[str, str]]:
        async with make_aclient() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(12)))

    for pattern, text in asyncio.run(run()):
        assert re.fullmatch(pattern, text), (pattern, text)


def test_logprobs_under_a_grammar_are_the_models_own(client: openai.OpenAI) -> None:
    """The model's log-softmax before the grammar's mask (as before logit_bias): the most likely tokens are the
    model's, allowed or not, and a token the grammar leaves alone is not reported as certain."""
    options: dict = dict(model="tiny", prompt="Go:", max_tokens=6, temperature=0, logprobs=5)
    free = client.completions.create(**options).choices[0].logprobs
    logprobs = client.completions.create(**options, extra_body={"structured_outputs": {"regex": "[0-9]+"}}
                                         ).choices[0].logprobs
    assert all(token.isdigit() for token in logprobs.tokens)
    first = logprobs.top_logprobs[0]
    assert not all(text.isdigit() for text in first), "the model's own most likely tokens, forbidden ones too"
    assert {t: pytest.approx(v, abs=1e-5) for t, v in free.top_logprobs[0].items()} == \
        {t: v for t, v in first.items() if t in free.top_logprobs[0]}
    assert all(value < 0 for value in logprobs.token_logprobs)


def test_logprobs_of_characters_split_across_tokens(client: openai.OpenAI) -> None:
    """Each token's bytes are its own (the emoji is four tokens of one byte): joined they are the text's, and a
    token's text_offset is where its character starts in the text."""
    choice = {"guided_choice": ["a😀é"]}
    chat = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=10, temperature=0, logprobs=True,
                                          extra_body=choice).choices[0]
    assert chat.message.content == "a😀é"
    entries = chat.logprobs.content
    assert bytes(byte for entry in entries for byte in entry.bytes) == "a😀é".encode()
    assert [entry.token for entry in entries if entry.token.startswith("bytes:")], "parts of characters are named"
    assert all(entry.logprob < 0 for entry in entries), "the model's own, not the grammar's certainty"
    text = client.completions.create(model="tiny", prompt="Say:", max_tokens=10, temperature=0, logprobs=1,
                                     extra_body=choice).choices[0]
    assert text.text == "a😀é"
    starts = [0]
    for token in text.logprobs.tokens[:-1]:
        starts.append(starts[-1] + len(named_bytes(token)))
    assert text.logprobs.text_offset == [len("a😀é".encode()[:start].decode("utf-8", "ignore")) for start in starts]
    assert len(set(text.logprobs.text_offset)) < len(starts), "some token starts inside a character"
    stream = client.completions.create(model="tiny", prompt="Say:", max_tokens=10, temperature=0, logprobs=1,
                                       extra_body=choice, stream=True)
    chunks = [chunk.choices[0].logprobs for chunk in stream if chunk.choices and chunk.choices[0].logprobs]
    assert len(chunks) > 1 and [o for c in chunks for o in c.text_offset] == text.logprobs.text_offset


@pytest.mark.parametrize("options,param,says", [
    ({"response_format": schema_format({"type": "strin"})}, "response_format.json_schema.schema", "Invalid type"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format.json_schema.schema",
     "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "yaml"),
    ({"response_format": "json"}, "response_format", "type"),
    ({"extra_body": {"structured_outputs": {"regex": "a(b"}}}, "structured_outputs.regex", "unclosed group"),
    ({"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice", "at least one"),
    ({"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}}, "structured_outputs.grammar",
     "unknown name"),
    ({"extra_body": {"structured_outputs": {"structural_tag": {"x": 1}}}}, "structured_outputs.structural_tag",
     "not supported"),
    ({"extra_body": {"guided_json": '{"type": '}}, "guided_json", "not valid JSON"),
    ({"extra_body": {"guided_json": "[" * 5000}}, "guided_json", "nested too deeply"),  # was a 500 RecursionError
    # a misspelt field would leave the output unconstrained
    ({"extra_body": {"structured_outputs": {"regexp": "[0-9]"}}}, "structured_outputs.regexp", "takes json, regex"),
    ({"extra_body": {"structured_outputs": {}}}, "structured_outputs", "names no constraint"),
    ({"response_format": {**schema_format(PERSON), "scheme": 1}}, "response_format.scheme", "takes type, json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON, "stict": True}}},
     "response_format.json_schema.stict", "takes name, description, schema, strict"),
    ({"extra_body": {"structured_outputs": {"regex": "[0-9]", "disable_additional_properties": True}}},
     "structured_outputs.disable_additional_properties", "not supported"),
    ({"extra_body": {"guided_regex": "[0-9]", "guided_choice": ["a"]}}, "guided_choice", "one output constraint"),
    # strict: a misspelt keyword, which JSON Schema ignores, would leave the output unconstrained
    ({"response_format": schema_format({"type": "string", "maxlength": 3})},
     "response_format.json_schema.schema.maxlength", "not a JSON Schema keyword"),
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "string", "maxlength": 3}}})},
     "response_format.json_schema.schema.properties.a.maxlength", "not a JSON Schema keyword"),
    ({"response_format": schema_format({"anyOf": [{"type": "integer"}, {"type": "object", "requried": ["a"]}]})},
     "response_format.json_schema.schema.anyOf[1].requried", "not a JSON Schema keyword"),
    ({"response_format": schema_format({"$defs": {"p": {"propertys": {}}}, "$ref": "#/$defs/p"})},
     "response_format.json_schema.schema.$defs.p.propertys", "not a JSON Schema keyword"),
    ({"response_format": schema_format(PERSON, strict="yes")}, "response_format.json_schema.strict", "true or false"),
])
def test_a_bad_constraint_is_a_400_naming_it(client: openai.OpenAI, options: dict, param: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=5, **options)
    assert caught.value.body["param"] == param, caught.value.body
    assert param in caught.value.message and says in caught.value.message
    assert "Traceback" not in caught.value.message


def test_strict_takes_json_schemas_own_keywords_and_without_it_any_key(client: openai.OpenAI) -> None:
    """Under strict: true only keys JSON Schema does not define are refused; without it they are annotations, as
    JSON Schema has them."""
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema", "title": "Fox", "description": "a fox",
        "$defs": {"colour": {"type": "string", "enum": ["red", "brown"], "default": "red", "examples": ["red"]},
                  **{kind: {"type": "object", "properties": {"kind": {"const": kind}}, "required": ["kind"],
                            "additionalProperties": False} for kind in ("hole", "log")}},
        "definitions": {"legs": {"type": "integer", "minimum": 0, "maximum": 4, "$comment": "draft 7's name"}},
        "type": "object", "x-guidance": {"whitespace_flexible": False},
        "properties": {"colour": {"$ref": "#/$defs/colour"}, "legs": {"$ref": "#/definitions/legs"},
                       "name": {"anyOf": [{"type": "string", "pattern": "^[a-z]{1,5}$"}, {"type": "null"}]},
                       "tags": {"type": "array", "prefixItems": [{"const": "sly"}], "maxItems": 2},
                       "den": {"oneOf": [{"$ref": "#/$defs/hole"}, {"$ref": "#/$defs/log"}],  # as pydantic writes one
                               "discriminator": {"propertyName": "kind", "mapping": {"hole": "#/$defs/hole"}}}},
        "required": ["colour", "legs", "name"], "additionalProperties": False,
    }
    reply = client.chat.completions.create(model="tiny", messages=PROMPT, response_format=schema_format(schema),
                                           temperature=0, max_tokens=60)
    if reply.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(reply.choices[0].message.content), schema)
    loose = client.chat.completions.create(model="tiny", messages=PROMPT, max_tokens=5,
                                           response_format=schema_format({"type": "string", "maxlength": 3}, False))
    assert loose.choices[0].message.content.startswith('"')


@pytest.mark.parametrize("depth", [1500, 5000])
def test_a_body_nested_too_deeply_to_read_says_so(server: ServeProcess, depth: int) -> None:
    """Python's JSON reader gives up on a body a thousand or so deep (a response_format schema, say), and FastAPI
    answered "There was an error parsing the body"."""
    schema = '{"type": "array", "items": ' * depth + "{}" + "}" * depth
    body = '{"model": "tiny", "prompt": "Hi", "response_format": {"type": "json_schema", "json_schema": ' \
           f'{{"name": "deep", "schema": {schema}}}}}}}'
    answer = httpx.post(f"{server.url}/v1/completions", content=body, timeout=60,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["message"] == "the body is not valid JSON here: it is nested too deeply"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("constraint,says", [
    ({"guided_regex": "a{1000000}"}, "the grammar engine cannot follow the regex: lexer error"),
    ({"guided_grammar": 'root ::= "x" root'}, "the grammar engine cannot follow the grammar: parser error"),
])
def test_a_constraint_the_grammar_engine_gives_up_on_is_a_400_not_an_empty_stop(
    client: openai.OpenAI, constraint: dict, says: str, stream: bool
) -> None:
    """llguidance's limits are met at compile time or at the first token; before this was caught, the first case
    answered 200 with empty text and finish_reason "stop", the second a 500 with the engine's state dump."""
    with pytest.raises(openai.BadRequestError) as caught:
        reply = client.completions.create(model="tiny", prompt="Answer:", max_tokens=8, stream=stream,
                                          extra_body=constraint)
        if stream:
            list(reply)
    assert says in caught.value.message and "<state>" not in caught.value.message, caught.value.message
    assert caught.value.body["param"] == next(iter(constraint)), "named as a constraint that does not compile is"
    again = client.completions.create(model="tiny", prompt="Answer:", max_tokens=4, extra_body={"guided_regex": "[0-9]+"})
    assert re.fullmatch("[0-9]+", again.choices[0].text), "the server goes on serving"
