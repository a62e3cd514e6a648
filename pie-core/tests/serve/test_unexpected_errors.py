"""A fault of the server's own while answering: one 500 with OpenAI's error JSON, one log record, no re-raise."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from starlette.testclient import TestClient

import pie.serve.app as app_module
import pie.serve.inferlets as inferlets_module
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings, UnexpectedErrors
from pie.testing.serve_process import in_process


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
    assert logged == ["internal error on GET '/fails'", "internal error on GET '/fails-late'"]
    assert answered == [500]


def test_a_path_s_newline_cannot_forge_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    async def fails(scope: dict, receive: object, send: object) -> None:
        raise RuntimeError("the server's own bug")

    client = TestClient(UnexpectedErrors(fails), raise_server_exceptions=False)  # (no lifespan: not entered)
    with caplog.at_level(logging.ERROR, logger="pie.serve"):
        assert client.get("/x%0AERROR forged").status_code == 500
    logged = [r.getMessage() for r in caplog.records if r.name == "pie.serve"]
    assert logged == ["internal error on GET '/x\\nERROR forged'"]


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


def test_a_fault_in_a_stream_begun_ends_it_with_an_error_event(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    """A fault of ours in a completion's stream, or a run's, once its first event was sent cut the connection: the
    client saw a broken read, and the error was counted nowhere."""
    made = {"chunks": 0}
    chunk_body = app_module.chunk_body
    sse = inferlets_module._sse

    def failing_third_chunk(*args: Any) -> dict[str, Any]:
        made["chunks"] += 1
        if made["chunks"] == 3:
            raise RuntimeError("a fault of the server's own")
        return chunk_body(*args)

    def failing_result(body: dict[str, Any]) -> bytes:
        if body.get("type") == "result":
            raise RuntimeError("a fault of the server's own")
        return sse(body)

    monkeypatch.setattr(app_module, "chunk_body", failing_third_chunk)
    monkeypatch.setattr(inferlets_module, "_sse", failing_result)
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    state = ServerState(ServeSettings(served_model_name="tiny", allow_uploads=True), llm)
    source = "async def main(ctx, args):\n    ctx.emit('begun')\n    return 'done'\n"
    with in_process(state) as url, caplog.at_level(logging.ERROR, logger="pie.serve"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        received: list[object] = []
        with pytest.raises(openai.APIError, match="internal error: RuntimeError: a fault of the server's own") as ended:
            for chunk in client.completions.create(model="tiny", prompt=[5, 8, 9], max_tokens=200, logprobs=0,
                                                   stream=True, extra_body={"ignore_eos": True}):
                received.append(chunk)
        assert len(received) == 2, "what was sent before the fault"
        assert isinstance(ended.value.body, dict) and ended.value.body["status"] == 500, "the status its head could not"
        with pytest.raises(openai.APIError, match="internal error: RuntimeError: a fault of the server's own") as ended:
            for event in client.post("/inferlets/runs", body={"source": source}, cast_to=object, stream=True,
                                     stream_cls=openai.Stream[object]):
                received.append(event)
        assert received[-1] == {"type": "emit", "value": "begun"}
        assert isinstance(ended.value.body, dict) and ended.value.body["status"] == 500
    assert state.metrics.registry.get_sample_value("pie:request_errors_total", {"status": "500"}) == 2
    assert state.metrics.registry.get_sample_value("pie:requests_cancelled_total") == 0, "an error, not a cancel"
    logged = [r.getMessage() for r in caplog.records if r.name == "pie.serve"]
    assert len(logged) == 2 and all(line.startswith("internal error in ") for line in logged), logged


def test_a_fault_while_a_whole_response_is_collected_is_a_500_not_also_a_cancel(
        tiny_model: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The generation that a fault of ours stopped was counted in pie:requests_cancelled as well as a 500."""

    class FailingChoice(app_module.ChoiceState):
        def add(self, delta: Any) -> None:
            if self.tokens:
                raise RuntimeError("a fault of the server's own")
            super().add(delta)

    monkeypatch.setattr(app_module, "ChoiceState", FailingChoice)
    state = ServerState(ServeSettings(served_model_name="tiny"), LLM.load(str(tiny_model), "cpu",
                                                                          max_cached_tokens=2048))
    with in_process(state) as url, caplog.at_level(logging.ERROR, logger="pie.serve"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="internal error: RuntimeError: a fault"):
            client.completions.create(model="tiny", prompt=[5, 8, 9], max_tokens=200, extra_body={"ignore_eos": True})
    assert state.metrics.registry.get_sample_value("pie:request_errors_total", {"status": "500"}) == 1
    assert state.metrics.registry.get_sample_value("pie:requests_cancelled_total") == 0, "an error, not a cancel"
