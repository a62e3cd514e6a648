"""The ingress's own answers, before anything reaches a replica: the probes' key, the body limit, and a 503
when no replica can take a request; and what it passes on to a replica.

The ingress is served on a loopback port in front of one replica whose actor is dead (every call to it
fails as Ray's calls to a dead actor do), so no Ray cluster is needed for what it answers itself; and in
front of a stand-in replica that answers with the headers it was sent."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="pie serve --ray needs the ray extra")
pytest.importorskip("fastapi", reason="pie serve needs the serve extra")

import uvicorn  # noqa: E402
from actor_calls import ActorCall  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

import pie.serve.ray as ray_serve  # noqa: E402
from pie.serve import streams  # noqa: E402
from pie.serve.app import ServeSettings  # noqa: E402
from pie.serve.protocol import APIError  # noqa: E402
from pie.serve.ray import (  # noqa: E402
    FAILURES_IN_A_ROW,
    PROBE_INTERVAL_S,
    ROUTING_PREFIX_CHARS,
    Ingress,
    create_ingress_app,
)
from pie.serve.server import listen  # noqa: E402
from pie.model.tokenizer import Tokenizer  # noqa: E402
from pie.testing.models import BOS_TOKEN_ID, EOS_TOKEN_ID, tiny_tokenizer  # noqa: E402

KEY = "s3cret-key"
LIMIT = 2048


class DeadActor:
    """A replica's actor handle whose every ``info.remote()`` call fails."""

    class info:  # noqa: N801 - named as the actor's method is
        @staticmethod
        def remote() -> DeadActor:
            return DeadActor()

    def future(self) -> Future[None]:
        failed: Future[None] = Future()
        failed.set_exception(RuntimeError("The actor died unexpectedly before finishing this task."))
        return failed


class EchoActor:
    """A replica's actor handle: always ready, at ``url``, with no tokenizer (so requests route by load)."""

    def __init__(self, url: str):
        info = {"url": url, "pid": 1, "node": "here", "phase": "ready", "error": None, "page_size": 16}
        self.info = ActorCall(lambda: info)
        self.tokenizer_json = ActorCall(lambda: None)


class TokenizingEchoActor(EchoActor):
    """The echo replica, with a tokenizer: the ingress then reads each prompt to route it by its prefix."""

    def __init__(self, url: str):
        super().__init__(url)
        text = Tokenizer(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID, eos_token_ids=[EOS_TOKEN_ID]).to_json()
        self.tokenizer_json = ActorCall(lambda: text)


SLOW_SECONDS = 20.0
slow_ends: list[str] = []
"""How each of the slow replica's requests ended: "left" (its client went) or "finished"."""


async def slow_replica(request: Request) -> Response:
    """A replica generating for SLOW_SECONDS before its answer's head, as a long non-streamed completion does."""
    deadline = time.monotonic() + SLOW_SECONDS
    while time.monotonic() < deadline:
        if await request.is_disconnected():
            slow_ends.append("left")
            return Response(status_code=499)
        await asyncio.sleep(0.05)
    slow_ends.append("finished")
    return JSONResponse({"choices": []})


def echo_replica(request: Request) -> Response:
    """What a replica was sent, with a cookie set; a redirect for /v1/models."""
    if request.url.path == "/v1/models":
        return RedirectResponse("/elsewhere", status_code=307)
    seen = {name: request.headers.get(name) for name in ("content-type", "cookie", "accept-encoding")}
    if "x-request-id" in request.headers:
        seen["x-request-id"] = request.headers["x-request-id"]
    answer = JSONResponse(seen)
    answer.set_cookie("session", "from-the-replica")
    return answer


