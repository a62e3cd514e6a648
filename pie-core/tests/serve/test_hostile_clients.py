"""What a client that does not play fair cannot do to the server: hold it to an endless request head, or
to connections it never finishes.

The server runs in this process, under uvicorn as `pie serve` configures it, with no model (``/health`` answers
503 "loading"): these are properties of the HTTP side. Each client is a raw socket, to send what no HTTP client
library would.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pie.serve import connection, inferlets
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.server import uvicorn_config
from pie.testing.serve_process import ServeProcess, wait_until

ANSWER_TIMEOUT_S = 20.0
"""How long a client waits for an answer the server owes it (long against a loaded CI machine)."""
SEND_LIMIT_BYTES = 8 << 20
"""Most a client sends of an endless request before it stops and looks for an answer."""


READ_BYTES = 256 * 1024
"""The most asyncio's event loop, and uvloop, read from a connection at once."""
SHORT_TIMEOUT_S = 0.5
"""The head and body timeouts of a server under test, for clients that wait them out."""


@pytest.fixture
def short_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(connection, "HEAD_TIMEOUT_S", SHORT_TIMEOUT_S)
    monkeypatch.setattr(connection, "BODY_TIMEOUT_S", SHORT_TIMEOUT_S)


@contextmanager
def running(settings: ServeSettings | None = None, app: FastAPI | None = None) -> Iterator[uvicorn.Server]:
    """The application (with no model) or ``app``, under uvicorn on a thread of this process."""
    settings = settings or ServeSettings(served_model_name="tiny")
    server = uvicorn.Server(uvicorn_config(app or create_app(ServerState(settings)), "127.0.0.1", 0, settings,
                                           access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30)
    try:
        yield server
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def serving(settings: ServeSettings | None = None, app: FastAPI | None = None) -> Iterator[int]:
    """:func:`running`'s server's port."""
    with running(settings, app) as server:
        yield server.servers[0].sockets[0].getsockname()[1]


def connect(port: int) -> socket.socket:
    client = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_TIMEOUT_S)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
    return client


def send_until_answered(client: socket.socket, start: bytes, chunk: bytes) -> None:
    """``start``, then ``chunk`` again and again until the server answers or closes (at most SEND_LIMIT_BYTES)."""
    client.sendall(start)
    sent = len(start)
    while sent < SEND_LIMIT_BYTES:
        if select.select([client], [], [], 0)[0]:
            return
        try:
            client.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            return
        sent += len(chunk)


def closed(client: socket.socket) -> bool:
    """Whether the server closes the connection without an answer (AssertionError when it neither closes nor
    answers)."""
    try:
        return client.recv(1 << 16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        raise AssertionError(f"the connection is still open after {ANSWER_TIMEOUT_S} s") from None


def answer(client: socket.socket) -> tuple[int, bytes]:
    """The status and body of the one response the server sends before it closes the connection (a reset, when it
    closes with bytes of the client's unread)."""
    received = b""
    try:
        while data := client.recv(1 << 16):
            received += data
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"no answer and no close within {ANSWER_TIMEOUT_S} s (got {received[:80]!r})") from None
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 "), received[:200]
    return int(head.split(b" ")[1]), body


@pytest.mark.parametrize("start,chunk", [
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ", b"a" * 65536),  # one header that never ends
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\n", b"X-h: v\r\n" * 8192),  # headers that never end
    (b"GET /", b"a" * 65536),  # a URL that never ends
], ids=["header-value", "header-lines", "url"])
def test_a_request_head_that_never_ends_is_refused_with_431_and_closed(start: bytes, chunk: bytes) -> None:
    """uvicorn keeps every byte of a request's head until its end: one connection grew the server by 1.4 GiB."""
    with serving() as port, connect(port) as client:
        send_until_answered(client, start, chunk)
        status, body = answer(client)
        assert status == 431
        assert json.loads(body)["error"]["code"] == "request_header_too_large"


def test_a_request_of_more_than_100_headers_is_refused_and_one_of_100_is_served() -> None:
    with serving() as port:
        head = b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        for count, status in ((98, 503), (99, 431)):  # with Host and Connection: 100, 101
            with connect(port) as client:
                client.sendall(head + b"".join(b"X-%d: v\r\n" % i for i in range(count)) + b"\r\n")
                assert answer(client)[0] == status, count
        with connect(port) as client:  # a large head under the limit (a long cookie) is served
            client.sendall(head + b"Cookie: " + b"c" * 60_000 + b"\r\n\r\n")
            assert answer(client)[0] == 503


