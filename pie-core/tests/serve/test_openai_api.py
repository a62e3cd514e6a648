"""The OpenAI-compatible endpoints through the official `openai` client, sync and async."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from pie.serve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
from pie.testing.models import EOS_TOKEN_ID
from pie.testing.serve_process import PIE, ServeProcess, named_bytes
from prometheus_client.parser import text_string_to_metric_families

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about the fox."}]


def chat_text(client: openai.OpenAI, messages: list[dict[str, str]], **options: object) -> tuple[str, str]:
    reply = client.chat.completions.create(model="tiny", messages=messages, **options)  # type: ignore[arg-type]
    return reply.choices[0].message.content or "", reply.choices[0].finish_reason


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == "tiny" and card.object == "model"
    assert 0 < card.created <= time.time(), "when the server started, not 0 (1970)"
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("gpt-4")


def test_every_answer_carries_the_servers_system_fingerprint(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2)
    assert re.fullmatch(r"fp_[0-9a-f]{12}", chat.system_fingerprint or ""), chat.system_fingerprint
    text = client.completions.create(model="tiny", prompt="A fox", max_tokens=2)
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True))
    assert {text.system_fingerprint} | {chunk.system_fingerprint for chunk in chunks} == {chat.system_fingerprint}


def test_the_system_fingerprint_follows_what_decides_the_numbers(tiny_model: Path) -> None:
    """The same model, engine and settings give the same fingerprint; another KV type or model source another."""
    from pie.runtime.llm import LLM
    from pie.serve.app import system_fingerprint

    def loaded(**options: object) -> LLM:
        return LLM.load(str(tiny_model), "cpu", max_cached_tokens=64, **options)  # type: ignore[arg-type]

    first = system_fingerprint(loaded(), "tiny.gguf")
    assert system_fingerprint(loaded(), "tiny.gguf") == first
    assert system_fingerprint(loaded(), "other.gguf") != first
    assert system_fingerprint(loaded(kv_dtype="bfloat16"), "tiny.gguf") != first


def test_chat_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=12, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_stream_options_refuse_an_unknown_key_and_take_openais_obfuscation_flag(client: openai.OpenAI) -> None:
    """A misspelt include_usage was ignored: the stream came without its usage, and nothing said why."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True,
                                       stream_options={"include_usag": True})  # type: ignore[typeddict-unknown-key]
    assert refused.value.body["param"] == "stream_options.include_usag", refused.value.body
    assert refused.value.body["message"].startswith("stream_options.include_usag: not a field this server knows")
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True, "include_obfuscation": True}))
    assert chunks[-1].usage.completion_tokens == 2 and all(chunk.usage is None for chunk in chunks[:-1])
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True, stream_options={
            "include_usage": False, "continuous_usage_stats": True})  # type: ignore[typeddict-unknown-key]
    assert refused.value.body["param"] == "stream_options.continuous_usage_stats", refused.value.body


@pytest.mark.parametrize("options", [{"include_usage": True, "continuous_usage_stats": True},
                                     {"continuous_usage_stats": True}], ids=["with-include_usage", "alone"])
def test_continuous_usage_stats_put_each_choices_usage_so_far_on_its_chunks(client: openai.OpenAI,
                                                                             options: dict[str, bool]) -> None:
    """vLLM's option: each chunk carries the usage of the choice it holds, its prompt and its tokens so far (a
    completions batch's choices have their own prompts); the last chunk has the whole request's, as ever."""
    prompts = [[5, 6, 7], [5, 6, 7, 8, 9]]
    chunks = list(client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=6, temperature=1.0, seed=2,
                                            stream=True, stream_options=options,  # type: ignore[arg-type]
                                            extra_body={"ignore_eos": True}))
    *choice_chunks, last = chunks
    assert last.choices == [] and last.usage.prompt_tokens == 3 + 5 and last.usage.completion_tokens == 24
    so_far: dict[int, int] = {}
    for chunk in choice_chunks:
        (choice,) = chunk.choices
        usage = chunk.usage
        assert usage is not None, chunk
        assert usage.prompt_tokens == len(prompts[choice.index // 2])
        assert usage.completion_tokens >= so_far.get(choice.index, 0)
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        so_far[choice.index] = usage.completion_tokens
    assert so_far == {0: 6, 1: 6, 2: 6, 3: 6}
    chat = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, stream=True,
                                               stream_options=options,  # type: ignore[arg-type]
                                               extra_body={"ignore_eos": True}))
    assert chat[0].choices[0].delta.role == "assistant" and chat[0].usage.completion_tokens == 0
    assert chat[-2].usage.completion_tokens == 3 and chat[-1].usage.completion_tokens == 3
    assert chat[0].usage.prompt_tokens == chat[-1].usage.prompt_tokens


def test_response_ids_are_random_and_a_streams_chunks_share_its_id(client: openai.OpenAI) -> None:
    """The id held the address of a server object (``id()``) and the engine's step count: what it reveals of the
    server's memory helps an exploit, and two requests could get one id. OpenAI's are opaque and unique."""
    ids = [client.completions.create(model="tiny", prompt="Hi", max_tokens=1).id for _ in range(3)]
    ids += [client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1).id for _ in range(3)]
    streamed = {chunk.id for chunk in client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3,
                                                                     stream=True)}
    assert len(streamed) == 1
    ids += streamed
    assert len(set(ids)) == len(ids)
    assert all(re.fullmatch(r"(cmpl|chatcmpl)-[0-9a-f]{32}", id_) for id_ in ids), ids


def test_every_response_names_its_request_in_x_request_id(client: openai.OpenAI, server: ServeProcess) -> None:
    """As OpenAI's responses do (openai-python shows it as ``_request_id``, and on errors as ``request_id``): the
    client's own X-Request-Id, else the completion's id, else a new one. No response had one."""
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1)
    assert reply._request_id == reply.id
    text = client.completions.create(model="tiny", prompt="Hi", max_tokens=1, extra_headers={"X-Request-Id": "mine-1"})
    assert text._request_id == "mine-1"
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, stream=True)
    with stream:
        ids = {chunk.id for chunk in stream}
    assert ids == {stream.response.headers["x-request-id"]}
    streamed = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, stream=True,
                                         extra_headers={"X-Request-Id": "mine-2"})
    with streamed:
        assert streamed.response.headers["x-request-id"] == "mine-2"
    for headers in ({}, {"X-Request-Id": "mine-3"}):
        with pytest.raises(openai.BadRequestError) as refused:  # refused by the body's validation
            client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"stream": "yes"},
                                           extra_headers=headers)
        assert refused.value.request_id == headers.get("X-Request-Id", refused.value.request_id)
        assert refused.value.request_id and re.fullmatch(r"[\x20-\x7e]{1,128}", refused.value.request_id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=CHAT, extra_headers={"X-Request-Id": "mine-4"})
    assert missing.value.request_id == "mine-4"
    big = httpx.post(f"{server.url}/v1/completions", content=b"{" + b" " * (9 << 20) + b"}", timeout=30,
                     headers={"content-type": "application/json", "x-request-id": "mine-5"})
    assert big.status_code == 413 and big.headers["x-request-id"] == "mine-5"


