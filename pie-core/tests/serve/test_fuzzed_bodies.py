"""Seeded random request bodies, valid and hostile, against every POST route of a live `pie serve`: each is answered
with a 2xx and a whole answer, or a 4xx in OpenAI's error JSON; never a 5xx, a cut stream or a traceback, and the
server stays healthy."""

from __future__ import annotations

import json
import random
import sys
from typing import Any

import httpx

from pie.testing.models import tiny_tokenizer
from pie.testing.serve_process import ServeProcess

REQUESTS = 200
SEED = 20261207
VOCAB = tiny_tokenizer().get_vocab_size()
CHAT = [{"role": "user", "content": "Hi"}]

Values = tuple[tuple[Any, ...], tuple[Any, ...]]
"""A field's values: some valid on their own (a request may still refuse them together), some never."""

HOSTILE: tuple[Any, ...] = (
    None, True, False, 0, -1, 2**63, -(2**63) - 1, 10**40, 1e308, -1e308, 5e-324, 0.5, "", "1", "x" * 3000, [], [1],
    ["a"], [[1]], {}, {"type": "text"}, [None], [-5, VOCAB], {"a": [{"b": None}]},
)
"""Values of every JSON type, and numbers at and past every bound, for any field."""

SAMPLING: dict[str, Values] = {
    "max_tokens": ((1, 2, 4, None), (-1, 2**63, 1.5)),
    "temperature": ((0, 1e-6, 0.7, 2, -0.0), (2.0001, -1)),
    "top_p": ((1e-9, 0.5, 1), (0, 1.01)),
    "top_k": ((-1, 0, 1, 50, VOCAB, 2**40), (-2,)),
    "min_p": ((0, 0.1, 1), (1.5, -0.1)),
    "seed": ((0, -1, 2**63 - 1, -(2**63)), (2**63, 1.5)),
    "stop": (("", "e", ["a", "b"], ["x" * 512], ["\n"] * 16), (["\n"] * 17, ["x" * 513], [1])),
    "stop_token_ids": (([], [1, 2], list(range(VOCAB))), ([-1], [VOCAB])),
    "ignore_eos": ((True, False), ("yes",)),
    "min_tokens": ((0, 1), (-1, 300)),
    "n": ((1, 2, 8, 64), (0, 65, True)),
    "stream": ((True, False), ("yes", 1)),
    "stream_options": (({"include_usage": True}, {"continuous_usage_stats": True}),
                       ({"include_usage": "yes"}, {"": 1}, {"include_usage": False, "continuous_usage_stats": True})),
    "presence_penalty": ((-2, 0, 2), (2.5,)),
    "frequency_penalty": ((-2, 2), (-3,)),
    "repetition_penalty": ((1e-300, 5e-324, 0.5, 2), (0, 3)),
    "logit_bias": (({"0": 100}, {"1": -100, "2": 100}, {str(i): 1 for i in range(VOCAB)}),
                   ({"5": 101}, {" 5": 1}, {str(VOCAB): 1}, {"1": "x"})),
    "response_format": (({"type": "json_object"}, {"type": "text"},
                         {"type": "json_schema", "json_schema": {"schema": {"type": "string", "maxLength": 3}}}),
                        ({"type": "json_schema"}, {"type": "xml"},
                         {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}, "strict": True}})),
    "guided_regex": (("[ab]{1,3}",), ("(", 5)),
    "guided_choice": ((["yes", "no"],), ([], "ab")),
    "best_of": ((None,), (2, -1)),
    "cache_salt": (("a",), ("",)),
    "model": (("tiny",), ("other", "x" * 10_000)),
}
CHAT_FIELDS: dict[str, Values] = {
    **SAMPLING,
    "messages": (([{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}],
                  [{"role": "user", "content": "q"}, {"role": "tool", "content": "42"}],
                  [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}]),
                 ([], [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url"}]}],
                  [{"role": "user", "content": [{"type": "text"}]}], [{"role": "bogus", "content": "x"}],
                  [{"role": "assistant", "content": None, "tool_calls": [{"id": "c"}]}],
                  [{"role": "user", "content": "q"}, {"role": "tool", "content": "42", "tool_call_id": "c"}])),
    "max_completion_tokens": ((1, 3), (0, 10**6)),
    "logprobs": ((True, False), (1,)),
    "top_logprobs": ((0, 5, 20), (21, -1)),
    "continue_final_message": ((False,), (True,)),
    "add_generation_prompt": ((True, False), ("no",)),
    "chat_template_kwargs": (({}, {"enable_thinking": False}, {"x": [1, {"y": None}]}), ({"messages": []}, [])),
    "reasoning_effort": ((None,), ("low",)),
}
COMPLETION_FIELDS: dict[str, Values] = {
    **SAMPLING,
    "prompt": (("Hi", ["a", "b"], [1, 2, 3], [[1, 2], [3]], list(range(200))),
               ("", [], [[]], [-1], [VOCAB], [1, "a"], [[[1]]], "x" * 9000, [True])),
    "logprobs": ((0, 5, 20), (21, True)),
    "echo": ((True, False), ("yes",)),
    "suffix": (("",), ("x",)),
}
RESPONSES_FIELDS: dict[str, Values] = {
    **{name: SAMPLING[name] for name in ("temperature", "top_p", "seed", "stream", "model")},
    "input": (("Hi", [{"role": "user", "content": [{"type": "input_text", "text": "a"}]}],
               [{"role": "user", "content": "q"}, {"type": "function_call", "call_id": "c", "name": "f",
                                                   "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c", "output": "42"}]),
              ([], "", [{"role": "user"}], [{"type": "reasoning"}],
               [{"role": "user", "content": [{"type": "input_image"}]}],
               [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "nope"}],
               [{"role": "user", "content": "q"}, {"type": "function_call_output", "call_id": "c", "output": "42"}])),
    "instructions": (("Be brief.", None), (5,)),
    "max_output_tokens": ((1, 3), (0, 10**6)),
    "stream_options": (({"include_obfuscation": False},), ({"include_usage": True},)),
    "text": (({"format": {"type": "json_object"}}, {"format": {"type": "text"}},
              {"format": {"type": "json_schema", "name": "s", "schema": {"type": "string", "maxLength": 3}}}),
             ({"format": {"type": "json_schema"}}, {"format": {"type": "xml"}}, {"formats": {}})),
    "tools": (([],), ([{"type": "web_search"}], [{"type": "function", "name": "f"}])),
    "tool_choice": (("none",), ("required", {"type": "file_search"})),
    "store": ((True, False, None), ("yes",)),
    "previous_response_id": ((None,), ("resp_1",)),
    "reasoning": ((None,), ({"effort": "low"},)),
}
TOKENIZE_FIELDS: dict[str, Values] = {
    "prompt": (("Hi", "x" * 9000), (["a"], 5)),
    "add_special_tokens": ((True, False), ("no",)),
}
DETOKENIZE_FIELDS: dict[str, Values] = {
    "tokens": (([], [1, 2], list(range(VOCAB))), ([-1], [VOCAB], [2**64], [1.5], [True], ["a"], [[1]], None)),
}
ROUTES: dict[str, tuple[dict[str, Any], dict[str, Values]]] = {
    "/v1/chat/completions": ({"model": "tiny", "messages": CHAT, "max_tokens": 2}, CHAT_FIELDS),
    "/v1/completions": ({"model": "tiny", "prompt": "Hi", "max_tokens": 2}, COMPLETION_FIELDS),
    "/v1/responses": ({"model": "tiny", "input": "Hi", "max_output_tokens": 2}, RESPONSES_FIELDS),
    "/tokenize": ({"model": "tiny", "prompt": "Hi"}, TOKENIZE_FIELDS),
    "/detokenize": ({"model": "tiny", "tokens": [1, 2]}, DETOKENIZE_FIELDS),
}
RAW_FIELDS = (
    b'"temperature": NaN', b'"top_p": Infinity', b'"max_tokens": -Infinity', b'"seed": 1e400',
    b'"stop": "\\ud800"', b'"\\ud800": 1', b'"": 1', b'"max_tokens": 1, "max_tokens": "x"',
    b'"max_tokens": ' + b"9" * (sys.get_int_max_str_digits() + 1), b'"user": ' + b"[" * 3000 + b"]" * 3000,
)
"""What a JSON encoder never writes: Python's extensions, lone surrogates, duplicate keys, numbers and nesting past
what the decoder takes."""


