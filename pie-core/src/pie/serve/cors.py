"""CORS for ``--allowed-origin``: Starlette's middleware, with a refused preflight answered in OpenAI's error JSON."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp

from pie.serve.protocol import APIError


class AllowedOrigins(CORSMiddleware):
    """Starlette's CORSMiddleware, but a preflight it refuses is a 400 in OpenAI's error JSON saying what it refused
    (Starlette's is the text "Disallowed CORS origin"); ``refused`` (when given) is called for each one.

    A browser shows neither to the page's script; curl and other tools that debug a CORS setup do."""

    def __init__(self, app: ASGIApp, refused: Callable[[], None] | None = None, **options: Any):
        super().__init__(app, **options)
        self.refused = refused

    def preflight_response(self, request_headers: Headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code < 400:
            return response
        if self.refused is not None:
            self.refused()
        error = APIError(400, f"this server refuses the CORS preflight: {self._why(request_headers)}",
                         code="cors_refused")
        headers = {name: value for name, value in response.headers.items()
                   if name not in ("content-length", "content-type")}
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    def _why(self, request_headers: Headers) -> str:
        origin = request_headers["origin"]
        method = request_headers["access-control-request-method"]
        reasons = []
        if not self.is_allowed_origin(origin):
            reasons.append(f"the origin {origin!r} is not one that --allowed-origin names")
        if method not in self.allow_methods:
            reasons.append(f"the method {method!r} is not one a page of an allowed origin may send "
                           f"({', '.join(self.allow_methods)})")
        if "access-control-request-private-network" in request_headers:
            reasons.append("a page on a public network may not call a server on a private one")
        return "; ".join(reasons) or "it asks for headers this server does not allow"
