"""A streamed response whose request is released however the response ends."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class ReleasingStream(StreamingResponse):
    """A streaming response that calls ``release`` once it is over: sent whole, cut off, or never begun.

    A ``finally`` inside the body's generator is not enough: where the server fails to send the response's start
    (a client already gone, under ASGI 2.4), the body is never iterated, and a generator never started runs no
    ``finally``. ``release`` may also be called by the body itself; it must then be safe to call twice.
    """

    def __init__(self, content: object, release: Callable[[], None], **options: object):
        super().__init__(content, **options)  # type: ignore[arg-type]  # StreamingResponse's own options
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()