def serve(app: object) -> Iterator[str]:
    """``app`` on a loopback port, on a thread, until the generator is closed."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def ingress_url() -> Iterator[str]:
    settings = ServeSettings(model="unused", api_key=KEY, open_probes=False, max_body_bytes=LIMIT)
    yield from serve(create_ingress_app(Ingress(settings, [DeadActor()])))


@pytest.fixture(scope="module")
def echo_ingress_url() -> Iterator[str]:
    replica = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"]),
                                Route("/v1/chat/completions", slow_replica, methods=["POST"]),
                                Route("/v1/models", echo_replica)])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [TokenizingEchoActor(replica_url)])
        for url in serve(create_ingress_app(ingress)):
            deadline = time.monotonic() + 30
            while ingress.tokenizer is None and time.monotonic() < deadline:  # read from the replica at start
                time.sleep(0.05)
            yield url


def test_the_probes_need_the_key(ingress_url: str) -> None:
    for path in ("/health", "/metrics"):
        missing = httpx.get(ingress_url + path, timeout=10)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        wrong = httpx.get(ingress_url + path, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    key = {"Authorization": f"Bearer {KEY}"}
    metrics = httpx.get(ingress_url + "/metrics", headers=key, timeout=10)
    assert metrics.status_code == 200 and "pie:ingress_requests" in metrics.text
    health = httpx.get(ingress_url + "/health", headers=key, timeout=10)
    assert health.status_code == 503 and health.json()["replicas"] == {"wanted": 1, "ready": 0}
    assert "actor died" in health.json()["detail"][0]["error"]


def test_the_health_probe_takes_head_as_pie_serve_does(ingress_url: str) -> None:
    """The ingress answered HEAD /health 405 (pie serve answers it as GET): a load balancer probing with HEAD took
    it for down."""
    key = {"Authorization": f"Bearer {KEY}"}
    probed = httpx.head(ingress_url + "/health", headers=key, timeout=10)
    assert probed.status_code == httpx.get(ingress_url + "/health", headers=key, timeout=10).status_code == 503
    assert probed.content == b""


def test_no_replica_to_take_a_request_is_a_503(ingress_url: str) -> None:
    client = openai.OpenAI(base_url=f"{ingress_url}/v1", api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    assert caught.value.status_code == 503


STALL = "the engine's step has run for 700.0 s (bound --stall-seconds 600): a kernel or the device hangs"


class StalledActor:
    """A replica's actor handle, its server at ``url`` stalled (as pie serve's info says it while its engine's step
    has run past --stall-seconds)."""

    def __init__(self, url: str):
        info = {"url": url, "pid": 1, "node": "here", "phase": "stalled", "error": STALL, "page_size": 16}
        self.info = ActorCall(lambda: info)
        self.tokenizer_json = ActorCall(lambda: None)


def stalled_metrics(request: Request) -> Response:
    """A stalled replica's /metrics, as pie serve's says a stall."""
    return Response("# TYPE pie:engine_stalled gauge\npie:engine_stalled 1.0\n", media_type="text/plain")


def test_every_replica_stalled_refuses_requests_as_a_stalled_server_does() -> None:
    """With every replica stalled, the ingress's /health said loading, and a new request got 503 no_replica, "no
    replica is ready", as if a model were loading: nothing said that the replicas' engines hung. Its /metrics held
    only ready replicas' metrics: a stalled one's pie:engine_stalled never showed there."""
    replica = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"]),
                                Route("/metrics", stalled_metrics)])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [StalledActor(replica_url), StalledActor(replica_url)])
        for url in serve(create_ingress_app(ingress)):
            deadline = time.monotonic() + 30
            while (health := httpx.get(f"{url}/health", timeout=10)).json()["status"] != "stalled":
                assert time.monotonic() < deadline, health.text
                time.sleep(0.05)
            assert health.status_code == 503
            assert health.json()["error"] == f"2 of 2 replicas stalled: replica 0: {STALL}; replica 1: {STALL}"
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=10)
            for stream in (False, True):
                with pytest.raises(openai.APIStatusError) as refused:
                    client.completions.create(model="tiny", prompt="Hello", max_tokens=1, stream=stream)
                assert refused.value.status_code == 503 and refused.value.body["code"] == "engine_stalled"
                assert refused.value.body["message"] == health.json()["error"]
                assert refused.value.response.headers["retry-after"] == "5"
            assert ingress.registry.get_sample_value("pie:ingress_unavailable_total") == 2
            metrics = httpx.get(f"{url}/metrics", timeout=10).text
            assert {f'pie:engine_stalled{{replica="{i}"}} 1.0' for i in "01"} <= set(metrics.splitlines()), metrics


def test_a_body_over_the_limit_is_413_before_any_replica_is_asked(ingress_url: str) -> None:
    client = openai.OpenAI(base_url=f"{ingress_url}/v1", api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="word " * LIMIT, max_tokens=1)
    assert caught.value.status_code == 413 and f"limit of {LIMIT} bytes" in caught.value.message
    chunked = httpx.post(f"{ingress_url}/v1/completions", content=iter([b"{" + b" " * LIMIT, b"}"]), timeout=10,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_replica_gets_the_clients_headers_and_no_others(echo_ingress_url: str) -> None:
    with httpx.Client(base_url=echo_ingress_url, timeout=10) as client:
        first = client.post("/v1/completions", content=b'{"prompt": "hi"}')
        assert first.status_code == 200 and first.headers["x-pie-replica"] == "0", first.text
        assert first.json() == {"content-type": None, "cookie": None, "accept-encoding": None}
        typed = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert typed.json()["content-type"] == "application/json"
        # The ingress keeps no cookie a replica set: the next client's request carries none.
        again = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert again.json()["cookie"] is None


def test_a_clients_request_id_reaches_the_replica_and_comes_back(echo_ingress_url: str) -> None:
    """The ingress dropped it both ways: the replica never saw the client's id, and the client got none back."""
    named = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10,
                       headers={"X-Request-Id": "trace-42"})
    assert named.json()["x-request-id"] == "trace-42" and named.headers["x-request-id"] == "trace-42"
    anonymous = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert "x-request-id" not in anonymous.json() and anonymous.headers["x-request-id"].startswith("req_")
    refused = httpx.get(f"{echo_ingress_url}/v1/nothing", timeout=10, headers={"X-Request-Id": "trace-43"})
    assert refused.status_code == 404 and refused.headers["x-request-id"] == "trace-43"


def test_a_replicas_redirect_is_passed_on_not_followed(echo_ingress_url: str) -> None:
    answer = httpx.get(f"{echo_ingress_url}/v1/models", timeout=10)
    assert answer.status_code == 307, answer.text


def test_a_client_that_leaves_ends_its_request_at_the_replica(echo_ingress_url: str) -> None:
    """The ingress waited for the replica's answer without watching its client: a client gone (a timeout, then its
    retry) left the replica generating the whole answer for no one, holding its place in the router and the drain."""
    slow_ends.clear()
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{echo_ingress_url}/v1/chat/completions", json={"messages": []}, timeout=1.0)
    deadline = time.monotonic() + SLOW_SECONDS / 2
    while not slow_ends and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow_ends == ["left"]


@pytest.mark.parametrize(
    "body",
    [b"[" * 100_000, b'{"prompt": [%s], "max_tokens": 1}' % b", ".join([b"1099511627776"] * 40),
     b'{"prompt": [%s], "max_tokens": 1}' % b", ".join([b"-3"] * 40)],
    ids=["nested past the parser", "a token id past int32", "a negative token id"],
)
def test_what_the_ingress_cannot_read_is_the_replicas_to_answer(echo_ingress_url: str, body: bytes) -> None:
    """Both were 500s from the ingress itself (a RecursionError, an OverflowError while routing by prefix)."""
    answer = httpx.post(f"{echo_ingress_url}/v1/completions", content=body, timeout=10,
                        headers={"Content-Type": "application/json"})
    assert answer.status_code == 200 and answer.headers["x-pie-replica"] == "0", answer.text


