"""Who may use the server: the API key, checked on a request's head before its body is read, and, for a server on
loopback without a key, the Host a request names.

(A FastAPI dependency runs after the body has been read and parsed: a client without the key could make the
server hold megabytes and parse them before its 401.)
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Callable
from typing import Literal

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pie.serve.protocol import APIError

KeyRule = Literal["open", "bearer", "basic", "challenge"]
"""How a path takes the key: not at all; as ``Authorization: Bearer KEY``; that or as the password of HTTP Basic
authentication (a browser opening a page cannot send a header); and that with a 401 that asks the browser for it."""
BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="pie serve", charset="UTF-8"'}


class KeyCheck:
    """ASGI middleware: a 401 in OpenAI's error JSON for a request without ``api_key`` where ``rule`` (of its path)
    asks for it, the key compared in constant time; ``refused`` (when given) is called for each one."""

    def __init__(self, app: ASGIApp, api_key: str, rule: Callable[[str], KeyRule],
                 refused: Callable[[], None] | None = None):
        self.app = app
        self.api_key = api_key.encode()
        self.rule = rule
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rule = self.rule(scope["path"]) if scope["type"] == "http" else "open"
        error = None if rule == "open" else self._error(scope, rule)
        if error is None:
            await self.app(scope, receive, send)
            return
        if self.refused is not None:
            self.refused()
        await answer_unread(error, scope, receive, send)

    def _error(self, scope: Scope, rule: KeyRule) -> APIError | None:
        authorization = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        scheme, _, given = authorization.partition(b" ")
        given = given.strip()
        if rule == "bearer" and scheme.lower() == b"basic":
            # Never taken here: a browser sends the Basic key it holds for the page with every request to this
            # server, also those a page of another origin makes it send (cross-site request forgery).
            return APIError(401, "this path takes the API key as the header 'Authorization: Bearer <key>', not as "
                                 "HTTP Basic authentication", code="invalid_api_key")
        if scheme.lower() == b"basic":
            try:
                given = base64.b64decode(given, validate=True).partition(b":")[2]
            except binascii.Error:
                given = b""
        elif scheme.lower() != b"bearer":
            given = b""
        headers = BASIC_CHALLENGE if rule == "challenge" else None
        if not given:
            return APIError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                            code="missing_api_key", headers=headers)
        if not hmac.compare_digest(given, self.api_key):
            return APIError(401, "incorrect API key", code="invalid_api_key", headers=headers)
        return None


class LoopbackHosts:
    """ASGI middleware for a server on loopback without an API key: a request whose Host header names anything but
    this machine (``localhost`` or a loopback address, any port) is refused with 421.

    Without it any web page its user opens could use the server: the page's own name, re-pointed by its DNS to
    127.0.0.1 (DNS rebinding), makes the browser take the server for the page's origin. The Host header still
    names the page's host. A request without a Host header (HTTP/1.0) comes from no browser, and is served.
    """

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = next((value for name, value in scope["headers"] if name == b"host"), b"").decode("latin-1")
        if not host or names_this_machine(host):
            await self.app(scope, receive, send)
            return
        error = APIError(421, f"this server answers requests for localhost only, not for {host!r}: connect to "
                              "localhost or 127.0.0.1, or give the server an API key", code="untrusted_host")
        await answer_unread(error, scope, receive, send)


def names_this_machine(host: str) -> bool:
    """Whether a Host header's value (``name[:port]``, ``[address]:port``) is localhost or a loopback address."""
    return is_loopback(host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host)


def is_loopback(name: str) -> bool:
    """Whether a host name or address (no port) is localhost or a loopback address."""
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


async def answer_unread(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """``error`` as the answer to a request whose body is left unread; the connection is closed after it when a body
    comes (the server would read all of it, however long, to reach the next request)."""
    headers = dict(error.headers)
    if any(name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
           for name, value in scope["headers"]):
        headers["Connection"] = "close"
    await JSONResponse(error.body(), status_code=error.status, headers=headers)(scope, receive, send)
