"""The server's HTTP connections: uvicorn's httptools protocol, with bounds on what one request may make it hold.

uvicorn keeps every byte of a request's line and headers until they end (httptools joins a header's pieces as
they come): one connection sending an endless header grew a server by 1.4 GiB. Here a request's head has at
most MAX_HEAD_BYTES and MAX_HEADERS; past either the client gets 431, in OpenAI's error JSON, and the
connection is closed.

(uvicorn's h11 parser has a byte bound of its own, ``h11_max_incomplete_event_size``, but it is pure Python:
httptools stays, for the speed it was chosen for.)
"""

from __future__ import annotations

import json
from typing import Any

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pie.serve.protocol import APIError

MAX_HEAD_BYTES = 64 * 1024
"""A request's line and headers together: real clients send a few hundred bytes, a large cookie some KiB."""
MAX_HEADERS = 100
"""Header lines in one request (Apache's LimitRequestFields): a head of tiny headers is mostly per-header overhead."""


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a request head over a limit."""


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, refusing a request head over MAX_HEAD_BYTES or MAX_HEADERS."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_bytes: int | None = 0
        """Bytes received of the request head being read; None while a body is read."""
        self._refusal: str | None = None
        """Why a parser callback stopped the request (the parser's error then is ours)."""

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:
            super().data_received(data)
            return
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
        self.data_received(data[room:])  # the head ended within: the rest is its body, or the next request

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(self.headers) >= MAX_HEADERS:
            self._refusal = f"the request has more than {MAX_HEADERS} headers"
            raise HeadTooLarge(self._refusal)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._head_bytes = 0
        super().on_message_complete()

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