@pytest.mark.parametrize("sent", ["x" * 129, "caf\u00e9", "a\tb"], ids=["too-long", "not-ascii", "tab"])
def test_an_x_request_id_past_128_printable_ascii_characters_is_not_sent_back(server: ServeProcess, sent: str) -> None:
    reply = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1},
                       headers=[(b"x-request-id", sent.encode())], timeout=30)
    assert reply.status_code == 200 and reply.headers["x-request-id"] == reply.json()["id"]


def test_completions_whole_and_streamed_agree_async(make_aclient: Callable[[], openai.AsyncOpenAI]) -> None:
    async def run() -> None:
        async with make_aclient() as aclient:
            whole = await aclient.completions.create(model="tiny", prompt="The quick brown", max_tokens=10,
                                                     temperature=0)
            assert whole.object == "text_completion" and whole.usage.completion_tokens == 10
            stream = await aclient.completions.create(
                model="tiny", prompt="The quick brown", max_tokens=10, temperature=0, stream=True)
            text = "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
            assert text == whole.choices[0].text
            batch = await aclient.completions.create(
                model="tiny", prompt=["The quick brown", "A paged key"], max_tokens=5, temperature=0, n=2)
            assert sorted(c.index for c in batch.choices) == [0, 1, 2, 3]
            first = {c.index: c.text for c in batch.choices}
            assert first[0] == first[1] == whole.choices[0].text[: len(first[0])]

    asyncio.run(run())


def test_n_choices_fork_one_computed_prompt(client: openai.OpenAI, server: ServeProcess) -> None:
    prompt = "Pie serves language models on every kind of hardware, n times."
    before = server.metrics()["pie:batch_tokens_total"]
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=6, temperature=0.9, seed=3, n=4,
                                      extra_body={"ignore_eos": True})
    forwarded = server.metrics()["pie:batch_tokens_total"] - before
    prompt_tokens = reply.usage.prompt_tokens
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3] and reply.usage.completion_tokens == 24
    assert reply.usage.prompt_tokens == prompt_tokens
    assert forwarded == prompt_tokens + 4 * 5, "the prompt runs once; each choice feeds back all but its last token"
    assert len({c.text for c in reply.choices}) > 1, "the choices sample apart (seed + index each)"


def test_stop_strings_end_a_choice_and_are_never_shown(client: openai.OpenAI) -> None:
    full, _ = chat_text(client, CHAT, max_tokens=24, temperature=0)
    stop = full[5:8]
    assert len(stop) == 3 and stop.strip()
    text, reason = chat_text(client, CHAT, max_tokens=24, temperature=0, stop=[stop, "never-there"])
    assert reason == "stop" and stop not in text and full.startswith(text) and len(text) == full.index(stop)
    chunks = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=24, temperature=0, stop=stop, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return chat_text(client, CHAT, max_tokens=16, temperature=1.0, top_p=0.95, seed=seed, extra_body={"top_k": 50, "min_p": 0.01})[0]

    assert sample(11) == sample(11)
    assert len({sample(seed) for seed in (1, 2, 3, 4)}) > 1


def test_logprobs_of_chat_and_completions(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 5
    for entry in entries:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert math.isclose(entry.logprob, max(t.logprob for t in entry.top_logprobs)), "greedy takes the top token"
        assert entry.bytes == named_bytes(entry.token)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == reply.choices[0].message.content
    text = client.completions.create(model="tiny", prompt="A paged", max_tokens=4, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    pieces = [bytes(named_bytes(token)) for token in logprobs.tokens]  # none starts inside a character
    assert logprobs.text_offset == [len(b"".join(pieces[:i]).decode("utf-8", "replace")) for i in range(4)]
    assert all(len(top) in (2, 3) and token in top for token, top in zip(logprobs.tokens, logprobs.top_logprobs))


def test_a_whole_response_that_could_hold_millions_of_logprobs_is_refused_and_a_stream_is_not(long_model: Path) -> None:
    """64 choices of the whole context with 20 top log-probabilities each came to hold 11 million of them (a few
    hundred bytes each) in the server until the response was sent; a few such requests took all its memory."""
    with ServeProcess("--model", str(long_model), "--served-model-name", "tiny", "--kv-tokens", "8192") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        _refuses_what_could_hold_millions_of_logprobs(client)
        assert server.stop() == 0, server.log


def _refuses_what_could_hold_millions_of_logprobs(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, n=64, logprobs=True, top_logprobs=20)
    assert refused.value.body["param"] == "top_logprobs" and "stream it" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=["a", "b", "c"], n=64, max_tokens=2000, logprobs=20)
    assert refused.value.body["param"] == "logprobs"
    stream = client.chat.completions.create(model="tiny", messages=CHAT, n=64, logprobs=True, top_logprobs=20,
                                            stream=True)
    with stream:
        first = next(iter(stream))
    assert first.choices
    few = client.chat.completions.create(model="tiny", messages=CHAT, n=64, max_tokens=2, logprobs=True,
                                         top_logprobs=20)
    assert len(few.choices) == 64 and all(len(c.logprobs.content[0].top_logprobs) == 20 for c in few.choices)


def prompt_ids(server: ServeProcess, text: str) -> list[int]:
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    return root.post("/tokenize", body={"prompt": text}, cast_to=object)["tokens"]


def forced_logprob(client: openai.OpenAI, prefix: list[int], token: int) -> float:
    """The model's log-probability of ``token`` after ``prefix``, from a completion forced to pick it (log-probabilities
    are taken before logit_bias)."""
    forced = client.completions.create(model="tiny", prompt=prefix, max_tokens=1, logprobs=0,
                                       logit_bias={str(token): 100})
    assert forced.choices[0].logprobs.tokens == [named(token, client)]
    return forced.choices[0].logprobs.token_logprobs[0]


def named(token: int, client: openai.OpenAI) -> str:
    """How log-probabilities name ``token``: its text, as /detokenize gives it for a whole character."""
    root = openai.OpenAI(base_url=str(client.base_url).removesuffix("/v1/"), api_key="unused", max_retries=0)
    return root.post("/detokenize", body={"tokens": [token]}, cast_to=object)["prompt"]


def test_echo_shows_the_prompt_before_each_choice_and_counts_only_the_output(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="A paged", max_tokens=4, temperature=0)
    echoed = client.completions.create(model="tiny", prompt="A paged", max_tokens=4, temperature=0, echo=True, n=2)
    assert [c.text for c in echoed.choices] == ["A paged" + plain.choices[0].text] * 2
    assert echoed.usage.completion_tokens == 2 * plain.usage.completion_tokens
    streamed = client.completions.create(model="tiny", prompt="A paged", max_tokens=4, temperature=0, echo=True,
                                         stream=True)
    texts = [chunk.choices[0].text for chunk in streamed]
    assert texts[0] == "A paged" and "".join(texts) == echoed.choices[0].text


def test_echo_with_logprobs_and_max_tokens_0_scores_the_prompt(client: openai.OpenAI, server: ServeProcess) -> None:
    """lm-evaluation-harness's loglikelihood requests: each prompt token's log-probability given those before it."""
    ids = prompt_ids(server, "The cache keeps pages")
    scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.top_logprobs[0] is None and choice.logprobs.text_offset[0] == 0
    for i in range(1, len(ids)):
        assert math.isclose(choice.logprobs.token_logprobs[i], forced_logprob(client, ids[:i], ids[i]), abs_tol=1e-4)
        assert len(choice.logprobs.top_logprobs[i]) in (1, 2)
    generating = client.completions.create(model="tiny", prompt=ids, max_tokens=2, logprobs=1, echo=True,
                                           temperature=0)
    assert generating.choices[0].logprobs.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs
    assert len(generating.choices[0].logprobs.tokens) == len(ids) + 2


def test_echoed_text_offsets_index_the_echoed_text(client: openai.OpenAI, server: ServeProcess) -> None:
    """The prompt's BOS is not in the echoed text: it takes no place (the first word's offset counted its spelling)."""
    ids = prompt_ids(server, "A paged cache")
    tokenized = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=0, echo=True)
    assert tokenized.choices[0].logprobs.tokens[0] == "<|endoftext|>", "the tiny model's tokenizer adds a BOS"
    for prompt in ("A paged cache", ids):
        for stream in (False, True):
            answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, logprobs=0, echo=True,
                                               temperature=0, stream=stream)
            chunks = list(answer) if stream else [answer]
            text = "".join(chunk.choices[0].text for chunk in chunks)
            tokens = [t for chunk in chunks if chunk.choices[0].logprobs for t in chunk.choices[0].logprobs.tokens]
            offsets = [o for chunk in chunks if chunk.choices[0].logprobs for o in chunk.choices[0].logprobs.text_offset]
            assert text.startswith("A paged cache") and offsets[:2] == [0, 0], (offsets, tokens)
            for token, start, end in zip(tokens[1:], offsets[1:], [*offsets[2:], len(text)]):
                assert text[start:end] == token, (text, tokens, offsets)


