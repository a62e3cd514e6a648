"""A streamed response whose request is released however the response ends, and whose client must keep reading."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

log = logging.getLogger("pie.serve")

SEND_TIMEOUT_S = 60.0
"""Seconds a stream waits for its client to take output before it closes the connection. A send waits only while the
kernel's buffer and the transport's (64 KiB) are full, until the client has taken some tens of kilobytes: this cuts a
client that takes nothing, or next to nothing, for a minute. Without it a client that stopped reading kept its request
in flight (its generation running, its output in memory, the drain waiting) for as long as it kept the connection
open. llama-server drops such clients after a write timeout too."""

CLOSE_CONNECTION = "pie.close_connection"
"""The scope key of a callable that closes the request's connection at once, dropping what is not yet sent (see
:func:`note_connection`)."""


def note_connection(scope: Scope, send: Send) -> None:
    """Keep, in ``scope``, a way to close the request's connection; ``send`` is the server's own.

    ASGI gives an application no way to drop a connection, and uvicorn's close waits until what it has buffered is
    sent: to a client that reads nothing, never. So the transport's ``abort`` is taken from uvicorn's ``send``, a
    method of its request cycle, which holds the transport. Under another server nothing is kept, and a stream
    waits for its client as long as the server lets it."""
    abort = getattr(getattr(getattr(send, "__self__", None), "transport", None), "abort", None)
    if callable(abort):
        scope[CLOSE_CONNECTION] = abort


def client_address(scope: Scope) -> str:
    """`` host:port`` of the request's client, for a log line (with its leading space), or nothing where the server
    does not say."""
    client = scope.get("client")
    return f" {client[0]}:{client[1]}" if client else ""


class FastAPIWithConnections(FastAPI):
    """FastAPI that keeps, in each request's scope, a way to close its connection (see :func:`note_connection`):
    only here, before any middleware wraps it, is the server's own ``send`` at hand."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        note_connection(scope, send)
        await super().__call__(scope, receive, send)


class ReleasingStream(StreamingResponse):
    """A streaming response that calls ``release`` once it is over: sent whole, cut off, or never begun.

    A ``finally`` inside the body's generator is not enough: where the server fails to send the response's start
    (a client already gone, under ASGI 2.4), the body is never iterated, and a generator never started runs no
    ``finally``. ``release`` may also be called by the body itself; it must then be safe to call twice.

    A send that waits more than :data:`SEND_TIMEOUT_S` closes the connection, and the response ends there: the
    output its client fell behind by is not made into chunks for no one.
    """

    def __init__(self, content: object, release: Callable[[], None], **options: object):
        super().__init__(content, **options)  # type: ignore[arg-type]  # StreamingResponse's own options
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        close = scope.get(CLOSE_CONNECTION)
        try:
            await super().__call__(scope, receive, send if close is None else _bounded(send, close, scope))
        except _Cut:
            pass  # the server knows the connection is gone: the response needs no end
        finally:
            self._release()


class _Cut(Exception):
    """A stream's client took nothing for SEND_TIMEOUT_S, and its connection was closed."""


def _bounded(send: Send, close: Callable[[], None], scope: Scope) -> Send:
    """``send``, closing the connection when one call waits more than SEND_TIMEOUT_S; that call then raises
    :class:`_Cut` (a server's send to a connection gone returns as if it had sent)."""
    loop = asyncio.get_running_loop()
    cut = False

    def cut_off() -> None:
        nonlocal cut
        cut = True
        log.warning("the client%s took nothing for %g s: its stream is cut and the connection closed",
                    client_address(scope), SEND_TIMEOUT_S)
        close()

    async def bounded_send(message: Message) -> None:
        timer = loop.call_later(SEND_TIMEOUT_S, cut_off)
        try:
            await send(message)
        finally:
            timer.cancel()
        if cut:
            raise _Cut

    return bounded_send
