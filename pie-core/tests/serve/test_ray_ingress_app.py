"""The ingress's own answers, before anything reaches a replica: the probes' key, the body limit, and a 503
when no replica can take a request; and what it passes on to a replica.

The ingress is served on a loopback port in front of one replica whose actor is dead (every call to it
fails as Ray's calls to a dead actor do), so no Ray cluster is needed for what it answers itself; and in
front of a stand-in replica that answers with the headers it was sent."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from collections.abc import Iterator

import httpx
import openai
import pytest

pytest.importorskip("ray", reason="pie serve --ray needs the ray extra")
pytest.importorskip("fastapi", reason="pie serve needs the serve extra")

import uvicorn  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, RedirectResponse, Response  # noqa: E402
from starlette.routing import Route  # noqa: E402

from pie.serve.app import ServeSettings  # noqa: E402
from pie.serve.ray import Ingress, create_ingress_app  # noqa: E402
from pie.serve.server import listen  # noqa: E402

KEY = "s3cret-key"
LIMIT = 2048


class DeadActor:
    """A replica's actor handle whose every ``info.remote()`` call fails."""

    class info:  # noqa: N801 - named as the actor's method is
        @staticmethod
        def remote() -> DeadActor:
            return DeadActor()

    def future(self) -> Future[None]:
        failed: Future[None] = Future()
        failed.set_exception(RuntimeError("The actor died unexpectedly before finishing this task."))
        return failed


class EchoActor:
    """A replica's actor handle: always ready, at ``url``, with no tokenizer (so requests route by load)."""

    def __init__(self, url: str):
        info = {"url": url, "pid": 1, "node": "here", "phase": "ready", "error": None, "page_size": 16}
        self.info = _Answer(info)
        self.tokenizer_json = _Answer(None)


class _Answer:
    def __init__(self, value: object):
        self.value = value

    def remote(self) -> _Answer:
        return self

    def future(self) -> Future[object]:
        done: Future[object] = Future()
        done.set_result(self.value)
        return done


def echo_replica(request: Request) -> Response:
    """What a replica was sent, with a cookie set; a redirect for /v1/models."""
    if request.url.path == "/v1/models":
        return RedirectResponse("/elsewhere", status_code=307)
    seen = {name: request.headers.get(name) for name in ("content-type", "cookie", "accept-encoding")}
    answer = JSONResponse(seen)
    answer.set_cookie("session", "from-the-replica")
    return answer


def serve(app: object) -> Iterator[str]:
    """``app`` on a loopback port, on a thread, until the generator is closed."""
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    sock = listen("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(30)
    sock.close()


@pytest.fixture(scope="module")
def ingress_url() -> Iterator[str]:
    settings = ServeSettings(model="unused", api_key=KEY, open_probes=False, max_body_bytes=LIMIT)
    yield from serve(create_ingress_app(Ingress(settings, [DeadActor()])))


@pytest.fixture(scope="module")
def echo_ingress_url() -> Iterator[str]:
    replica = Starlette(routes=[Route("/v1/completions", echo_replica, methods=["POST"]),
                                Route("/v1/models", echo_replica)])
    for replica_url in serve(replica):
        yield from serve(create_ingress_app(Ingress(ServeSettings(model="unused"), [EchoActor(replica_url)])))


def test_the_probes_need_the_key(ingress_url: str) -> None:
    for path in ("/health", "/metrics"):
        missing = httpx.get(ingress_url + path, timeout=10)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == "missing_api_key"
        wrong = httpx.get(ingress_url + path, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    key = {"Authorization": f"Bearer {KEY}"}
    metrics = httpx.get(ingress_url + "/metrics", headers=key, timeout=10)
    assert metrics.status_code == 200 and "pie:ingress_requests" in metrics.text
    health = httpx.get(ingress_url + "/health", headers=key, timeout=10)
    assert health.status_code == 503 and health.json()["replicas"] == {"wanted": 1, "ready": 0}
    assert "actor died" in health.json()["detail"][0]["error"]


def test_no_replica_to_take_a_request_is_a_503(ingress_url: str) -> None:
    client = openai.OpenAI(base_url=f"{ingress_url}/v1", api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="Hello", max_tokens=1)
    assert caught.value.status_code == 503


def test_a_body_over_the_limit_is_413_before_any_replica_is_asked(ingress_url: str) -> None:
    client = openai.OpenAI(base_url=f"{ingress_url}/v1", api_key=KEY, max_retries=0, timeout=10)
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model="tiny", prompt="word " * LIMIT, max_tokens=1)
    assert caught.value.status_code == 413 and f"limit of {LIMIT} bytes" in caught.value.message
    chunked = httpx.post(f"{ingress_url}/v1/completions", content=iter([b"{" + b" " * LIMIT, b"}"]), timeout=10,
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert chunked.status_code == 413 and chunked.json()["error"]["code"] == "request_too_large"


def test_a_replica_gets_the_clients_headers_and_no_others(echo_ingress_url: str) -> None:
    with httpx.Client(base_url=echo_ingress_url, timeout=10) as client:
        first = client.post("/v1/completions", content=b'{"prompt": "hi"}')
        assert first.status_code == 200 and first.headers["x-pie-replica"] == "0", first.text
        assert first.json() == {"content-type": None, "cookie": None, "accept-encoding": None}
        typed = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert typed.json()["content-type"] == "application/json"
        # The ingress keeps no cookie a replica set: the next client's request carries none.
        again = httpx.post(f"{echo_ingress_url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert again.json()["cookie"] is None


def test_a_replicas_redirect_is_passed_on_not_followed(echo_ingress_url: str) -> None:
    answer = httpx.get(f"{echo_ingress_url}/v1/models", timeout=10)
    assert answer.status_code == 307, answer.text