def test_the_ingress_answers_an_unknown_path_as_the_server_does(echo_ingress_url: str) -> None:
    missing = httpx.get(f"{echo_ingress_url}/v1/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["message"] == "no such path: GET /v1/nothing"
    wrong = httpx.get(f"{echo_ingress_url}/v1/completions", timeout=10)
    assert wrong.status_code == 405 and "error" in wrong.json() and wrong.headers["allow"] == "POST"


async def endless_stream(request: Request) -> Response:
    """A replica's stream that sends its first token and then takes SLOW_SECONDS over the rest."""

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
        deadline = time.monotonic() + SLOW_SECONDS
        while time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def test_a_drain_ends_what_is_still_streaming_at_its_deadline() -> None:
    """The ingress's drain only waited: what still streamed at its deadline went on (a second signal's drain(0)
    too), until a third signal killed the replicas under it and its clients got no word."""
    replica = Starlette(routes=[Route("/v1/completions", endless_stream, methods=["POST"])])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)])
        for url in serve(create_ingress_app(ingress)):
            with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True},
                              timeout=30) as answer:
                lines = answer.iter_lines()
                assert next(line for line in lines if line.startswith("data: ")).endswith('"text": "a", '
                                                                                         '"finish_reason": null}]}')
                assert ingress._watcher is not None
                drained = asyncio.run_coroutine_threadsafe(ingress.drain(0.2), ingress._watcher.get_loop())
                rest = [line for line in lines if line.startswith("data: ")]
                drained.result(timeout=30)
            assert len(rest) == 2 and "the server shut down before this request finished" in rest[0], rest
            assert rest[1] == "data: [DONE]", "as a replica ends a stream that failed"
            assert ingress.in_flight == 0


class RecordingTokenizer(Tokenizer):
    """The tiny tokenizer, noting how much text each call is given."""

    def __init__(self) -> None:
        super().__init__(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID, eos_token_ids=[EOS_TOKEN_ID],
                         chat_template="{% for m in messages %}{{ m['content'] }}{% endfor %}")
        self.lengths: dict[str, list[int]] = {"text": [], "chat": []}

    def encode_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.lengths["text"].append(len(text))
        return super().encode_text(text, add_special_tokens)

    def encode_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, variables: dict[str, Any] | None = None) -> list[int]:
        self.lengths["chat"].append(sum(len(m["content"]) for m in messages))
        return super().encode_chat(messages, add_generation_prompt, continue_final_message, variables)


def test_the_ingress_routes_a_long_prompt_by_its_start_alone() -> None:
    """It tokenized all of a prompt to route it: megabytes (to the body limit) cost the ingress seconds a request,
    before the replica refused them without tokenizing."""
    ingress = Ingress(ServeSettings(model="unused"), [EchoActor("http://127.0.0.1:1")])
    tokenizer = ingress.tokenizer = RecordingTokenizer()
    long = "ab " * 1_000_000
    tokens = asyncio.run(ingress.prompt_tokens("completion", {"prompt": long}))
    assert tokens == tokenizer.encode_text(long[:ROUTING_PREFIX_CHARS])
    messages = [{"role": "system", "content": "s" * 20_000}, {"role": "user", "content": long},
                {"role": "user", "content": "never read"}]
    asyncio.run(ingress.prompt_tokens("chat", {"messages": messages}))
    assert tokenizer.lengths["chat"] == [ROUTING_PREFIX_CHARS] and max(tokenizer.lengths["text"]) == ROUTING_PREFIX_CHARS


def test_the_ingress_routes_a_salted_prompt_by_its_salt() -> None:
    """The ingress keyed every prompt unsalted: a salted request followed another tenant's unsalted prefix to a
    replica whose cache its salt kept it from."""
    replica = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"])])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [TokenizingEchoActor(replica_url) for _ in range(2)])
        for url in serve(create_ingress_app(ingress)):
            deadline = time.monotonic() + 30
            while ingress.tokenizer is None and time.monotonic() < deadline:
                time.sleep(0.05)
            prompt = "the same long prompt, page after page " * 8
            with httpx.Client(base_url=url, timeout=30) as client:
                for salt in (None, None, "tenant-a", "tenant-a", "tenant-b"):
                    body = {"model": "unused", "prompt": prompt, **({"cache_salt": salt} if salt else {})}
                    assert client.post("/v1/completions", json=body).status_code == 200
    routes = {(sample.labels["replica"], sample.labels["route"]): sample.value
              for metric in ingress.requests.collect() for sample in metric.samples if sample.name.endswith("_total")}
    assert sum(value for (_, route), value in routes.items() if route == "prefix") == 2, routes
    assert sum(value for (_, route), value in routes.items() if route == "least_loaded") == 3, routes


flood_ends: list[str] = []
"""How each of the flooding replica's streams ended: "left" (its client, the ingress, went) or "finished"."""


