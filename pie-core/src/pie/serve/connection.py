"""The server's HTTP connections: uvicorn's httptools protocol, with bounds on what one request may make it hold.

uvicorn keeps every byte of a request's line and headers until they end (httptools joins a header's pieces as
they come): one connection sending an endless header grew a server by 1.4 GiB. Here a request's head has at
most MAX_HEAD_BYTES and MAX_HEADERS; past either the client gets 431, in OpenAI's error JSON, and the
connection is closed.

Nor does uvicorn time a request's arrival: a connection that sends half a head, or half a body, is held (with
what it sent) for as long as the client likes. Here a head must come within HEAD_TIMEOUT_S and a body within
BODY_TIMEOUT_S, or the connection is closed. Between requests uvicorn's own keep-alive timeout (5 s) applies.

Nor does uvicorn bound HTTP/1.1 pipelining: it parses the whole of each read, and a request that comes while
another is answered waits, parsed, in its queue; reading goes on after each response however many wait. A client
that sent `GET /health` again and again without reading the answers had thousands parsed on each of its
connections (20 connections grew a server by 770 MB). Here a read is parsed FEED_BYTES at a time, and parsing stops
while MAX_PIPELINED requests wait: the rest is kept, reading stops, and both go on as the waiting ones are answered.

(uvicorn's h11 parser has a byte bound of its own, ``h11_max_incomplete_event_size``, but it is pure Python:
httptools stays, for the speed it was chosen for.)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pie.serve.protocol import APIError

MAX_HEAD_BYTES = 64 * 1024
"""A request's line and headers together: real clients send a few hundred bytes, a large cookie some KiB. (A
pipelined request's head counts from the first read after the one that ended the request before it: the parser
does not say where in a read a message ended. So it may hold one read more, at most 256 KiB: still bounded.)"""
MAX_HEADERS = 100
"""Header lines in one request (Apache's LimitRequestFields): a head of tiny headers is mostly per-header overhead."""
HEAD_TIMEOUT_S = 30.0
"""From a connection's start, or a later request's first byte, until the request's head has come."""
MAX_PIPELINED = 16
"""Requests of one connection parsed and waiting behind the one being answered."""
FEED_BYTES = 4096
"""How much of a read is parsed at once: the most requests parsed past MAX_PIPELINED (a request is 18 bytes at
least)."""
BODY_TIMEOUT_S = 60.0
"""From a request's head until the end of its body, while the server reads it: an 8 MiB body (the default
--max-body-bytes) needs 140 KB/s."""


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over a limit."""


class HoldingFlowControl(FlowControl):
    """uvicorn's flow control of a connection's reading, which stays stopped while ``holding()``, whatever uvicorn
    asks (it asks to read again as each request's body is awaited, and after each response)."""

    def __init__(self, transport: asyncio.Transport, holding: Callable[[], bool]):
        super().__init__(transport)
        self.holding = holding

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            if not self.holding():
                self._transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.holding():
                self._transport.resume_reading()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request head over MAX_HEAD_BYTES or MAX_HEADERS, closing a
    connection whose request's head or body is late, and parsing no further while MAX_PIPELINED requests wait."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0
        """Bytes received of the request head being read; None while a body is read."""
        self._refusal: str | None = None
        """Why a parser callback stopped the request (the parser's error then is ours)."""
        self._deadline: asyncio.TimerHandle | None = None
        """When the head, or the body (``_head_bytes`` None), being read is late."""
        self._unparsed = b""
        """What came while MAX_PIPELINED requests waited (reading stops meanwhile)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = HoldingFlowControl(transport, lambda: bool(self._unparsed))
        self._arm(HEAD_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._unparsed:  # read in the same turn of the loop as the read whose rest was kept
            self._unparsed += data
            return
        self._feed(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next waiting request
        if self._unparsed and len(self.pipeline) < MAX_PIPELINED and not self.transport.is_closing():
            data, self._unparsed = self._unparsed, b""
            if not self.flow.read_paused:
                self.transport.resume_reading()
            self._feed(data)

    def _feed(self, data: bytes) -> None:
        """Parse ``data`` FEED_BYTES at a time; once MAX_PIPELINED requests wait, keep the rest and stop reading."""
        for start in range(0, len(data), FEED_BYTES):
            if self.transport.is_closing():
                return
            if len(self.pipeline) >= MAX_PIPELINED:
                if not self.flow.read_paused:
                    self.transport.pause_reading()
                self._unparsed = data[start:]
                return
            self._parse(data[start:start + FEED_BYTES])

    def _parse(self, data: bytes) -> None:
        if self._head_bytes is None:
            super().data_received(data)
            return
        if self._deadline is None:  # a later request's first bytes
            self._arm(HEAD_TIMEOUT_S)
        room = MAX_HEAD_BYTES - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        self._head_bytes = MAX_HEAD_BYTES
        super().data_received(data[:room])
        if self.transport.is_closing():
            return
        if self._head_bytes == MAX_HEAD_BYTES:  # the head goes on past its bound
            self._refuse(f"the request's line and headers are over {MAX_HEAD_BYTES} bytes")
            return
        self._parse(data[room:])  # the head ended within: the rest is its body, or the next request

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            self._refusal = f"the request has more than {MAX_HEADERS} headers"
            raise HeadTooLarge(self._refusal)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        self._disarm()
        self._arm(BODY_TIMEOUT_S)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float) -> None:
        self._deadline = self.loop.call_later(seconds, self._late)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _late(self) -> None:
        self._deadline = None
        if self._unparsed or (self._head_bytes is None and self.flow.read_paused):
            # the server stopped parsing (MAX_PIPELINED requests wait) or reading (the application has yet to take
            # what came, or the request waits behind another's response): no delay of the client's
            self._arm(BODY_TIMEOUT_S if self._head_bytes is None else HEAD_TIMEOUT_S)
            return
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parser error, which a refusal raised from a callback of ours is
        if self._refusal is not None:
            self._refuse(self._refusal)
        else:
            super().send_400_response(msg)

    def _refuse(self, message: str) -> None:
        body = json.dumps(APIError(431, message, code="request_header_too_large").body()).encode()
        head = [STATUS_LINE[431]]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()