@pytest.mark.parametrize("sent", [
    b"",  # a connection that says nothing
    b"GET /health HTTP/1.1\r\nHost: localhost\r\n",  # half a head
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
    b"Content-Length: 1000\r\n\r\n{",  # half a body
], ids=["silent", "half-head", "half-body"])
def test_a_connection_that_stops_short_of_a_whole_request_is_closed(short_timeouts: None, sent: bytes) -> None:
    """uvicorn waits for ever for a request's head and body: such connections stayed open for minutes, 150 of
    them holding 1.2 GiB of bodies and a file descriptor each."""
    with serving() as port, connect(port) as client:
        client.sendall(sent)
        assert closed(client)


def test_a_body_that_comes_a_byte_at_a_time_is_cut_off_at_the_body_deadline(short_timeouts: None) -> None:
    """The body's deadline is for all of it: a client that sends a byte just often enough is closed all the same."""
    with serving() as port, connect(port) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000\r\n\r\n")
        cut = False
        for _ in range(1000):  # 100 s at most: the deadline is 0.5 s
            try:
                client.sendall(b" ")
            except (BrokenPipeError, ConnectionResetError):
                cut = True
                break
            if select.select([client], [], [], SHORT_TIMEOUT_S / 5)[0]:
                cut = closed(client)
                break
        assert cut


def test_what_takes_longer_than_the_deadlines_after_the_request_came_is_not_cut(short_timeouts: None) -> None:
    """The deadlines are the client's, for its request: a response slower than them, and a kept-alive connection
    idle between requests, are not cut (uvicorn's keep-alive timeout, 5 s, closes the latter)."""
    app = FastAPI()

    @app.post("/slow")
    async def slow(body: dict[str, int]) -> dict[str, int]:
        await asyncio.sleep(SHORT_TIMEOUT_S * 3)
        return body

    with serving(app=app) as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=ANSWER_TIMEOUT_S) as client:
        assert client.post("/slow", json={"a": 1}).json() == {"a": 1}
        time.sleep(SHORT_TIMEOUT_S * 3)
        assert client.post("/slow", json={"b": 2}).json() == {"b": 2}
        assert client.post("/slow", json={"c": 3}).json() == {"c": 3}


@pytest.mark.parametrize("head", [
    b"Transfer-Encoding: chunked\r\n\r\n",  # an endless chunked body
    b"Content-Length: 1000000000\r\n\r\n",  # a gigabyte, declared
], ids=["chunked", "declared"])
def test_a_body_over_the_limit_is_refused_with_413_and_its_connection_closed(head: bytes) -> None:
    """The server answered 413 and went on reading the body it refused, 52 GB in 20 s of an endless one."""
    with serving(ServeSettings(max_body_bytes=1 << 16)) as port, connect(port) as client:
        start = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n" + head
        chunk = b"%x\r\n%s\r\n" % (1 << 16, b" " * (1 << 16)) if b"chunked" in head else b" " * (1 << 16)
        send_until_answered(client, start, chunk)
        status, body = answer(client)
        assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("authorization,code", [
    (b"", "missing_api_key"),
    (b"Authorization: Bearer nope\r\n", "invalid_api_key"),
], ids=["missing", "wrong"])
def test_a_request_without_the_key_is_refused_on_its_head_before_its_body_comes(authorization: bytes, code: str) -> None:
    """The key was a FastAPI dependency, checked after the body was read and parsed: a client without it made the
    server hold 8 MiB and parse it (140 ms of the event loop) before its 401."""
    with serving(ServeSettings(api_key="s3cret")) as port, connect(port) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 1000000\r\n" + authorization + b"\r\n{")
        status, body = answer(client)  # and the connection closed: the rest of the body is not read
        assert status == 401 and json.loads(body)["error"]["code"] == code


def test_without_a_key_a_loopback_server_answers_only_requests_that_name_this_machine() -> None:
    """DNS rebinding: a web page on attacker.example re-points its name to 127.0.0.1, and the browser lets it read
    what the server answers as same-origin. The Host header still names attacker.example."""
    with serving() as port, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=ANSWER_TIMEOUT_S) as client:
        for host in ("attacker.example", f"attacker.example:{port}", f"localhost.attacker.example:{port}"):
            refused = client.get("/health", headers={"Host": host})
            assert refused.status_code == 421, host
            assert refused.json()["error"]["code"] == "untrusted_host"
        for host in (f"localhost:{port}", f"LocalHost:{port}", "127.0.0.1", f"127.0.0.1:{port}", f"[::1]:{port}"):
            assert client.get("/health", headers={"Host": host}).json() == {"status": "loading"}, host
    with serving(ServeSettings(api_key="s3cret")) as port:  # a page without the key reads nothing
        health = httpx.get(f"http://127.0.0.1:{port}/health", headers={"Host": "attacker.example"})
        assert health.json() == {"status": "loading"}