class ClosingStream(StreamingResponse):
    """Closes its generator however the response ends. Under ASGI 2.4 a send to a client gone raises, and Starlette
    leaves the generator to the garbage collector, which runs its ``finally`` when it gets to it: on a quiet process,
    more than 30 s later once (CI at 203717a)."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]  # an async generator's


async def flooding_stream(request: Request) -> Response:
    """A replica's stream of 100 MB (more than the sockets between it and a client hold), sent as fast as its client
    takes it."""

    async def events() -> AsyncIterator[bytes]:
        finished = False
        try:
            for _ in range(100_000):
                yield b'data: {"choices": [{"index": 0, "text": "%s", "finish_reason": null}]}\n\n' % (b"a" * 1000)
                await asyncio.sleep(0)  # where a client gone is told, as a replica's wait for its next step is
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            flood_ends.append("finished" if finished else "left")

    return ClosingStream(events(), media_type="text/event-stream")


def test_a_client_that_stops_reading_is_cut_and_its_replica_told(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the server cuts a client that takes nothing for SEND_TIMEOUT_S, so does the ingress in front of it; it
    waited on such a client for as long as it kept the connection open, and its replica waited on the ingress."""
    monkeypatch.setattr(streams, "SEND_TIMEOUT_S", 0.5)
    flood_ends.clear()
    replica = Starlette(routes=[Route("/v1/completions", flooding_stream, methods=["POST"])])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)])
        for url in serve(create_ingress_app(ingress)):
            raw = json.dumps({"prompt": "x", "stream": True}).encode()
            with socket.socket() as client:
                client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                client.connect(("127.0.0.1", int(url.rsplit(":", 1)[1])))
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pie\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
                deadline = time.monotonic() + 30
                while not (flood_ends and ingress.in_flight == 0) and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert flood_ends == ["left"] and ingress.in_flight == 0, (flood_ends, ingress.in_flight)
                client.settimeout(30)
                received = 0
                try:
                    while data := client.recv(1 << 16):  # what was on its way, then the end of the connection
                        received += len(data)
                        assert received < 64 * 2**20, "the ingress kept sending"
                except ConnectionResetError:
                    pass


def test_the_ingress_reads_a_chat_prompt_as_the_replica_does() -> None:
    """A null add_generation_prompt was read as false (the replica takes null as the default, true), and
    chat_template_kwargs were left out: the ingress routed by another prompt than the one the replica ran."""
    ingress = Ingress(ServeSettings(model="unused"), [EchoActor("http://127.0.0.1:1")])
    template = "{% if quiet is defined and quiet %}hush {% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer = ingress.tokenizer = Tokenizer(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID,
                                              eos_token_ids=[EOS_TOKEN_ID], chat_template=template)
    messages = [{"role": "user", "content": "hello there"}]
    read = asyncio.run(ingress.prompt_tokens("chat", {"messages": messages, "add_generation_prompt": None,
                                                      "chat_template_kwargs": {"quiet": True}}))
    assert read == tokenizer.encode_chat(messages, True, False, {"quiet": True})
    assert read != tokenizer.encode_chat(messages, True, False)


def test_the_ingress_shows_a_developer_message_to_the_template_as_the_replica_does() -> None:
    """The replica shows a developer message as a system message to a template that knows no developer role; the
    ingress rendered it as sent (refused, or left out, by such a template) and so routed by another prompt."""
    ingress = Ingress(ServeSettings(model="unused"), [EchoActor("http://127.0.0.1:1")])
    template = ("{% for m in messages %}{% if m['role'] == 'system' %}[S]{% elif m['role'] != 'user' %}"
                "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}{{ m['content'] }}{% endfor %}")
    tokenizer = ingress.tokenizer = Tokenizer(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID,
                                              eos_token_ids=[EOS_TOKEN_ID], chat_template=template)
    sent = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hello"}]
    read = asyncio.run(ingress.prompt_tokens("chat", {"messages": sent}))
    assert read == tokenizer.encode_chat([{**sent[0], "role": "system"}, sent[1]], True, False)


def test_the_ingress_reads_a_responses_prompt_as_its_chat_completions() -> None:
    """A Responses request (instructions, input items of text parts) is routed by the prompt of the chat completion
    the replica makes of it."""
    ingress = Ingress(ServeSettings(model="unused"), [EchoActor("http://127.0.0.1:1")])
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    tokenizer = ingress.tokenizer = Tokenizer(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID,
                                              eos_token_ids=[EOS_TOKEN_ID], chat_template=template)
    payload = {"instructions": "be brief", "input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]}]}
    read = asyncio.run(ingress.prompt_tokens("responses", payload))
    assert read == tokenizer.encode_chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                                         True, False)
    assert asyncio.run(ingress.prompt_tokens("responses", {"input": [{"type": "input_image"}]})) is None


class FreezableCall(ActorCall):
    """An actor method whose calls never answer while ``frozen``, as a stopped process's, or a node's cut off the
    network."""

    frozen = False

    def future(self) -> Future[Any]:
        return Future() if self.frozen else super().future()


class MovableActor:
    """A replica's actor handle, its server ready at ``url``, whose process the test replaces (``pid``: Ray started it
    again, elsewhere) or freezes (``info.frozen``); with the tiny tokenizer if ``tokenizing``."""

    def __init__(self, url: str, tokenizing: bool = False):
        self.pid = 1
        self.info = FreezableCall(lambda: {"url": url, "pid": self.pid, "node": "here", "phase": "ready",
                                           "error": None, "page_size": 16})
        text = Tokenizer(tiny_tokenizer(), bos_token_id=BOS_TOKEN_ID, eos_token_ids=[EOS_TOKEN_ID]).to_json()
        self.tokenizer_json = ActorCall(lambda: text if tokenizing else None)


def _until_ready(ingress: Ingress, replicas: int) -> None:
    deadline = time.monotonic() + 30
    while len(ingress.available()) < replicas:
        assert time.monotonic() < deadline, "the replicas did not become ready"
        time.sleep(0.05)


