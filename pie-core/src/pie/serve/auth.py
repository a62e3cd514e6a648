"""The server's one API-key check, as a FastAPI dependency: the key compared in constant time."""

from __future__ import annotations

import base64
import binascii
import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from pie.serve.protocol import APIError

BASIC_CHALLENGE = {"WWW-Authenticate": 'Basic realm="pie serve", charset="UTF-8"'}


def key_check(api_key: str | None, *, basic: bool = False, challenge: bool = False) -> Callable[[Request], Awaitable[None]]:
    """A dependency that lets a request through when it carries ``api_key`` (or always, when it is None).

    The key comes as ``Authorization: Bearer KEY``; with ``basic`` also as the password of HTTP Basic
    authentication (a browser opening a page cannot send a header), and ``challenge`` makes a 401 ask
    the browser for it.
    """
    headers = BASIC_CHALLENGE if challenge else None

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        given = given.strip()
        if basic and scheme.lower() == "basic":
            try:
                given = base64.b64decode(given, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                given = ""
        elif scheme.lower() != "bearer":
            given = ""
        if not given:
            raise APIError(401, "this server needs an API key: send the header 'Authorization: Bearer <key>'",
                           code="missing_api_key", headers=headers)
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key", headers=headers)

    return check
