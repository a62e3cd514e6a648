"""`pie serve --engine NAME` through the official `openai` client against `pie serve --engine cpu`, for any
engine's test suite::

    from pie.testing.served_engine import ServedEngineSuite

    class TestServeFoo(ServedEngineSuite):
        engine = "foo"

Both servers serve the tiny random model (its logits spread, so greedy choices are never near-ties) with a KV
cache small enough that concurrent requests are preempted, a host pool their pages move to, and float16 pages.
Chat and text completions, streaming, ``n``, log-probabilities, echo, stop strings, a JSON schema, a regex,
eight concurrent clients and one that leaves mid-stream must give what the CPU engine gives (texts equal,
log-probabilities within ``LOGPROB_TOLERANCE``), and leave the server idle with every KV page free.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any, ClassVar

import httpx
import pytest

from pie.testing.models import make_gguf_model
from pie.testing.serve_process import ServeProcess, wait_until

LOGPROB_TOLERANCE = 1e-3
"""How far an engine's log-probability may be from the CPU engine's (both compute in float32 over the same
float16 pages; they differ by about 1e-5)."""

MESSAGES = [{"role": "user", "content": "Hello there, fox!"}]
PROMPT = "The quick brown fox"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
PHONE = r"\+[0-9]{2} [0-9]{3} [0-9]{4}"
CLIENTS = 8


class ServedEngineSuite:
    """Subclass with ``engine = "name"``; ``options`` are the ``pie serve`` options both servers run with."""

    engine: ClassVar[str] = ""
    options: ClassVar[tuple[str, ...]] = ("--kv-tokens", "160", "--host-kv-tokens", "1024", "--kv-dtype", "float16")

    @pytest.fixture(scope="class")
    @classmethod
    def servers(cls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServeProcess]]:
        """The engine's server and the CPU engine's, started together and stopped (exit 0) after the class."""
        pytest.importorskip("fastapi", reason="pie serve needs the serve extra")
        pytest.importorskip("openai", reason="the checks speak through the openai client")
        model = make_gguf_model(tmp_path_factory.mktemp("served") / "tiny.gguf", "F32", lm_head_scale=20.0)

        def serve(engine: str) -> ServeProcess:
            return ServeProcess("--model", str(model), "--served-model-name", "tiny", "--engine", engine, *cls.options)

        with serve(cls.engine) as served, serve("cpu") as cpu:
            servers = {cls.engine: served.wait_ready(), "cpu": cpu.wait_ready()}
            yield servers
            for name, server in servers.items():
                assert server.stop() == 0, f"{name}:\n{server.log}"

    def test_greedy_chat_and_text_completions_match_the_cpu_engine(self, servers: dict[str, ServeProcess]) -> None:
        replies = {name: _greedy_replies(server.url) for name, server in servers.items()}
        served, cpu = replies[self.engine], replies["cpu"]
        assert served["streamed"] == served["chat"], "a streamed reply is the reply"
        for key in ("chat", "text", "top"):
            assert served[key] == cpu[key], key
        _assert_close(served["chat_logprobs"], cpu["chat_logprobs"])
        _assert_close(served["text_logprobs"], cpu["text_logprobs"])

    def test_choices_echo_and_stop_strings_match_the_cpu_engine(self, servers: dict[str, ServeProcess]) -> None:
        replies = {name: _sampled_echoed_stopped(server.url) for name, server in servers.items()}
        served, cpu = replies[self.engine], replies["cpu"]
        assert served["choices"] == cpu["choices"] and len(set(served["choices"])) == 2, "two seeded choices"
        assert served["echoed"].startswith(PROMPT) and served["echoed"] == cpu["echoed"]
        assert served["echo_logprobs"][0] is None, "the first prompt token has no log-probability"
        _assert_close(served["echo_logprobs"][1:], cpu["echo_logprobs"][1:])
        full, stop = served["full"], served["stop"]
        assert served["stopped"] == (full[: full.index(stop)], "stop") and served["stopped"] == cpu["stopped"]

    def test_json_schema_and_regex_outputs_match_the_cpu_engine(self, servers: dict[str, ServeProcess]) -> None:
        outputs = {name: _constrained(server.url) for name, server in servers.items()}
        served = outputs[self.engine]
        assert served == outputs["cpu"]
        person = json.loads(served["json"])
        assert set(person) == {"name", "age"} and isinstance(person["age"], int) and len(person["name"]) <= 8
        assert re.fullmatch(PHONE, served["regex"])

    def test_concurrent_clients_preempted_to_the_host_pool_match_the_cpu_engine(
        self, servers: dict[str, ServeProcess]
    ) -> None:
        """Eight clients on a KV cache of ten pages, and a ninth that leaves mid-stream: the latest requests are
        preempted, their pages copied to the host pool and back, and each gets what the CPU engine gives it."""
        served = servers[self.engine]
        before = served.metrics()
        texts = {name: asyncio.run(_concurrent_clients(server.url)) for name, server in servers.items()}
        assert texts[self.engine] == texts["cpu"]
        after = served.metrics()
        assert after["pie:preemptions_total"] > before["pie:preemptions_total"], "no request was preempted"
        assert after["pie:kv_pages_swapped_out_total"] > before["pie:kv_pages_swapped_out_total"]
        assert after["pie:kv_swap_failures_total"] == before["pie:kv_swap_failures_total"]

        def idle() -> bool:
            status = httpx.get(f"{served.url}/v1/pie/status", timeout=10).json()
            return status["requests"]["running"] == 0 and status["kv_pages"]["used"] == 0

        assert wait_until(idle, timeout=30), "the client that left holds nothing of the server's"


def _client(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def _greedy_replies(url: str) -> dict[str, Any]:
    client = _client(url)
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0,
                                          logprobs=True, top_logprobs=3).choices[0]
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3).choices[0]
    assert chat.logprobs is not None and chat.logprobs.content is not None and text.logprobs is not None
    return {
        "chat": chat.message.content,
        "streamed": streamed,
        "text": text.text,
        "top": [[top.token for top in entry.top_logprobs] for entry in chat.logprobs.content],
        "chat_logprobs": [entry.logprob for entry in chat.logprobs.content],
        "text_logprobs": text.logprobs.token_logprobs,
    }


def _sampled_echoed_stopped(url: str) -> dict[str, Any]:
    client = _client(url)
    choices = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, n=2, temperature=1.0, seed=5)
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
                                       logprobs=2).choices[0]
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    whole = re.search("[^\ufffd]{2}", full[1:])  # two characters, not bytes of one the text cut
    assert whole is not None, f"the greedy text {full!r} has no two whole characters after its first"
    stop = whole.group()
    stopped = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert echoed.logprobs is not None
    return {
        "choices": [choice.text for choice in choices.choices],
        "echoed": echoed.text,
        "echo_logprobs": echoed.logprobs.token_logprobs,
        "full": full,
        "stop": stop,
        "stopped": (stopped.choices[0].text, stopped.choices[0].finish_reason),
    }


def _constrained(url: str) -> dict[str, Any]:
    client = _client(url)
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    person = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=60, temperature=0,
                                            response_format=schema).choices[0]
    phone = client.completions.create(model="tiny", prompt="Phone:", max_tokens=16, temperature=0,
                                      extra_body={"structured_outputs": {"regex": PHONE}}).choices[0]
    assert person.finish_reason == "stop" and phone.finish_reason == "stop"
    return {"json": person.message.content, "regex": phone.text}


async def _concurrent_clients(url: str) -> list[str]:
    """The greedy texts of CLIENTS concurrent requests, while another client reads a few chunks and leaves."""
    import openai

    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as client:

        async def complete(index: int) -> str:
            prompt = f"Client {index} says: the quick brown fox jumps"
            reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert reply.choices[0].finish_reason == "length"
            return reply.choices[0].text

        async def leave_mid_stream() -> None:
            stream = await client.completions.create(model="tiny", prompt="Leaving soon", max_tokens=100, stream=True)
            read = 0
            async for _ in stream:
                read += 1
                if read == 3:
                    break
            await stream.close()

        *texts, _ = await asyncio.gather(*(complete(index) for index in range(CLIENTS)), leave_mid_stream())
        return texts


def _assert_close(got: list[float | None], expected: list[float | None]) -> None:
    assert len(got) == len(expected)
    for index, (value, reference) in enumerate(zip(got, expected, strict=True)):
        assert value is not None and reference is not None
        assert abs(value - reference) <= LOGPROB_TOLERANCE, f"log-probability {index}: {value} vs {reference}"