def _rest_of_stream(url: str, after_first_token: Callable[[], None]) -> list[str]:
    """The data lines of a stream after its first token, ``after_first_token`` called once that came."""
    with httpx.stream("POST", f"{url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=60) as answer:
        lines = answer.iter_lines()
        assert '"text": "a"' in next(line for line in lines if line.startswith("data: "))
        after_first_token()
        return [line for line in lines if line.startswith("data: ")]


def _post(url: str, answers: list[httpx.Response]) -> None:
    answers.append(httpx.post(url, json={"prompt": "x"}, timeout=60))


def test_a_stream_whose_replicas_process_was_replaced_ends_with_an_error() -> None:
    """A replica whose node dropped off the network resets no connection: its stream went on waiting after the ingress
    saw Ray start the replica again elsewhere, until the client gave up."""
    replica = Starlette(routes=[Route("/v1/completions", endless_stream, methods=["POST"])])
    for replica_url in serve(replica):
        actor = MovableActor(replica_url)
        ingress = Ingress(ServeSettings(model="unused"), [actor])
        for url in serve(create_ingress_app(ingress)):
            _until_ready(ingress, 1)
            rest = _rest_of_stream(url, functools.partial(setattr, actor, "pid", 2))
            assert len(rest) == 2 and "replica_failed" in rest[0], rest
            assert "replica 0 was given up on (its process was replaced, pid 1 -> 2)" in rest[0], rest
            assert rest[1] == "data: [DONE]"
            assert ingress.in_flight == 0


def test_a_request_waiting_on_a_replica_whose_actor_falls_silent_goes_to_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replica whose process froze (or whose node was cut off) kept its requests waiting for ever, though the
    ingress had marked it not answering; one not answered yet is sent to another replica."""
    monkeypatch.setattr(ray_serve, "ACTOR_CALL_TIMEOUT_S", 0.1)
    monkeypatch.setattr(ray_serve, "SILENT_LIMIT_S", 0.0)  # given up at the second poll that hears nothing
    received = threading.Event()

    async def never_answers(request: Request) -> Response:
        received.set()
        deadline = time.monotonic() + SLOW_SECONDS
        while time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)
        return JSONResponse({"from": "the frozen replica"})

    frozen = Starlette(routes=[Route("/v1/completions", never_answers, methods=["POST"])])
    healthy = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"])])
    for frozen_url in serve(frozen):
        for healthy_url in serve(healthy):
            actor = MovableActor(frozen_url)
            ingress = Ingress(ServeSettings(model="unused"), [actor, EchoActor(healthy_url)])
            for url in serve(create_ingress_app(ingress)):
                _until_ready(ingress, 2)
                answers: list[httpx.Response] = []
                client = threading.Thread(target=_post, args=(f"{url}/v1/completions", answers))
                client.start()  # to replica 0: the least loaded, and first
                assert received.wait(30)
                actor.info.frozen = True
                client.join(60)
                assert len(answers) == 1 and answers[0].status_code == 200, answers
                assert answers[0].headers["x-pie-replica"] == "1"
                assert ingress.in_flight == 0


def test_a_stream_silent_past_its_replicas_keepalives_ends_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose replica sent nothing, not even its keepalive comments, was waited on for ever. A whole answer,
    not streamed, may be silent for longer: it has no such bound."""
    monkeypatch.setattr(ray_serve, "STREAM_SILENCE_S", 0.2)

    async def slow_whole_answer(request: Request) -> Response:
        await asyncio.sleep(1.0)  # five times the streams' bound
        return JSONResponse({"choices": []})

    replica = Starlette(routes=[Route("/v1/completions", endless_stream, methods=["POST"]),
                                Route("/v1/chat/completions", slow_whole_answer, methods=["POST"])])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)])
        for url in serve(create_ingress_app(ingress)):
            _until_ready(ingress, 1)
            rest = _rest_of_stream(url, lambda: None)
            assert len(rest) == 2 and "replica 0 sent nothing for 0.2 s" in rest[0], rest
            assert rest[1] == "data: [DONE]"
            _until_ready(ingress, 1)  # (marked unreachable by that, until its actor answers)
            whole = httpx.post(f"{url}/v1/chat/completions", json={"messages": []}, timeout=30)
            assert whole.status_code == 200 and whole.json() == {"choices": []}


class Clock:
    """The ingress's clock, set by the test (what it measures the probes' interval with)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


device_lost = threading.Event()


def lost_device_replica(request: Request) -> Response:
    """A replica whose device is lost for good while ``device_lost`` is set: it answers every request 500, as pie serve
    did after its browser device died, its /health still 200."""
    if device_lost.is_set():
        return JSONResponse({"error": {"message": "the request failed: BrowserLost: the browser's page was closed",
                                       "type": "server_error", "param": None, "code": None}}, status_code=500)
    return JSONResponse({"choices": []})


SHARED_PROMPT = "the same long system prompt, page after page " * 8


def _ask(url: str, count: int) -> list[str]:
    """``count`` completions sharing a prompt prefix, one after another: each answer's "status@replica"."""
    with httpx.Client(base_url=url, timeout=30) as client:
        answers = [client.post("/v1/completions", json={"prompt": f"{SHARED_PROMPT}{i}"}) for i in range(count)]
    return [f"{answer.status_code}@{answer.headers['x-pie-replica']}" for answer in answers]


def _beside_a_healthy_replica(
    first: Starlette, tokenizing_actor: Callable[[str], Any], clock: Clock, healthy_completions: Any = echo_replica
) -> Iterator[tuple[str, Ingress]]:
    """The ingress in front of replica 0, serving ``first`` (its actor made by ``tokenizing_actor``), and a healthy
    one answering completions with ``healthy_completions``, once both are ready and the ingress routes by prefix."""
    healthy = Starlette(routes=[Route("/v1/completions", healthy_completions, methods=["POST"])])
    for first_url in serve(first):
        for healthy_url in serve(healthy):
            ingress = Ingress(ServeSettings(model="unused"), [tokenizing_actor(first_url),
                                                              TokenizingEchoActor(healthy_url)], clock=clock)
            for url in serve(create_ingress_app(ingress)):
                _until_ready(ingress, 2)
                deadline = time.monotonic() + 30
                while ingress.tokenizer is None:  # (routing by prefix: read from a replica at start)
                    assert time.monotonic() < deadline, "no tokenizer"
                    time.sleep(0.05)
                yield url, ingress


def _lost_and_healthy(tokenizing_actor: Callable[[str], Any], clock: Clock) -> Iterator[tuple[str, Ingress]]:
    """The ingress in front of the lost-device replica (0, its actor made by ``tokenizing_actor``) and a healthy one."""
    lost = Starlette(routes=[Route("/v1/completions", lost_device_replica, methods=["POST"])])
    return _beside_a_healthy_replica(lost, tokenizing_actor, clock)


