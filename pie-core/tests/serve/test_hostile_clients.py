"""What a client that does not play fair cannot do to the server: hold it to an endless request head, or
to connections it never finishes.

The server runs in this process, under uvicorn as `pie serve` configures it, with no model (``/health`` answers
503 "loading"): these are properties of the HTTP side. Each client is a raw socket, to send what no HTTP client
library would.
"""

from __future__ import annotations

import json
import select
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import uvicorn
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.server import uvicorn_config
from serve_process import wait_until

ANSWER_TIMEOUT_S = 20.0
"""How long a client waits for an answer the server owes it (long against a loaded CI machine)."""
SEND_LIMIT_BYTES = 8 << 20
"""Most a client sends of an endless request before it stops and looks for an answer."""


@contextmanager
def serving(settings: ServeSettings | None = None) -> Iterator[int]:
    """The application, with no model, under uvicorn on a thread of this process; its port."""
    state = ServerState(settings or ServeSettings(served_model_name="tiny"))
    server = uvicorn.Server(uvicorn_config(create_app(state), "127.0.0.1", 0, access_log=False))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(30)


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
