"""Clients that read slowly or never: they must not hold the server's places, its generation, or its event loop."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from pie.runtime.llm import LLM
from pie.serve import app as serve_app
from pie.serve import protocol, streams
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.engine import Delta, TokenLogprob
from pie.serve.server import CLIENT_PROBE_IDLE_S, CLIENT_PROBE_INTERVAL_S, CLIENT_PROBES, listen
from pie.testing.serve_process import wait_until

SEND_BUFFER = 4096
"""The server's socket send buffer here (the kernel doubles it): a client that does not read blocks the server's
writes after some tens of kilobytes, where the loopback's default buffer would take megabytes first."""
CHUNKED_END = b"0\r\n\r\n"


@contextmanager
def serving(state: ServerState) -> Iterator[int]:
    """The application under uvicorn on a thread of this process, on a free loopback port (yielded) whose
    connections have a small send buffer. uvicorn leaves logging alone: its records reach pytest's capture."""
    listening = listen("127.0.0.1", 0)
    listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)  # accepted connections inherit it
    server = uvicorn.Server(uvicorn.Config(create_app(state), log_config=None, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=60)
        yield listening.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)
        listening.close()


@contextmanager
def never_reading(port: int, path: str, body: dict[str, Any]) -> Iterator[socket.socket]:
    """A client that sends its request and then reads nothing (until the test does), through a 4 KiB receive buffer."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.connect(("127.0.0.1", port))
    raw = json.dumps(body).encode()
    client.sendall(b"POST %s HTTP/1.1\r\nHost: pie\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                   % (path.encode(), len(raw)) + raw)
    try:
        yield client
    finally:
        client.close()


def read_until(client: socket.socket, end: bytes | None, limit: int = 256 * 2**20) -> tuple[bytes, str]:
    """What the client had not read yet, up to ``end`` (None: up to the server's end of the connection), and how
    the reading stopped: "end", "closed" or "reset". Each read waits at most 30 s."""
    client.settimeout(30)
    received = bytearray()
    while len(received) < limit:
        try:
            data = client.recv(1 << 16)
        except ConnectionResetError:
            return bytes(received), "reset"
        if not data:
            return bytes(received), "closed"
        received += data
        if end is not None and received.endswith(end):
            return bytes(received), "end"
    raise AssertionError(f"more than {limit} bytes, and no end")


def test_the_servers_connections_probe_a_silent_client() -> None:
    """The server's connections had no TCP keepalive: a client whose host vanished (no FIN reaches the server) while
    its whole answer was generated was never found gone, and the answer was generated for no one."""
    listening = listen("127.0.0.1", 0)
    with listening, socket.create_connection(listening.getsockname(), timeout=10):
        accepted, _ = listening.accept()  # as uvicorn's loop accepts it: the options come from the listening socket
        with accepted:
            read = [accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)]
            if hasattr(socket, "TCP_KEEPIDLE"):  # (Linux's names)
                read += [accepted.getsockopt(socket.IPPROTO_TCP, option)
                         for option in (socket.TCP_KEEPIDLE, socket.TCP_KEEPINTVL, socket.TCP_KEEPCNT)]
    assert read[0] != 0, "SO_KEEPALIVE is off"
    if len(read) > 1:
        assert read[1:] == [CLIENT_PROBE_IDLE_S, CLIENT_PROBE_INTERVAL_S, CLIENT_PROBES]


def test_a_stream_whose_client_stops_reading_is_cut_and_its_generation_cancelled(
    long_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A client that stopped reading held its request in flight (a place of --max-running + --max-waiting, and the
    drain's wait) for as long as it kept the connection open, and its generation ran to the end for no one."""
    monkeypatch.setattr(streams, "SEND_TIMEOUT_S", 0.5)
    llm = LLM.load(str(long_model), "cpu", max_cached_tokens=8192)
    state = ServerState(ServeSettings(served_model_name="long"), llm)
    body = {"prompt": "Never read me", "max_tokens": 6000, "logprobs": 20, "ignore_eos": True, "stream": True}
    with serving(state) as port, never_reading(port, "/v1/completions", body) as client:
        engine = state.engine
        assert engine is not None
        assert wait_until(lambda: engine.core.stats.steps > 0, timeout=30), "the request was never taken"
        assert wait_until(lambda: state.in_flight == 0, timeout=30), "the stream was never ended"
        assert wait_until(lambda: engine.running_count == 0 and llm.runner.pages.used_count == 0)
        rest, how = read_until(client, None)
        assert how in ("closed", "reset") and not rest.endswith(CHUNKED_END), "the server closed the connection"
        assert b"data: [DONE]" not in rest
    assert "took nothing for 0.5 s" in caplog.text, caplog.text
    assert "without completing" not in caplog.text and "Traceback" not in caplog.text, caplog.text


def test_a_request_whose_generation_is_over_no_longer_holds_a_place(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request counted against --max-running + --max-waiting until its client had read it all: at --max-running 1
    --max-waiting 1, one client slow to read the end of its stream left every other client a 503 for a minute."""
    monkeypatch.setattr(streams, "SEND_TIMEOUT_S", 600.0)  # the slow client stays behind for the whole test
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=4096)
    state = ServerState(ServeSettings(served_model_name="tiny", max_running=1, max_waiting=0), llm)
    body = {"prompt": "Hold my place", "max_tokens": 100, "n": 8, "logprobs": 20, "ignore_eos": True, "stream": True}
    with serving(state) as port, never_reading(port, "/v1/completions", body) as slow:
        engine = state.engine
        assert engine is not None

        def generated() -> bool:
            return engine.core.stats.steps > 0 and engine.running_count == engine.waiting_count == 0

        assert wait_until(generated, timeout=60)
        assert wait_until(lambda: state.working == 0), "the engine's word that it ended reached the HTTP side"
        assert state.in_flight == 1, "its stream is still being sent: the drain waits for it"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="Next", max_tokens=2, extra_body={"ignore_eos": True})
        assert reply.usage.completion_tokens == 2
        stream, how = read_until(slow, CHUNKED_END)
        assert how == "end" and stream.startswith(b"HTTP/1.1 200")
        assert stream.count(b'"finish_reason": "length"') == 8 and b"data: [DONE]" in stream, "nothing unread was lost"
    assert state.in_flight == 0


def test_a_whole_response_is_built_off_the_event_loop(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """n=64 choices of 300 tokens with 20 log-probabilities each make a 28 MiB body: built on the event loop, it
    kept /health (and every other request) waiting for seconds. Here the body's building waits for /health."""
    building, answered = threading.Event(), threading.Event()
    build = serve_app.response_json

    def build_after_health(*args: Any) -> bytes:
        building.set()
        answered.wait(30)
        return build(*args)

    monkeypatch.setattr(serve_app, "response_json", build_after_health)
    n, max_tokens, top = 8, 40, 5
    assert n * max_tokens * (top + 2) > serve_app.LARGE_BODY, "a body large enough to be built off the loop"
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=4096)
    state = ServerState(ServeSettings(served_model_name="tiny"), llm)
    with serving(state) as port:
        url = f"http://127.0.0.1:{port}"
        whole: list[httpx.Response] = []
        asking = threading.Thread(target=lambda: whole.append(httpx.post(
            f"{url}/v1/chat/completions", timeout=60,
            json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "n": n, "logprobs": True,
                  "top_logprobs": top, "ignore_eos": True})))
        asking.start()
        try:
            assert building.wait(30)
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200
        finally:
            answered.set()
            asking.join(60)
    reply = whole[0].json()
    assert whole[0].status_code == 200 and [c["index"] for c in reply["choices"]] == list(range(n))
    assert all(len(c["logprobs"]["content"]) == max_tokens for c in reply["choices"])
    assert all(len(entry["top_logprobs"]) == top for c in reply["choices"] for entry in c["logprobs"]["content"])
    assert reply["usage"]["completion_tokens"] == n * max_tokens


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_a_whole_response_encoded_in_slices_is_the_json_of_one_piece(kind: protocol.Kind,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    choices = []
    for index in range(3):
        choice = protocol.ChoiceState(index)
        for token in range(7):
            top = [(token + k, -1.5 - k) for k in range(3)]
            choice.add(Delta(index, ["a", "\u00fc\n", '"q"'][token % 3], [token], [TokenLogprob(token, -0.25, top)],
                             "length" if token == 6 else None))
        choices.append(choice)

    def body() -> dict[str, Any]:
        encoded = json.loads(protocol.response_json(kind, "id-1", "tiny", "fp_1", choices, {"total_tokens": 21},
                                                    lambda token: b"t%d" % token, frozenset(), True))
        del encoded["created"]
        return encoded

    whole = body()
    monkeypatch.setattr(protocol, "ENCODE_SLICE", 2)
    assert body() == whole
    assert [len(choice["logprobs"]["content" if kind == "chat" else "tokens"]) for choice in whole["choices"]] == [7] * 3