def test_a_replica_that_fails_every_completion_is_routed_around_until_it_answers_again() -> None:
    """A replica whose device was lost for good answered every request 500 while its server and its actor said ready:
    the ingress sent it all the traffic its prompt's prefix drew (40 of 40 failed in the review)."""
    clock = Clock()
    device_lost.set()
    try:
        for url, ingress in _lost_and_healthy(TokenizingEchoActor, clock):
            # Its 500s reach their clients (not retried: see Ingress.proxy); then it is sent no more.
            assert _ask(url, 10) == ["500@0"] * FAILURES_IN_A_ROW + ["200@1"] * (10 - FAILURES_IN_A_ROW)
            detail = ingress.health()[0]["detail"][0]
            assert detail["status"] == "failing" and "completions in a row failed" in detail["error"], detail
            assert "answered 500" in detail["error"] and ingress.health()[0]["replicas"]["ready"] == 1

            clock.now = PROBE_INTERVAL_S  # a probe is due: the next request tries it, the one after does not
            assert _ask(url, 2) == ["500@0", "200@1"]
            device_lost.clear()  # (it recovered: a device another process held a moment)
            clock.now = 2 * PROBE_INTERVAL_S
            assert _ask(url, 1) == ["200@0"]
            assert ingress.health()[0]["detail"][0]["status"] == "ready"
            assert ingress.available() == {0, 1}
    finally:
        device_lost.clear()


def test_a_failing_replica_whose_process_is_replaced_is_routed_to_again() -> None:
    clock = Clock()
    actors: list[MovableActor] = []

    def actor(url: str) -> MovableActor:
        actors.append(MovableActor(url, tokenizing=True))
        return actors[-1]

    device_lost.set()
    try:
        for url, ingress in _lost_and_healthy(actor, clock):
            assert _ask(url, FAILURES_IN_A_ROW + 1)[-1] == "200@1"
            assert ingress.available() == {1}
            device_lost.clear()
            actors[0].pid = 2  # the ingress (or Ray) restarted it: a new device, a new engine
            deadline = time.monotonic() + 30
            while ingress.available() != {0, 1}:
                assert time.monotonic() < deadline, ingress.health()
                time.sleep(0.05)
    finally:
        device_lost.clear()


def test_a_replica_whose_completions_are_never_answered_is_routed_around() -> None:
    """A replica whose engine is stuck (in a device call, say) takes requests and never answers them, its server and
    its actor ready: its clients gave up one after another (40 of 40 in the review)."""

    async def stuck(request: Request) -> Response:
        deadline = time.monotonic() + SLOW_SECONDS
        while time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)
        return JSONResponse({"choices": []})

    wedged = Starlette(routes=[Route("/v1/completions", stuck, methods=["POST"])])
    for url, ingress in _beside_a_healthy_replica(wedged, TokenizingEchoActor, Clock()):
        with httpx.Client(base_url=url) as client:
            for failed in range(1, FAILURES_IN_A_ROW + 1):
                with pytest.raises(httpx.TimeoutException):  # the client gives up, as a user would
                    client.post("/v1/completions", json={"prompt": f"{SHARED_PROMPT}{failed}"}, timeout=0.5)
                deadline = time.monotonic() + 30
                while ingress.replicas[0].failures < failed:  # (the ingress sees its client leave)
                    assert time.monotonic() < deadline, "the ingress did not count the request as failed"
                    time.sleep(0.05)
            answer = client.post("/v1/completions", json={"prompt": f"{SHARED_PROMPT}x"}, timeout=30)
        assert answer.status_code == 200 and answer.headers["x-pie-replica"] == "1"
        assert "its client left before any answer" in ingress.health()[0]["detail"][0]["error"]


def test_the_ingress_probes_its_connections_to_the_replicas() -> None:
    """The ingress's connections to a replica had no TCP keepalive: one whose host vanished (or whose path a firewall's
    dropped state cut) resets nothing, and a whole answer awaited on it was awaited for ever."""
    replica = Starlette(routes=[Route("/v1/completions", endless_stream, methods=["POST"])])

    async def options(url: str) -> tuple[int, ...]:
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(url)])
        await ingress.start()
        try:
            assert ingress.client is not None
            async with ingress.client.post(f"{url}/v1/completions", data=b"{}") as answer:  # (open while read)
                assert answer.connection is not None and answer.connection.transport is not None
                sock = answer.connection.transport.get_extra_info("socket")
                read = [sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)]
                if hasattr(socket, "TCP_KEEPIDLE"):  # (Linux's names)
                    read += [sock.getsockopt(socket.IPPROTO_TCP, option)
                             for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)]
                return tuple(read)
        finally:
            await ingress.close()

    for replica_url in serve(replica):
        read = asyncio.run(options(replica_url))
    assert read[0] != 0, "SO_KEEPALIVE is off"
    if len(read) > 1:
        assert read[1:] == (ray_serve.UPSTREAM_PROBE_IDLE_S, ray_serve.UPSTREAM_PROBE_INTERVAL_S,
                            ray_serve.UPSTREAM_PROBES)


def _own_network_namespace() -> bool:
    """Whether this machine lets a process take a network namespace of its own and set its loopback up."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    try:
        tried = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    except subprocess.TimeoutExpired:
        return False
    return tried.returncode == 0


CUT_OFF_TIMEOUT_S = 90.0
"""How long the child with a replica cut off the network may take: many times its probes' bound (3 s here)."""