def test_chat_template_kwargs_are_taken_and_what_they_may_not_hold_is_refused(client: openai.OpenAI,
                                                                             server: ServeProcess) -> None:
    """Clients of Qwen3-style models send vLLM's chat_template_kwargs ({"enable_thinking": false}); it was a 400."""
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert reply.choices[0].finish_reason in ("length", "stop")
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    counted = root.post("/tokenize", cast_to=object, body={"messages": CHAT,
                                                          "chat_template_kwargs": {"enable_thinking": False}})
    assert counted["count"] == root.post("/tokenize", cast_to=object, body={"messages": CHAT})["count"]
    for variables, fragment in (({"messages": []}, "'messages' is set by the server"),
                                ({"note": "<|im_start|>system"}, "spells the control token")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                           extra_body={"chat_template_kwargs": variables})
        assert refused.value.body["param"] == "chat_template_kwargs" and fragment in refused.value.body["message"]


def test_max_tokens_0_is_only_for_an_echoed_prompt(client: openai.OpenAI) -> None:
    for request in (lambda: client.completions.create(model="tiny", prompt="a", max_tokens=0),
                    lambda: client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=0)):
        with pytest.raises(openai.BadRequestError) as refused:
            request()
        assert refused.value.body["param"] == "max_tokens" and "echo" in refused.value.body["message"]


def test_a_prompt_longer_than_a_scoring_chunk_is_scored_across_its_chunks(long_model: Path) -> None:
    """The prompt's logits are taken PROMPT_LOGPROB_CHUNK (256) tokens at a time: the tokens at the chunks' edges
    are scored from the right rows."""
    with ServeProcess("--model", str(long_model), "--served-model-name", "tiny", "--kv-tokens", "8192") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        ids = prompt_ids(server, " ".join(f"page {i}" for i in range(300)))
        assert len(ids) > 520
        scored = client.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=0, echo=True)
        logprobs = scored.choices[0].logprobs.token_logprobs
        assert len(logprobs) == len(ids) and logprobs[0] is None and all(lp <= 0 for lp in logprobs[1:])
        for i in (1, 255, 256, 257, 512, 513, len(ids) - 1):
            assert math.isclose(logprobs[i], forced_logprob(client, ids[:i], ids[i]), abs_tol=1e-4), i
        assert server.stop() == 0, server.log


EMOJI = "😀".encode()
BYTE_NAMES = {f"bytes:\\x{byte:02x}": byte for byte in EMOJI}
"""The emoji's four bytes, each a token of the tiny vocabulary, as log-probabilities name them."""


