"""A fault of the server's own while answering: one 500 with OpenAI's error JSON, one log record, no re-raise."""

from __future__ import annotations

import logging

import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.testclient import TestClient

from pie.serve.app import UnexpectedErrors


def test_a_fault_is_one_500_and_one_log_record(caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    answered: list[int] = []
    app.add_middleware(UnexpectedErrors, answered=lambda: answered.append(500))

    @app.get("/fails")
    async def fails() -> None:
        raise RuntimeError("the server's own bug")

    @app.get("/fails-late")
    async def fails_late() -> StreamingResponse:
        async def body():
            yield b"partial"
            raise RuntimeError("after the headers")

        return StreamingResponse(body())

    # Starlette's own handler for Exception would raise it again here (TestClient re-raises what reaches the server).
    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="pie.serve"):
        reply = client.get("/fails")
        assert reply.status_code == 500
        assert reply.json()["error"] == {"message": "internal error: RuntimeError: the server's own bug",
                                          "type": "server_error", "param": None, "code": None}
        late = client.get("/fails-late")
        assert late.status_code == 200 and late.content == b"partial", "a response begun cannot become a 500"
    # (pie.serve's records only: an earlier test's client, collected now, may log its own loop's end)
    logged = [r.getMessage() for r in caplog.records if r.name == "pie.serve"]
    assert logged == ["internal error on GET /fails", "internal error on GET /fails-late"]
    assert answered == [500]


class PanicException(BaseException):
    """What a Rust library (tokenizers, safetensors) raises through pyo3 when it panics: no Exception."""


def test_a_rust_librarys_panic_is_a_500_too(caplog: pytest.LogCaptureFixture) -> None:
    """It derives from BaseException: it went past the handler, and the client's connection was dropped."""
    app = FastAPI()
    app.add_middleware(UnexpectedErrors)

    @app.get("/panics")
    async def panics() -> None:
        raise PanicException("called `Option::unwrap()` on a `None` value")

    with TestClient(app) as client, caplog.at_level(logging.ERROR, logger="pie.serve"):
        reply = client.get("/panics")
    assert reply.status_code == 500 and "PanicException" in reply.json()["error"]["message"]