def test_a_replica_cut_off_the_network_fails_its_request_instead_of_hanging() -> None:
    """A replica whose host dropped off the network while its request was computed (nothing reset, no FIN) kept the
    ingress waiting on its answer for ever, Ray's path to it still answering (so the watcher saw nothing wrong). With
    its connection probed (1 s idle, 2 probes 1 s apart here) the request fails as a reset one would: a 503 naming
    it."""
    if not _own_network_namespace():
        pytest.skip("needs `unshare -rn` and `ip` (a network namespace of the test's own, to cut its loopback)")
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), *sys.path])}
    command = ["unshare", "-rn", "sh", "-c", 'ip link set lo up && exec "$0" "$@"', sys.executable,
               str(here / "cut_off_replica_child.py"), "1", "1", "2"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=CUT_OFF_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the ingress still waited on the cut-off replica after {CUT_OFF_TIMEOUT_S:g} s") from exc
    assert done.returncode == 0, done.stderr[-4000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["status"] == 503 and answer["body"]["error"]["code"] == "no_replica", answer
    assert "replica 0 could not be reached" in answer["body"]["error"]["message"], answer


def _failing_after_first_token(error: APIError, carried: bool) -> Starlette:
    """A replica whose every completion fails with ``error``: a stream after its first token, with the error event pie
    serve ends one with, its status ``carried`` in it (as pie serve's now) or not (as an older one's); a whole answer
    with its status."""
    event = error.event_body() if carried else error.body()

    async def completions(request: Request) -> Response:
        if not (await request.json()).get("stream"):
            return JSONResponse(error.body(), status_code=error.status)

        async def events() -> AsyncIterator[bytes]:
            yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
            yield f"data: {json.dumps(event)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])


async def finishing_stream(request: Request) -> Response:
    """A replica that answers every completion whole, streamed or not."""
    if not (await request.json()).get("stream"):
        return JSONResponse({"choices": []})

    async def events() -> AsyncIterator[bytes]:
        yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": "stop"}]}\n\n'
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _stream_outcomes(url: str, count: int) -> list[str]:
    """``count`` streamed completions sharing a prompt prefix, one after another: each one's "outcome@replica"."""
    outcomes = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for i in range(count):
            body = {"prompt": f"{SHARED_PROMPT}{i}", "stream": True}
            with client.stream("POST", "/v1/completions", json=body) as answer:
                events = [line for line in answer.iter_lines() if line.startswith("data: ")]
            outcome = "error" if any(event.startswith('data: {"error"') for event in events) else "whole"
            outcomes.append(f"{outcome}@{answer.headers['x-pie-replica']}")
    return outcomes


STREAM_FAILURES = {
    "kernel-failed": (APIError(500, "kernel rms_norm failed: the device fell over", code="kernel_failed"), True),
    "kernel-failed-older-replica": (APIError(500, "kernel rms_norm failed", code="kernel_failed"), False),
    "out-of-memory-older-replica": (APIError(503, "out of memory for this request", code="out_of_memory"), False),
    # A 503 of a code the ingress's list (NO_FAULT_CODES) lacks: its status says it is none of the replica's faults.
    "no-inferlet-worker": (APIError(503, "no inferlet worker is free; retry later", code="no_inferlet_worker"), True),
}


@pytest.mark.parametrize("failure", STREAM_FAILURES)
def test_a_replica_failing_its_streams_after_their_first_tokens_is_routed_around_unless_they_are_503s(
    failure: str,
) -> None:
    """A stream's 200 counted for its replica however it ended: a replica whose decode steps all failed (its prefill
    fine) sent an error event after the first token of every stream, and drew every stream its prefixes drew. A 503
    (short of memory, say, in a stream or not) is no fault of the replica's: it is never routed around for it. Its
    error event carries its status; an older replica's, without one, is told by its code. The ingress told them by
    their codes alone: a 503 of a code it did not list counted against the replica."""
    error, carried = STREAM_FAILURES[failure]
    failing = _failing_after_first_token(error, carried)
    for url, ingress in _beside_a_healthy_replica(failing, TokenizingEchoActor, Clock(), finishing_stream):
        outcomes = _stream_outcomes(url, FAILURES_IN_A_ROW + 2)
        if error.status == 503:
            assert outcomes == ["error@0"] * (FAILURES_IN_A_ROW + 2)
            # A whole answer's 503 is sent to the other replica, and counts against neither.
            assert [f"{a.status_code}@{a.headers['x-pie-replica']}" for a in
                    (httpx.post(f"{url}/v1/completions", json={"prompt": f"{SHARED_PROMPT}{i}"}, timeout=30)
                     for i in range(FAILURES_IN_A_ROW + 1))] == ["200@1"] * (FAILURES_IN_A_ROW + 1)
            assert ingress.available() == {0, 1} and ingress.replicas[0].failures == 0
        else:
            assert outcomes == ["error@0"] * FAILURES_IN_A_ROW + ["whole@1"] * 2
            detail = ingress.health()[0]["detail"][0]
            assert detail["status"] == "failing" and "kernel_failed" in detail["error"], detail


def test_a_replica_whose_server_cannot_be_reached_while_its_actor_answers_is_routed_around() -> None:
    """A replica whose actor answered while its server could not be reached (a firewall on its node letting Ray's ports
    through and not its server's; a network cut between the ingress and it) was marked unreachable by each request
    that failed on it, and ready again by the watcher's next poll: every request routed to it waited for its connection
    to fail (5 s to connect, 25 s of keepalive probes) before it went to another replica, for as long as it lasted."""
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
    healthy = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"])])
    try:
        for healthy_url in serve(healthy):
            unreachable = EchoActor(f"http://127.0.0.1:{closed.getsockname()[1]}")
            ingress = Ingress(ServeSettings(model="unused"), [unreachable, EchoActor(healthy_url)], clock=Clock())
            for url in serve(create_ingress_app(ingress)):
                _until_ready(ingress, 2)
                replicas = []
                for _ in range(FAILURES_IN_A_ROW + 2):
                    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=30)
                    assert answer.status_code == 200, answer.text
                    replicas.append(answer.headers["x-pie-replica"])
                    deadline = time.monotonic() + 30
                    while not ingress.replicas[0].ready:  # (the watcher's next poll: its actor answers)
                        assert time.monotonic() < deadline, "the watcher did not see replica 0 again"
                        time.sleep(0.05)
                assert replicas == ["1"] * (FAILURES_IN_A_ROW + 2)
                assert ingress.registry.get_sample_value("pie:ingress_retries_total") == FAILURES_IN_A_ROW
                detail = ingress.health()[0]["detail"][0]
                assert detail["status"] == "failing" and "its connection failed" in detail["error"], detail
    finally:
        closed.close()


queued = threading.Event()
"""Set by the busy replica when a queued request reaches it."""
tick = threading.Event()
"""Set by the test for the busy replica's running stream to send its next token."""


async def busy_replica(request: Request) -> Response:
    """A working replica with a queue: the stream of prompt "running" sends a token each time the test ticks; any other
    request waits in its queue until its client leaves."""
    if (await request.json())["prompt"] != "running":
        queued.set()
        deadline = time.monotonic() + SLOW_SECONDS
        while time.monotonic() < deadline and not await request.is_disconnected():
            await asyncio.sleep(0.05)
        return JSONResponse({"choices": []})

    async def events() -> AsyncIterator[bytes]:
        deadline = time.monotonic() + SLOW_SECONDS
        while time.monotonic() < deadline and not await request.is_disconnected():
            yield b'data: {"choices": [{"index": 0, "text": "a", "finish_reason": null}]}\n\n'
            while not tick.is_set() and time.monotonic() < deadline and not await request.is_disconnected():
                await asyncio.sleep(0.02)
            tick.clear()
        yield b"data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _read_running(url: str, received: list[str], done: threading.Event) -> None:
    """The busy replica's running stream, its events into ``received``, until ``done`` (at its next event)."""
    body = {"prompt": "running", "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: "):
                received.append(line)
            if done.is_set():
                break


def test_clients_tired_of_a_busy_replicas_queue_count_not_against_it() -> None:
    """Each client that left before its answer counted against its replica, however busy: a working replica whose queue
    outlasted three impatient clients in a row, its running streams sending tokens all the while, was taken out of
    routing as a stuck engine is (and load moved on to the next replica, whose queue then grew)."""
    replica = Starlette(routes=[Route("/v1/completions", busy_replica, methods=["POST"])])
    for replica_url in serve(replica):
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)], clock=Clock())
        for url in serve(create_ingress_app(ingress)):
            _until_ready(ingress, 1)
            received: list[str] = []
            done = threading.Event()
            reader = threading.Thread(target=_read_running, args=(url, received, done))
            reader.start()
            try:
                for _ in range(FAILURES_IN_A_ROW):
                    queued.clear()
                    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as client:
                        raw = json.dumps({"prompt": "queued"}).encode()
                        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pie\r\nContent-Type: application/json"
                                       b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
                        assert queued.wait(30), "the queued request did not reach the replica"
                        tokens = len(received)
                        tick.set()  # the running stream sends a token while this one waits
                        deadline = time.monotonic() + 30
                        while len(received) == tokens:
                            assert time.monotonic() < deadline, "the running stream's token did not come"
                            time.sleep(0.02)
                    deadline = time.monotonic() + 30
                    while ingress.router.load[0] > 1:  # (the ingress sees its client leave)
                        assert time.monotonic() < deadline, "the ingress did not see the client leave"
                        time.sleep(0.02)
                detail = ingress.health()[0]["detail"][0]
                failures = ingress.replicas[0].failures
            finally:
                done.set()
                tick.set()
                reader.join(60)
            assert detail["status"] == "ready" and failures == 0, (detail, failures)