def emoji_bias(server: ServeProcess) -> dict[str, int]:
    """A logit_bias that makes the tiny model write only the emoji's byte tokens."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    tokens = root.post("/tokenize", body={"prompt": "😀", "add_special_tokens": False}, cast_to=object)["tokens"]
    assert len(tokens) == 4, "one token per byte"
    return {str(token): 100 for token in tokens}


def test_logprobs_give_a_token_that_is_part_of_a_character_its_own_bytes(client: openai.OpenAI,
                                                                        server: ServeProcess) -> None:
    """Each token decoded alone was U+FFFD, its bytes [239, 191, 189]: OpenAI's bytes are the token's own, and
    a token that is no text on its own is named ``bytes:\\xNN``."""
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                           top_logprobs=5, logit_bias=emoji_bias(server))
    entries = reply.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        assert entry.token in BYTE_NAMES and entry.bytes == [BYTE_NAMES[entry.token]], (entry.token, entry.bytes)
        assert all(top.bytes == named_bytes(top.token) for top in entry.top_logprobs), entry.top_logprobs
    joined = bytes(byte for entry in entries for byte in entry.bytes)
    assert joined.decode("utf-8", "replace") == reply.choices[0].message.content
    assert any(t.token.startswith("bytes:") for e in entries for t in e.top_logprobs), "the check above checked one"


def test_completion_top_logprobs_keep_tokens_apart_and_hold_the_sampled_one(client: openai.OpenAI,
                                                                            server: ServeProcess) -> None:
    """Keyed by decoded text, every part of a character was one U+FFFD key: twenty asked, fewer given. The
    sampled token is always there, as at OpenAI and vLLM (logprobs + 1 entries at most)."""
    text = client.completions.create(model="tiny", prompt="Emoji:", max_tokens=4, temperature=0, logprobs=20,
                                     logit_bias=emoji_bias(server))
    logprobs = text.choices[0].logprobs
    assert set(logprobs.tokens) <= set(BYTE_NAMES)
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert len(top) in (20, 21) and top[token] == value, (token, top)
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert sum(key.startswith("bytes:") for key in logprobs.top_logprobs[0]) > 1, "parts of characters were listed"
    sampled = client.completions.create(model="tiny", prompt="Once upon", max_tokens=8, temperature=1.5, seed=7,
                                        logprobs=1).choices[0].logprobs
    assert all(token in top and len(top) in (1, 2) for token, top in zip(sampled.tokens, sampled.top_logprobs))
    assert any(len(top) == 2 for top in sampled.top_logprobs), "a token other than the most likely one was drawn"
    alone = client.completions.create(model="tiny", prompt="Once upon", max_tokens=3, temperature=0,
                                      logprobs=0).choices[0].logprobs
    assert alone.top_logprobs == [{t: v} for t, v in zip(alone.tokens, alone.token_logprobs)]


def test_logprobs_are_the_models_own_before_logit_bias(client: openai.OpenAI, server: ServeProcess) -> None:
    """Run alone, it failed: the plain request computed the whole prompt and the biased one read its cached pages,
    whose log-probabilities differ by a few millionths. Both now read them: the same computation."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    for _ in range(2):  # the first puts the prompt's pages in the prefix cache (if no test before did)
        plain = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, temperature=0, logprobs=True,
                                               top_logprobs=5).choices[0].logprobs.content[0]
    for other in plain.top_logprobs[1:]:  # one that is not the model's choice, and one token when tokenized
        ids = root.post("/tokenize", body={"prompt": other.token, "add_special_tokens": False}, cast_to=object)["tokens"]
        if len(ids) == 1:
            break
    else:
        pytest.fail(f"no single-token alternative in {plain.top_logprobs}")
    biased = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, temperature=0.7, logprobs=True,
                                            top_logprobs=5, logit_bias={str(ids[0]): 100}).choices[0].logprobs.content[0]
    assert biased.token == other.token and biased.logprob == pytest.approx(other.logprob, abs=1e-6)
    assert [t.token for t in biased.top_logprobs] == [t.token for t in plain.top_logprobs]
    assert [t.logprob for t in biased.top_logprobs] == pytest.approx([t.logprob for t in plain.top_logprobs], abs=1e-6)


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_stream_of_n_choices_sends_one_choice_per_chunk(client: openai.OpenAI, kind: str) -> None:
    """As OpenAI and vLLM do: clients read ``chunk.choices[0]``."""
    options = dict(model="tiny", max_tokens=4, temperature=1.0, seed=5, n=3)
    if kind == "chat":
        whole = client.chat.completions.create(messages=CHAT, **options)
        chunks = list(client.chat.completions.create(messages=CHAT, stream=True, **options))
        assert [c.choices[0].delta.role for c in chunks[:3]] == ["assistant"] * 3
        assert [c.choices[0].index for c in chunks[:3]] == [0, 1, 2]
        texts = {c.index: c.message.content for c in whole.choices}
        piece = lambda choice: choice.delta.content or ""  # noqa: E731
    else:
        whole = client.completions.create(prompt="The quick brown", **options)
        chunks = list(client.completions.create(prompt="The quick brown", stream=True, **options))
        texts = {c.index: c.text for c in whole.choices}
        piece = lambda choice: choice.text  # noqa: E731
    assert all(len(c.choices) == 1 for c in chunks), [len(c.choices) for c in chunks]
    streamed = {index: "".join(piece(c.choices[0]) for c in chunks if c.choices[0].index == index) for index in texts}
    assert streamed == texts and len(set(texts.values())) > 1


def test_greedy_chat_equals_pie_run(client: openai.OpenAI, tiny_model: Path) -> None:
    prompt = "What does a paged cache keep?"
    run = subprocess.run([PIE, "run", "--model", str(tiny_model), "--engine", "cpu", "--max-tokens", "20", prompt],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    text, _ = chat_text(client, [{"role": "user", "content": prompt}], max_tokens=20, temperature=0)
    assert text == run.stdout.removesuffix("\n")


def test_tokenize_and_detokenize(server: ServeProcess) -> None:
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    tokens = root.post("/tokenize", body={"model": "tiny", "prompt": "Héllo wörld"}, cast_to=object)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 256
    back = root.post("/detokenize", body={"model": "tiny", "tokens": tokens["tokens"]}, cast_to=object)
    assert back["prompt"] == "Héllo wörld"
    typed = root.post("/tokenize", body={"messages": [{"role": "user", "content": "x<|im_start|>system"}]},
                      cast_to=object)
    start = root.post("/tokenize", body={"prompt": "<|im_start|>", "add_special_tokens": False}, cast_to=object)
    assert len(start["tokens"]) > 1, "typed text is text, even for /tokenize"
    assert typed["tokens"].count(1) == 2, "the template's two <|im_start|> are control tokens; the typed one is not"
    for body, given in (({}, "neither"), ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "both")):
        with pytest.raises(openai.BadRequestError, match=rf"give prompt or messages \(this request gives {given}\)"):
            root.post("/tokenize", body=body, cast_to=object)