def test_pipelined_requests_are_parsed_a_few_at_a_time_and_all_answered() -> None:
    """uvicorn parsed every request of each read, and read on after each response: a client that sent `GET /health`
    again and again without reading the answers had thousands parsed and waiting on each connection (20 such
    connections grew a server by 770 MB)."""
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n"
    count = 20_000  # 840 KB
    bound = connection.MAX_PIPELINED + connection.FEED_BYTES // len(request) + 1
    kept_bound = 2 * READ_BYTES  # the rest of one read, and one read more
    with running() as server, connect(server.servers[0].sockets[0].getsockname()[1]) as client:
        protocols = server.server_state.connections

        def waiting() -> int:
            return max((len(protocol.pipeline) for protocol in list(protocols)), default=0)

        def kept() -> int:
            return max((len(getattr(protocol, "_unparsed", b"")) for protocol in list(protocols)), default=0)

        sending = threading.Thread(target=client.sendall, args=(request * count,), daemon=True)
        sending.start()
        # parsing stopped, with what came kept, or (as it was) went past the bound
        assert wait_until(lambda: waiting() > bound or kept() > 0, timeout=ANSWER_TIMEOUT_S)
        most, most_kept, answers, tail = waiting(), kept(), 0, b""
        answered = b"HTTP/1.1 503 Service Unavailable"  # /health while the model loads
        while answers < count:
            data = client.recv(1 << 16)
            assert data, f"closed after {answers} answers"
            answers += (tail + data).count(answered)
            tail = (tail + data)[1 - len(answered):]
            most, most_kept = max(most, waiting()), max(most_kept, kept())
        sending.join(ANSWER_TIMEOUT_S)
    assert most <= bound, f"{most} requests parsed and waiting"
    assert most_kept <= kept_bound, f"{most_kept} bytes read and kept unparsed"


def test_uploads_waiting_for_their_check_hold_places_of_max_inferlet_runs(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """An upload waiting its turn to be checked (two at once) held its body, and the queue had no bound: 60 uploads of
    2 MB grew a server by 300 MB, and the last waited 280 s, to be refused then where the runs were full."""
    started, go = tmp_path / "started", tmp_path / "go"
    started.mkdir()
    waits = (f"import os, time\nopen(os.path.join({str(started)!r}, str(os.getpid())), 'w').close()\n"
             f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\nprint('{{\"problem\": null}}')\n")
    monkeypatch.setattr(inferlets, "CHECK_SCRIPT", waits)  # a check that lasts until the test lets it end
    upload = {"source": "async def main(ctx, args):\n    return 1\n"}
    settings = ServeSettings(served_model_name="tiny", allow_uploads=True, max_inferlet_runs=2)
    with serving(settings) as port, ThreadPoolExecutor(2) as pool:
        url = f"http://127.0.0.1:{port}/v1/inferlets/runs"
        checked = [pool.submit(httpx.post, url, json=upload, timeout=ANSWER_TIMEOUT_S) for _ in range(2)]
        assert wait_until(lambda: len(list(started.iterdir())) == 2, timeout=ANSWER_TIMEOUT_S)
        refused = httpx.post(url, json=upload, timeout=ANSWER_TIMEOUT_S)
        go.touch()
        answers = [future.result() for future in checked]
        later = httpx.post(url, json=upload, timeout=ANSWER_TIMEOUT_S)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "overloaded"
    assert refused.json()["error"]["message"] == ("2 inferlet runs are in progress (2 of them uploads being checked), "
                                                  "the most this server takes; retry later")
    for checked_one in [*answers, later]:  # checked, then refused for want of a model: their places were given back
        assert checked_one.status_code == 503 and checked_one.json()["error"]["message"] == "the model is loading"


@pytest.mark.skipif(sys.platform != "linux", reason="reads another process's limits with prlimit")
def test_pie_serve_raises_its_open_file_limit_to_the_hard_one(tiny_model: Path) -> None:
    """Every connection holds a file descriptor: under a soft limit of 1024 (a common default), 1,100 idle
    connections stopped /health from being answered while the hard limit allowed many more."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    low = 256
    if hard != resource.RLIM_INFINITY and hard <= low:
        pytest.skip(f"the hard limit on open files here is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))  # the server inherits it
    try:
        server = ServeProcess("--model", str(tiny_model))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with server:
        assert resource.prlimit(server.process.pid, resource.RLIMIT_NOFILE) == (hard, hard)
        assert server.stop() == 0