def random_body(rng: random.Random, path: str) -> dict[str, Any]:
    """The route's base body with a few fields set to valid values and, in half of them, one to a value it refuses
    or one of any type."""
    base, fields = ROUTES[path]
    body = dict(base)
    for name in rng.sample(sorted(fields), rng.randint(1, min(4, len(fields)))):
        body[name] = rng.choice(fields[name][0])
    if rng.random() < 0.5:
        name = rng.choice(sorted(fields))
        body[name] = rng.choice(fields[name][1]) if rng.random() < 0.6 else rng.choice(HOSTILE)
    elif rng.random() < 0.1:
        body["not_a_field"] = 1
    if isinstance(body.get("n"), int) and isinstance(body.get("max_tokens"), int) and body["n"] > 8:
        body["max_tokens"] = min(body["max_tokens"], 4)  # bounded work: 64 choices of many tokens take seconds here
    return body


def random_raw(rng: random.Random, path: str) -> bytes:
    base, _ = ROUTES[path]
    return json.dumps(base).encode()[:-1] + b", " + rng.choice(RAW_FIELDS) + b"}"


def check_answer(reply: httpx.Response, streamed: bool, sent: object, named: bool) -> None:
    """``named``: a 4xx names the field it refuses (every one but a refusal of the whole body)."""
    where = f"{reply.request.url.path} {str(sent)[:300]}"
    assert reply.status_code < 500, f"{reply.status_code} {reply.text[:500]} for {where}"
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert isinstance(error["message"], str) and error["message"], where
        assert error["type"] == "invalid_request_error" and "code" in error, where
        assert not named or isinstance(error["param"], str) and error["param"], f"{error} for {where}"
    elif streamed and reply.request.url.path == "/v1/responses":  # (no [DONE]; a Response holds "error": null)
        last = reply.text.rstrip().rsplit("\n\n", 1)[-1]
        ended = last.startswith(("event: response.completed", "event: response.incomplete"))
        assert ended and "event: error" not in reply.text, f"{reply.text[-300:]} for {where}"
    elif streamed:
        ended = reply.text.rstrip().endswith("data: [DONE]")
        assert ended and '"error"' not in reply.text, f"{reply.text[-300:]} for {where}"
    else:
        assert isinstance(reply.json(), dict), where


def test_random_and_hostile_bodies_get_a_2xx_or_a_4xx_and_the_server_stays_healthy(server: ServeProcess) -> None:
    rng = random.Random(SEED)
    paths = ["/v1/chat/completions"] * 3 + ["/v1/completions"] * 3 + ["/v1/responses"] * 3 + ["/tokenize",
                                                                                              "/detokenize"]
    answered = 0
    with httpx.Client(base_url=server.url, timeout=60, headers={"content-type": "application/json"}) as http:
        for _ in range(REQUESTS):
            path = rng.choice(paths)
            if rng.random() < 0.15:
                raw = random_raw(rng, path)
                check_answer(http.post(path, content=raw), False, raw, named=False)
            else:
                body = random_body(rng, path)
                check_answer(http.post(path, json=body), body.get("stream") is True, body, named=True)
            answered += 1
        assert http.get("/health").status_code == 200
    assert answered == REQUESTS
    assert "Traceback" not in server.log, server.log[-3000:]