def test_continue_final_message_goes_on_from_the_assistants_text(server: ServeProcess, client: openai.OpenAI) -> None:
    """vLLM's option (it was a 400, an unknown field): the reply continues the final message instead of a new turn."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    begun = [*CHAT, {"role": "assistant", "content": "The fox"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    open_ids = root.post("/tokenize", body={"messages": begun, **flags}, cast_to=object)["tokens"]
    closed_ids = root.post("/tokenize", body={"messages": begun, "add_generation_prompt": False}, cast_to=object)["tokens"]
    assert len(open_ids) < len(closed_ids) and closed_ids[: len(open_ids)] == open_ids, "the same, without its end"
    reply = client.chat.completions.create(model="tiny", messages=begun, max_tokens=8, temperature=0, extra_body=flags)
    going_on = client.completions.create(model="tiny", prompt=open_ids, max_tokens=8, temperature=0)
    assert reply.usage.prompt_tokens == len(open_ids)
    assert reply.choices[0].message.content == going_on.choices[0].text
    with pytest.raises(openai.BadRequestError, match="cannot both be true"):
        client.chat.completions.create(model="tiny", messages=begun, extra_body={"continue_final_message": True})


def test_a_text_completion_without_max_tokens_stops_at_sixteen_as_openai_does(client: openai.OpenAI) -> None:
    """OpenAI's default for /v1/completions; a chat completion without it may use the rest of the context."""
    text = client.completions.create(model="tiny", prompt="The quick brown", extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 16 and text.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="tiny", messages=CHAT, extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 256, "the tiny model's whole context"


@pytest.mark.parametrize(
    "options,param",
    [
        ({"temperature": 5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop": [str(i) for i in range(20)]}, "stop"),
        ({"stop": ["\n", "x" * 513]}, "stop"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),  # the template cannot show them
        ({"tool_choice": "required"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),  # it was named "functions", which the request did not send
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"logit_bias": {"99999": 5}}, "logit_bias"),
        ({"seed": 2**63}, "seed"),
        ({"seed": -(2**63) - 1}, "seed"),
    ],
)
def test_a_bad_parameter_is_a_400_naming_it(client: openai.OpenAI, options: dict[str, object], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=CHAT, **options)  # type: ignore[arg-type]
    assert caught.value.body["param"] == param and param in caught.value.message


@pytest.mark.parametrize("key", [" 5", "+5", "1_0", "05", "\u0665", "-1", "5.0", "x"])
def test_a_logit_bias_key_is_a_token_id_in_decimal(client: openai.OpenAI, key: str) -> None:
    """Python's int() read " 5", "+5", "05", "1_0" (token 10) and Arabic-Indic digits as token ids: a bias meant for
    one token, or a key that was no token id at all, biased another without a word."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, logit_bias={key: 5})
    assert refused.value.param == "logit_bias" and "token ids written in decimal" in refused.value.message


def test_suffix_and_best_of_are_refused_with_what_to_do_instead(client: openai.OpenAI) -> None:
    """A text completion's suffix (fill-in-the-middle) and best_of above n were refused as "... is not supported"."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="def add(a, b):", suffix="    return c", max_tokens=4)
    assert refused.value.param == "suffix" and "fill-in-the-middle prompt" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="The quick", n=1, best_of=3, max_tokens=4)
    assert refused.value.param == "best_of" and "ask for n choices" in refused.value.message
    assert client.completions.create(model="tiny", prompt="The quick", n=2, best_of=2, suffix="", max_tokens=1).choices


def test_seeds_take_the_signed_64_bit_range(client: openai.OpenAI) -> None:
    """vLLM's range: a negative seed is a reproducible draw of its own."""
    def sample(seed: int) -> str:
        return chat_text(client, CHAT, max_tokens=8, temperature=1.0, seed=seed)[0]

    drawn = {seed: sample(seed) for seed in (-1, -(2**63), 2**63 - 1)}
    assert all(sample(seed) == text for seed, text in drawn.items())
    assert len(set(drawn.values())) > 1


def test_a_text_part_without_text_is_a_400_naming_the_field(client: openai.OpenAI) -> None:
    message: list = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text"}]}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="tiny", messages=message, max_tokens=2)
    assert caught.value.body["param"] == "messages[0].content[1].text"
    assert "has no 'text' field" in caught.value.message and "not supported" not in caught.value.message


def test_a_tool_call_in_the_conversation_is_a_400_naming_it(client: openai.OpenAI, server: ServeProcess) -> None:
    """A conversation with a tool call (begun on another model, or a router's fallback) was taken with the call
    dropped: the model saw an empty assistant turn where the client had sent a call. A model whose chat template
    shows no tool calls refuses them (test_tool_calls.py serves one that shows them), and the older function_call
    is refused everywhere."""
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 41}'}}
    called: list = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    legacy: list = [*CHAT, {"role": "assistant", "content": None, "function_call": call["function"]}, CHAT[1]]
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    for messages, param, why in ((called, "messages[2].tool_calls", "chat template cannot show tool calls"),
                                 (legacy, "messages[2].function_call", "not supported")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
        assert refused.value.param == param and why in refused.value.message, refused.value.body
        with pytest.raises(openai.BadRequestError) as refused:
            root.post("/tokenize", body={"messages": messages}, cast_to=object)
        assert refused.value.param == param, refused.value.body
    none_called: list = [*CHAT, {"role": "assistant", "content": "Hi.", "tool_calls": [], "function_call": None},
                         CHAT[1]]
    assert client.chat.completions.create(model="tiny", messages=none_called, max_tokens=1).choices


def test_tools_are_refused_where_the_chat_template_cannot_show_them(client: openai.OpenAI) -> None:
    """The tiny model's template never mentions tools: they would not reach the model, so they are refused, not
    dropped (test_tool_calls.py serves a template that shows them); a text completion has no tools."""
    tool: dict = {"type": "function", "function": {"name": "f"}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, tools=[tool], max_tokens=1)
    assert refused.value.param == "tools" and "chat template cannot show tools" in refused.value.message
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt="x", max_tokens=1, extra_body={"tools": [tool]})
    assert refused.value.param == "tools" and "/v1/chat/completions" in refused.value.message


def test_a_message_of_an_unknown_role_is_a_400_naming_it(client: openai.OpenAI) -> None:
    robot: list = [{"role": "robot", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match="'user'") as caught:
        client.chat.completions.create(model="tiny", messages=robot)
    assert caught.value.body["param"] == "messages[0].role"


def test_a_developer_message_is_a_system_message_to_a_template_without_that_role(client: openai.OpenAI,
                                                                               server: ServeProcess) -> None:
    """OpenAI's newer clients send the system prompt as a developer message; the tiny model's template, as most
    open models' do, knows no such role, and the request was refused with the template's "unknown role developer"."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    as_developer = [{"role": "developer", "content": CHAT[0]["content"]}, CHAT[1]]
    assert root.post("/tokenize", body={"messages": as_developer}, cast_to=object) == \
        root.post("/tokenize", body={"messages": CHAT}, cast_to=object)
    replies = [client.chat.completions.create(model="tiny", messages=messages,  # type: ignore[arg-type]
                                              max_tokens=6, temperature=0) for messages in (as_developer, CHAT)]
    assert len({(reply.choices[0].message.content, reply.usage.prompt_tokens) for reply in replies}) == 1


def test_a_prompt_past_the_context_is_a_400_with_both_numbers(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match=r"prompt \(\d+ tokens\) plus max_tokens \(300\).*context of 256"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=300)
    with pytest.raises(openai.BadRequestError, match="fills the model's context of 256"):
        client.completions.create(model="tiny", prompt=[5] * 256)
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model="tiny", prompt=[5, 100000], max_tokens=2)


OVERFLOW = re.compile(r"This model's maximum context length is 256 tokens\. However, you requested (at least )?(\d+) "
                      r"tokens \((at least )?(\d+) in the (messages|prompt), (\d+) in the completion\)\. \S")
"""OpenAI's and vLLM's sentence for a request past the context, then Pie's own account."""


def test_a_request_past_the_context_is_refused_in_openais_words(client: openai.OpenAI) -> None:
    """LangChain raises its context-overflow error on the code ``context_length_exceeded``, LiteLLM its
    ContextWindowExceededError on OpenAI's sentence: a client trims or falls back on them. Pie's own wording and
    ``invalid_value`` matched neither."""
    long_text = "word " * 3000  # past what 256 tokens can hold, refused before it is tokenized
    refusals = {
        ("messages", 300): lambda: client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=300),
        ("prompt", 300): lambda: client.completions.create(model="tiny", prompt="The quick brown", max_tokens=300),
        ("prompt", 1): lambda: client.completions.create(model="tiny", prompt=[5] * 256),  # no room left at all
        ("messages", 2): lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": long_text}], max_tokens=2),
    }
    for (where, completion), request in refusals.items():
        with pytest.raises(openai.BadRequestError) as refused:
            request()
        assert refused.value.code == "context_length_exceeded", refused.value.body
        found = OVERFLOW.match(refused.value.body["message"])
        assert found, refused.value.body["message"]
        at_least, requested, _, prompt, said_where, said_completion = found.groups()
        assert (said_where, int(said_completion)) == (where, completion), refused.value.body["message"]
        assert int(requested) == int(prompt) + completion and int(prompt) > 0
        assert bool(at_least) == (completion == 2), "only the untokenized prompt is counted from below"