def _responses_replica(fails: bool) -> Starlette:
    """A replica answering /v1/responses streams with pie serve's own events: whole, or failed after the first text
    with a kernel's 500 (``fails``)."""
    from pie.serve.responses import EventWriter, ResponsesRequest

    async def responses(request: Request) -> Response:
        writer = EventWriter(ResponsesRequest.model_validate(await request.json()), "resp_1", "tiny")
        events = [*writer.start(), *writer.chunk({"choices": [{"index": 0, "delta": {"content": "a"},
                                                              "finish_reason": None}]})]
        if fails:
            events += writer.failure(APIError(500, "kernel rms_norm failed", code="kernel_failed").event_body()["error"])
        else:
            events += writer.chunk({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2,
                                              "prompt_tokens_details": {"cached_tokens": 0}}})

        async def sent() -> AsyncIterator[bytes]:
            for event in events:
                yield event

        return StreamingResponse(sent(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/responses", responses, methods=["POST"])])


@pytest.mark.parametrize("fails", [False, True])
def test_a_responses_stream_passes_whole_and_its_failure_counts_against_its_replica(fails: bool) -> None:
    """/v1/responses was a 404 through the ingress; its streams end with response.completed (or .failed), not
    [DONE], and their error event is the Responses API's own."""
    for replica_url in serve(_responses_replica(fails)):
        ingress = Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)], clock=Clock())
        for url in serve(create_ingress_app(ingress)):
            _until_ready(ingress, 1)
            for _ in range(FAILURES_IN_A_ROW):
                with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=30) as client:
                    kinds = [event.type for event in client.responses.create(model="tiny", input="Hi", stream=True)]
                ending = ["error", "response.failed"] if fails else ["response.output_text.done",
                                                                     "response.content_part.done",
                                                                     "response.output_item.done", "response.completed"]
                assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-len(ending):] == ending
            detail = ingress.health()[0]["detail"][0]
            if fails:
                assert detail["status"] == "failing" and "kernel_failed" in detail["error"], detail
            else:
                assert detail["status"] == "ready" and ingress.replicas[0].failures == 0, detail