def test_unknown_model_path_body_and_json(server: ServeProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="'gpt-4' does not exist; this server serves 'tiny'"):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    missing = httpx.get(f"{server.url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and "no such path" in missing.json()["error"]["message"]
    browsed = httpx.get(f"{server.url}/v1/chat/completions", timeout=10)  # it was "Method Not Allowed"
    assert browsed.status_code == 405 and browsed.headers["allow"] == "POST"
    assert browsed.json()["error"]["message"] == "GET /v1/chat/completions: this path takes POST"
    big = httpx.post(f"{server.url}/v1/completions", content=b"{" + b" " * (9 << 20) + b"}", timeout=30,
                     headers={"content-type": "application/json"})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    broken = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": ', timeout=10,
                        headers={"content-type": "application/json"})
    assert broken.status_code == 400, broken.text
    assert broken.json()["error"]["message"] == "the body is not valid JSON: Expecting value at character 11"
    latin1 = httpx.post(f"{server.url}/v1/completions", content='{"prompt": "café"}'.encode("latin-1"), timeout=10,
                        headers={"content-type": "application/json"})  # it was "There was an error parsing the body"
    assert latin1.status_code == 400 and "byte 15 of the body (0xe9) is not UTF-8" in latin1.json()["error"]["message"]
    digits = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": ' + b"1" * 5000 + b"}",
                        timeout=10, headers={"content-type": "application/json"})  # it was "There was an error parsing the body"
    assert digits.status_code == 400, digits.text
    assert digits.json()["error"]["message"] == ("the body is not valid JSON here: a number in it has more than "
                                                 f"{sys.get_int_max_str_digits()} digits")
    assert httpx.get(f"{server.url}/health", timeout=10).json() == {"status": "ready"}


def test_an_error_quotes_only_the_start_of_what_was_sent_and_names_the_field(client: openai.OpenAI) -> None:
    # An 8 MiB model name or logit_bias key came back whole in the error, a bad grammar its 10 KB.
    big = "x" * 100_000

    def chat(messages: list = CHAT, **options: object) -> object:  # type: ignore[type-arg]
        return client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, **options)  # type: ignore[arg-type]

    sent = {
        "model": lambda: client.chat.completions.create(model=big, messages=CHAT),
        "logit_bias": lambda: chat(logit_bias={big: 1}),
        "logit_bias.xxx": lambda: chat(extra_body={"logit_bias": {big: "high"}}),
        "response_format": lambda: chat(extra_body={"response_format": {"type": big}}),
        "response_format.xxx": lambda: chat(extra_body={"response_format": {"type": "json_object", big: 1}}),
        "xxx": lambda: chat(extra_body={big: 1}),
        "guided_grammar": lambda: chat(extra_body={"guided_grammar": f"start: {big} ((("}),
        "messages[0].content": lambda: chat(messages=[{"role": "user", "content": [{"type": big}]}]),
    }
    for param, request in sent.items():
        with pytest.raises(openai.APIStatusError) as caught:
            request()
        error = caught.value.body
        assert isinstance(error, dict) and error["param"].startswith(param), (param, str(error)[:300])
        assert len(error["param"]) <= 100 and len(error["message"]) <= 1000, param


def test_a_client_that_leaves_mid_stream_frees_its_pages_and_is_counted(server: ServeProcess) -> None:
    cancelled = server.metrics()["pie:requests_cancelled_total"]
    body = {"model": "tiny", "prompt": "Leaving early, " * 4, "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    from pie.testing.serve_process import wait_until

    def idle() -> bool:
        sample = server.metrics()
        return sample["pie:kv_pages_used"] == 0 and sample["pie:requests_running"] == 0

    assert wait_until(idle, timeout=20), server.metrics()
    assert server.metrics()["pie:requests_cancelled_total"] == cancelled + 1
    httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "max_tokens": 2}, timeout=30)
    assert server.metrics()["pie:requests_cancelled_total"] == cancelled + 1, "a request that ended is not counted"


def test_fields_that_change_nothing_here_are_accepted_and_max_completion_tokens_counts(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="tiny", messages=CHAT, max_completion_tokens=3, temperature=0, user="u-1", metadata={"team": "a"},
        store=False, extra_body={"prompt_cache_key": "k"})
    assert reply.usage.completion_tokens == 3


@pytest.mark.parametrize(("field", "value", "says"), [
    ("reasoning_effort", "low", "goes in chat_template_kwargs"),
    ("verbosity", "low", "OpenAI's option for its GPT-5 models"),
    ("web_search_options", {}, "web search is not supported"),
    ("moderation", {"model": "omni-moderation-latest"}, "nothing would check"),
])
def test_openais_options_for_its_own_models_are_refused_as_such(client: openai.OpenAI, field: str, value: object,
                                                                 says: str) -> None:
    """They were refused as "not a field this server knows (a misspelling...)": the client's field is OpenAI's own."""
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                       **{field: value})  # type: ignore[arg-type]
    assert refused.value.param == field and says in refused.value.message, refused.value.body


def test_openais_prompt_cache_lifetime_is_taken(client: openai.OpenAI) -> None:
    """Like prompt_cache_key, it changes nothing a model computes here; it was a 400."""
    reply = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, prompt_cache_retention="24h",
                                           extra_body={"prompt_cache_options": {"ttl": "30m"}})
    assert reply.usage.completion_tokens == 2


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_past_the_context_is_a_400_naming_the_field_sent(client: openai.OpenAI, field: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=CHAT, **{field: 10**9})
    assert refused.value.param == field, refused.value.body


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"max_token": 5}, "max_token", "not a field this server knows"),  # a misspelling would have run to the end
        ({"use_beam_search": True}, "use_beam_search", "not a field this server knows"),  # vLLM's: no beams here
        ({"typical_p": 0.9}, "typical_p", "not a field this server knows"),  # llama.cpp's
        ({"stream": "yes"}, "stream", "Input should be a valid boolean"),
        ({"n": True}, "n", "Input should be a valid integer"),
        ({"stop": [1, 2]}, "stop", "not of a type this field takes"),
    ],
    ids=["misspelled-max_tokens", "use_beam_search", "typical_p", "string-for-a-boolean", "boolean-for-a-number",
         "numbers-for-stop-strings"],
)
def test_unknown_fields_and_values_of_another_type_are_a_400_naming_the_field(
    server: ServeProcess, body: dict, param: str, message: str
) -> None:
    """As OpenAI does: a field the server would ignore, or a value it would have to guess at, is refused."""
    for path, base in (("chat/completions", {"messages": CHAT}), ("completions", {"prompt": "Hi"})):
        reply = httpx.post(f"{server.url}/v1/{path}", json={"model": "tiny", "max_tokens": 2, **base, **body}, timeout=30)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and error["message"].startswith(f"{param}: {message}"), error



@pytest.mark.parametrize(("path", "fields", "param"), [
    ("v1/completions", rb'"": 1', '""'),
    ("v1/completions", rb'"stream": true, "stream_options": {"": true}', 'stream_options.""'),
    ("v1/chat/completions", rb'"\ud800x": 1', "\\ud800x"),
    ("v1/completions", rb'"stream": true, "stream_options": {"\udfff": true}', "stream_options.\\udfff"),
    ("tokenize", rb'"\ud800": 1', "\\ud800"),
    ("detokenize", rb'"tokens": [1], "\ud800": 1', "\\ud800"),
], ids=["empty", "empty-in-stream_options", "lone-surrogate", "lone-surrogate-in-stream_options", "tokenize",
        "detokenize"])
def test_an_unknown_field_whose_name_is_empty_or_not_unicode_is_named(server: ServeProcess, path: str, fields: bytes,
                                                                      param: str) -> None:
    """An empty name was refused naming no field ("not a field this server knows", param null), and one holding half a
    UTF-16 pair with pydantic's "Input should be a valid string, unable to parse raw data as a unicode string"."""
    given = {"v1/chat/completions": b'"messages": [{"role": "user", "content": "Hi"}], ', "detokenize": b""}
    body = b'{"model": "tiny", ' + given.get(path, b'"prompt": "Hi", ') + fields + b"}"
    reply = httpx.post(f"{server.url}/{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["message"] == f"{param}: not a field this server knows (a misspelling, " \
        "or an option it does not have)", error

DEFAULTED_FIELDS = {
    "chat/completions": ("n", "stream", "logprobs", "presence_penalty", "frequency_penalty", "add_generation_prompt",
                         "continue_final_message", "ignore_eos", "min_tokens", "repetition_penalty"),
    "completions": ("n", "stream", "presence_penalty", "frequency_penalty", "echo", "ignore_eos", "min_tokens",
                    "repetition_penalty"),
    "tokenize": ("add_special_tokens", "add_generation_prompt", "continue_final_message"),
}
"""The fields whose default is not null (``stream: false``, ``n: 1``...)."""
BODIES = {"chat/completions": {"model": "tiny", "max_tokens": 3, "temperature": 0, "messages": CHAT},
          "completions": {"model": "tiny", "max_tokens": 3, "temperature": 0, "prompt": "The quick brown"},
          "tokenize": {"model": "tiny", "messages": CHAT}}


def test_every_field_with_a_default_is_listed_for_the_null_test() -> None:
    requests = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest, "tokenize": TokenizeRequest}
    for path, request in requests.items():
        defaulted = {name for name, field in request.model_fields.items()
                     if not field.is_required() and field.default is not None}
        assert defaulted == set(DEFAULTED_FIELDS[path]), path


@pytest.mark.parametrize(("path", "field"), [(path, field) for path, fields in DEFAULTED_FIELDS.items()
                                             for field in fields])
def test_null_for_a_field_with_a_default_is_that_default(server: ServeProcess, path: str, field: str) -> None:
    """OpenAI's fields are all "or null", and vLLM takes null for the default: a client that writes an unset option
    as null (``n=kwargs.get("n")``, SDKs of other languages) got a 400 ("n: Input should be a valid integer")."""
    root = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
    url = f"/v1/{path}" if path != "tokenize" else "/tokenize"
    root.post(url, body=BODIES[path], cast_to=object)  # the prompt in the prefix cache: both find it there
    reply = root.post(url, body={**BODIES[path], field: None}, cast_to=object)
    alone = root.post(url, body=BODIES[path], cast_to=object)
    assert isinstance(reply, dict), reply
    assert {k: v for k, v in reply.items() if k not in ("id", "created")} == \
        {k: v for k, v in alone.items() if k not in ("id", "created")}


def test_null_stays_refused_where_a_field_needs_a_value(client: openai.OpenAI) -> None:
    for path, body in (("chat/completions", {"messages": None}), ("completions", {"prompt": None})):
        with pytest.raises(openai.BadRequestError) as refused:
            client.post(f"/{path}", body={"model": "tiny", **body}, cast_to=object)
        assert refused.value.body["param"] == next(iter(body)), refused.value.body


def test_a_user_message_without_content_is_a_400_and_head_probes_health(server: ServeProcess) -> None:
    for message in ({"role": "user"}, {"role": "system", "content": None}):
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=10,
                           json={"model": "tiny", "max_tokens": 2, "messages": [message]})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["message"] == f"a {message['role']} message needs content", reply.text
    answered = {"role": "assistant", "content": None}  # as a client sends back a reply that called a tool
    reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"model": "tiny", "max_tokens": 2, "messages": [*CHAT, answered, CHAT[1]]})
    assert reply.status_code == 200, reply.text
    head = httpx.head(f"{server.url}/health", timeout=10)
    assert head.status_code == 200 and head.content == b""


def test_time_per_output_token_is_per_choice(client: openai.OpenAI, server: ServeProcess) -> None:
    """With n = 4 the four choices' tokens were counted as one sequence's: a quarter of the real time per token."""
    before = server.metrics()
    client.completions.create(model="tiny", prompt="Four at once", n=4, max_tokens=12, temperature=1, seed=5,
                              extra_body={"ignore_eos": True})
    after = server.metrics()

    def added(name: str) -> float:
        return after[f"pie:{name}_sum"] - before[f"pie:{name}_sum"]

    between = added("e2e_request_latency_seconds") - added("time_to_first_token_seconds")  # last token - first
    assert added("time_per_output_token_seconds") == pytest.approx(between / 11, rel=1e-6)


def test_an_empty_body_is_named(server: ServeProcess) -> None:
    reply = httpx.post(f"{server.url}/v1/chat/completions", content=b"", timeout=10,
                       headers={"Content-Type": "application/json"})
    assert reply.status_code == 400 and reply.json()["error"]["message"] == "the request has no JSON body", reply.text


def test_a_body_that_is_no_json_object_says_to_send_one(client: openai.OpenAI, server: ServeProcess) -> None:
    """``curl -d`` sends no JSON Content-Type: the 400 said "Input should be a valid dictionary or object to extract
    fields from", with nothing on what to change."""
    body = b'{"model": "tiny", "prompt": "Hi", "max_tokens": 1}'
    for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}):
        reply = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=10)
        assert reply.status_code == 400, reply.text
        message = reply.json()["error"]["message"]
        assert "a JSON object" in message and "Content-Type: application/json" in message, message
        assert headers["Content-Type"] in message, "it says what was sent"
    with pytest.raises(openai.BadRequestError, match="Content-Type: application/json"):
        client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                       extra_headers={"Content-Type": "text/plain"})
    array = httpx.post(f"{server.url}/v1/completions", json=[1, 2], timeout=10)
    assert array.status_code == 400 and "the body must be a JSON object" in array.json()["error"]["message"], array.text


def test_metrics_count_what_was_served(client: openai.OpenAI, server: ServeProcess) -> None:
    before = server.metrics()
    reply = client.completions.create(model="tiny", prompt="Counting the metrics now", max_tokens=5, temperature=0)
    after = server.metrics()
    assert after["pie:prompt_tokens_total"] - before["pie:prompt_tokens_total"] == reply.usage.prompt_tokens
    assert after["pie:generation_tokens_total"] - before["pie:generation_tokens_total"] == 5
    finished = "pie:finished_choices_total{finish_reason=length}"
    assert after[finished] == before.get(finished, 0) + 1
    assert after["pie:time_to_first_token_seconds_count"] == before["pie:time_to_first_token_seconds_count"] + 1
    assert after["pie:e2e_request_latency_seconds_count"] == before["pie:e2e_request_latency_seconds_count"] + 1
    assert after["pie:time_per_output_token_seconds_count"] == before["pie:time_per_output_token_seconds_count"] + 1
    assert after["pie:scheduler_steps_total"] >= before["pie:scheduler_steps_total"] + 5
    assert after["pie:kv_pages_capacity"] == 4096 // 16 and after["pie:kv_pages_used"] == 0
    for name in ("pie:requests_running", "pie:requests_waiting", "pie:kv_pages_cached", "pie:prefix_cache_hits_total",
                 "pie:prefix_cache_queries_total", "pie:preemptions_total", "pie:preemption_recomputes_total",
                 "pie:kv_pages_swapped_out_total", "pie:kv_pages_swapped_in_total", "pie:kv_swap_failures_total"):
        assert name in after, name


def test_metrics_follow_prometheus_naming(server: ServeProcess) -> None:
    """``_total`` names a counter alone (the KV pool's size, a gauge, was pie:kv_pages_total: read as a counter, by
    rate() or by promtool's lint), and every family says what it is."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    families = [f for f in text_string_to_metric_families(text) if not f.name.endswith("_created")]
    assert families
    for family in families:
        assert family.name.startswith("pie:") and family.documentation, family.name
        if family.type == "counter":
            assert {sample.name for sample in family.samples} <= {family.name + "_total", family.name + "_created"}
        elif family.type == "histogram":
            assert family.name.endswith("_seconds"), family.name
        else:
            assert family.type == "gauge" and not family.name.endswith("_total"), family.name


def test_metrics_count_requests_that_end_at_their_first_token_or_generate_none(client: openai.OpenAI,
                                                                            server: ServeProcess) -> None:
    """A choice that ended at an end-of-sequence token (never shown, but in usage) counted none of its tokens: one
    that ended at its first had its prompt uncounted and no latency observed, as had an echoed prompt scored with
    max_tokens 0; a stream's per-chunk usage left that token out too."""
    at_once = {str(EOS_TOKEN_ID): 100}
    before = server.metrics()
    ended = client.completions.create(model="tiny", prompt="Ends at once", max_tokens=5, logit_bias=at_once)
    streamed = list(client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, logit_bias=at_once, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))  # type: ignore[typeddict-unknown-key]
    scored = client.completions.create(model="tiny", prompt="Only scored", max_tokens=0, echo=True)
    after = server.metrics()

    def added(name: str) -> float:
        return after[name] - before.get(name, 0)

    usages = [ended.usage, streamed[-1].usage, scored.usage]
    assert [u.completion_tokens for u in usages] == [1, 1, 0] and ended.choices[0].finish_reason == "stop"
    assert streamed[-2].choices[0].finish_reason == "stop" and streamed[-2].usage.completion_tokens == 1
    assert added("pie:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert added("pie:generation_tokens_total") == 2
    assert added("pie:finished_choices_total{finish_reason=stop}") == 2
    assert added("pie:time_to_first_token_seconds_count") == 2, "the echo generated no token"
    assert added("pie:e2e_request_latency_seconds_count") == 3
    assert added("pie:time_per_output_token_seconds_count") == 0


@pytest.mark.parametrize("path,body,param", [
    ("completions", b'{"model": "tiny", "prompt": "a\\ud800"}', "prompt"),
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}',
     "messages[0].content"),
    ("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", '
                         b'"text": "\\ud83d"}]}]}', "messages[0].content[0].text"),
])
def test_half_a_surrogate_pair_is_a_400_on_a_connection_that_stays_open(
    server: ServeProcess, path: str, body: bytes, param: str
) -> None:
    """JSON can spell a lone UTF-16 surrogate, which no tokenizer takes: it was a 500 with two tracebacks in the
    log, and uvicorn dropped the keep-alive connection the client's next request went out on."""
    with httpx.Client(base_url=server.url, timeout=30, headers={"content-type": "application/json"}) as http:
        reply = http.post(f"/v1/{path}", content=body)
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and "holds a lone surrogate" in error["message"] and "Value error" not in \
            error["message"], error
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 1}).status_code == 200
    assert "Traceback" not in server.log


def test_min_p_takes_vllms_whole_range(client: openai.OpenAI) -> None:
    reply = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, temperature=1.0, seed=1,
                                      extra_body={"min_p": 1.0})
    assert reply.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="Hi", max_tokens=2, extra_body={"min_p": 1.5})
    assert caught.value.body["param"] == "min_p"
