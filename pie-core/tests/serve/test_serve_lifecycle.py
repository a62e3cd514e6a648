"""The server's life: keys, capacity, failures inside a batch, loading, and the drain on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from pie.plugins import DeviceLost
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.server import ONE_DELIVERY_S, DrainingServer, _attach
from pie.testing.serve_process import LISTENING, PIE, ServeProcess, in_process, wait_until

CHAT = [{"role": "user", "content": "Tell me about the fox."}]


def test_the_api_key_guards_the_api_but_not_the_probes(tiny_model: Path, tmp_path: Path) -> None:
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", env={"PIE_API_KEY": "s3cret"}) as server:
        server.wait_ready()
        missing = httpx.get(f"{server.url}/v1/models", timeout=10)
        assert missing.status_code == 401 and "Authorization: Bearer" in missing.json()["error"]["message"]
        with pytest.raises(openai.AuthenticationError, match="incorrect API key"):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2,
                                          extra_body={"ignore_eos": True}).usage.completion_tokens == 2
        assert httpx.get(f"{server.url}/metrics", timeout=10).status_code == 200
        assert server.stop() == 0
    key_file = tmp_path / "key"
    key_file.write_text("from-a-file\n")
    with ServeProcess("--model", str(tiny_model), "--api-key-file", str(key_file), "--protect-probes") as server:
        assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10,
                                            headers={"Authorization": "Bearer from-a-file"}).status_code == 200)
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 401
        assert server.stop() == 0


def test_pages_of_an_allowed_origin_may_call_the_api_from_a_browser_and_others_may_not(tiny_model: Path) -> None:
    """Without CORS a browser's preflight got a 405, and a web app on another origin could not call the server."""
    app = "http://localhost:3000"
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", "--allowed-origin", app,
                      env={"PIE_API_KEY": "s3cret"}) as server:
        server.wait_ready()
        asked = {"Access-Control-Request-Method": "POST",  # and the headers OpenAI's JS client adds
                 "Access-Control-Request-Headers": "authorization,content-type,x-stainless-os,x-stainless-lang"}
        preflight = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": app, **asked}, timeout=10)
        assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == app
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        other = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": "http://evil.test", **asked},
                              timeout=10)
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=30, headers={
            "Origin": app, "Authorization": "Bearer s3cret"}, json={"model": "tiny", "messages": CHAT, "max_tokens": 2})
        assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == app
        assert "x-request-id" in answer.headers["access-control-expose-headers"].lower()
        keyless = httpx.post(f"{server.url}/v1/chat/completions", headers={"Origin": app}, json={}, timeout=10)
        assert keyless.status_code == 401, "CORS lets the page ask; the key still decides"
        assert server.stop() == 0
    with ServeProcess("--model", str(tiny_model)) as server:
        server.wait_ready()
        closed = httpx.options(f"{server.url}/v1/chat/completions", headers={"Origin": app, **asked}, timeout=10)
        assert closed.status_code == 405 and "access-control-allow-origin" not in closed.headers
        assert server.stop() == 0


def test_requests_preempted_for_kv_pages_swap_to_host_memory_and_answer_as_alone(tiny_model: Path) -> None:
    """Four 60-token requests share a 64-token KV pool, which holds one of them: they preempt each other,
    their pages go to the host pool --host-kv-tokens sized, and each answer is the one it gets alone. (The host pool's
    gauge while pages wait there: test_serve_metrics.py; polling it from here missed a short wait.)"""
    prompts = [[5 + i, 9, 11, 13] for i in range(4)]
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--kv-tokens", "64",
            "--host-kv-tokens", "1024", "--no-prefix-cache")
    with ServeProcess(*args) as server:
        server.wait_ready()

        async def complete(client: openai.AsyncOpenAI, prompt: list[int]) -> str:
            reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0,
                                                    extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == 60
            return reply.choices[0].text

        async def run() -> tuple[list[str], list[str]]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                          timeout=120) as client:
                alone = [await complete(client, prompt) for prompt in prompts]
                together = await asyncio.wait_for(
                    asyncio.gather(*(complete(client, prompt) for prompt in prompts)), 120)
            return alone, list(together)

        alone, together = asyncio.run(run())
        metrics = server.metrics()
        assert together == alone
        assert metrics["pie:preemptions_total"] > 0
        assert metrics["pie:preemption_recomputes_total"] == 0, "the host pool had room for every preempted request"
        assert metrics["pie:kv_swap_failures_total"] == 0
        assert metrics["pie:kv_pages_swapped_out_total"] == metrics["pie:kv_pages_swapped_in_total"] > 0
        assert metrics["pie:kv_host_pages_used"] == 0 and metrics["pie:kv_host_pages_capacity"] == 1024 // 16
        assert server.stop() == 0


def test_listening_beyond_loopback_without_a_key_warns(tiny_model: Path) -> None:
    with ServeProcess("--model", str(tiny_model), "--host", "0.0.0.0") as server:
        assert "warning: listening on 0.0.0.0 without an API key" in server.log
        assert server.stop() == 0


def test_the_access_log_has_a_line_per_request_and_is_off_by_default(tiny_model: Path) -> None:
    for flags, logged in (((), False), (("--access-log",), True)):
        with ServeProcess("--model", str(tiny_model), *flags) as server:
            server.wait_ready()
            assert httpx.get(f"{server.url}/v1/models", timeout=10).status_code == 200
            assert httpx.get(f"{server.url}/no-such-page", timeout=10).status_code == 404
            assert server.stop() == 0
            lines = [line for line in server.lines if '"GET /' in line]
            if logged:
                assert any('"GET /v1/models HTTP/1.1" 200' in line for line in lines), server.log
                assert any('"GET /no-such-page HTTP/1.1" 404' in line for line in lines), server.log
            else:
                assert not lines, server.log


@pytest.mark.parametrize(
    "args,status,message",  # 2: the command line is wrong; 1: it failed working
    [
        (["--model", "/nonexistent/model.gguf"], 1, "/nonexistent/model.gguf"),
        (["--kv-tokens", "0"], 2, "--kv-tokens must be at least 1"),
        (["--max-running", "0"], 2, "--max-running must be at least 1"),
        (["--runs-per-worker", "0"], 2, "--runs-per-worker must be at least 1"),
        (["--host-kv-tokens", "-1"], 2, "--host-kv-tokens must be at least 0"),
        (["--ray", "nonsense"], 2, "--ray nonsense: expected auto, local or a cluster's HOST:PORT"),
        (["--ray", "127.0.0.1:1"], 1, "--ray 127.0.0.1:1: no Ray cluster answers there (Connection refused)"),
        (["--host", "999.1.1.1"], 1, "cannot listen on 999.1.1.1:0"),
        (["--host", ""], 2, "--host is empty: give an address"),  # it listened on every address, and said so nowhere
        (["--allowed-origin", "example.com"], 2, "--allowed-origin 'example.com' is no origin"),
        (["--allowed-origin", "http://example.com/app"], 2, "is no origin"),
        (["--allowed-origin", "*"], 2, "--allowed-origin '*' needs an API key"),
    ],
)
def test_a_server_that_cannot_start_says_why(args: list[str], status: int, message: str) -> None:
    result = subprocess.run([PIE, "serve", "--port", "0", *args], capture_output=True, text=True, timeout=120)
    assert result.returncode == status and message in result.stderr, result
    assert "Traceback" not in result.stderr
    assert "without an API key" not in result.stderr, "no warning about a port it never listened on"


@pytest.mark.parametrize("flag,says", [
    ("--kv-tokens", "cannot serve: not enough memory for a KV cache of 1000000000000000 tokens: it needs"),
    ("--host-kv-tokens", "cannot serve: not enough memory for the KV cache or its host pool"),
])
def test_a_kv_cache_beyond_memory_fails_the_start_in_words(tiny_model: Path, flag: str, says: str) -> None:
    with ServeProcess("--model", str(tiny_model), flag, str(10**15)) as server:
        assert server.process.wait(timeout=120) == 1
        assert wait_until(lambda: "cannot serve:" in server.log), server.log
        assert says in server.log, server.log
        assert "Traceback" not in server.log


@pytest.mark.parametrize("library", ["uvicorn", "httptools"])
def test_without_the_serve_extra_it_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch, library: str) -> None:
    import importlib.util

    from pie.cli import app
    from typer.testing import CliRunner

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == library else real(name, *a))
    result = CliRunner().invoke(app, ["serve", "--port", "-1"])  # refused next: nothing starts were the check missed
    assert result.exit_code == 1 and "pip install 'pie-core[serve]'" in result.output and library in result.output


def test_with_an_aiohttp_older_than_the_ingress_needs_it_says_how_to_get_the_ray_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib.metadata

    from pie.cli import app
    from typer.testing import CliRunner

    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "3.11.18" if name == "aiohttp" else real(name))
    # --replicas 0 is refused right after this check, so nothing starts were the check missed
    result = CliRunner().invoke(app, ["serve", "--ray", "local", "--replicas", "0"])
    assert result.exit_code == 1, result.output
    assert "pip install 'pie-core[ray]'" in result.output and "aiohttp 3.11.18 is older than 3.12" in result.output
    assert "Traceback" not in result.output


def test_two_hundred_clients_against_a_queue_of_fifty_all_get_an_answer(tiny_model: Path) -> None:
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--max-running", "8", "--max-waiting", "42")
    with ServeProcess(*args) as server:
        server.wait_ready()

        async def one(client: openai.AsyncOpenAI, i: int) -> str:
            prompt = f"Request number {i} asks"
            try:
                if i % 2:
                    stream = await client.completions.create(
                        model="tiny", prompt=prompt, max_tokens=16, temperature=0, stream=True,
                        stream_options={"include_usage": True})
                    chunks = [chunk async for chunk in stream]
                    tokens = chunks[-1].usage.completion_tokens
                    reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
                else:
                    reply = await client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
                    tokens, reason = reply.usage.completion_tokens, reply.choices[0].finish_reason
                # A choice that stops counts the end token it sampled: 16 of them is a stop too.
                assert (reason, tokens) == ("length", 16) or (reason == "stop" and tokens <= 16), (reason, tokens)
                return "ok"
            except openai.APIStatusError as exc:
                assert exc.status_code == 503 and exc.response.headers["retry-after"] == "1", exc
                assert "at capacity" in exc.message
                return "busy"

        async def everyone() -> list[str]:
            async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                          timeout=120) as client:
                return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(200))), timeout=300)

        outcomes = asyncio.run(everyone())
        assert len(outcomes) == 200 and outcomes.count("busy") > 0 and outcomes.count("ok") >= 50
        assert wait_until(lambda: server.metrics()["pie:kv_pages_used"] == 0)
        assert server.metrics()["pie:request_errors_total{status=503}"] == outcomes.count("busy")
        assert server.stop() == 0


def test_a_batch_of_prompts_counts_each_prompt_against_the_queue(tiny_model: Path) -> None:
    """A completions batch is one engine request a prompt: 20,000 prompts once went past --max-waiting 8."""
    args = ("--model", str(tiny_model), "--served-model-name", "tiny", "--max-running", "1", "--max-waiting", "2")
    with ServeProcess(*args) as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="tiny", prompt=[[5, 6]] * 4, max_tokens=2)
        assert caught.value.body["param"] == "prompt", caught.value.body
        assert "a batch of 4 prompts is more than the server holds at once (3: --max-running and --max-waiting " \
               "together)" in caught.value.message
        reply = client.completions.create(model="tiny", prompt=[[5, 6]] * 3, max_tokens=2)
        assert [choice.index for choice in reply.choices] == [0, 1, 2]
        status = httpx.get(f"{server.url}/v1/pie/status", timeout=10).json()
        assert status["requests"]["running"] == status["requests"]["waiting"] == 0
        assert server.stop() == 0


def test_a_kv_cache_smaller_than_the_context_bounds_requests_without_max_tokens(tiny_model: Path) -> None:
    """Every request without max_tokens was refused: its default, the rest of the context, could never fit."""
    with ServeProcess("--model", str(tiny_model), "--served-model-name", "tiny", "--kv-tokens", "64") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        pages = httpx.get(f"{server.url}/v1/pie/status", timeout=10).json()["kv_pages"]
        room = pages["total"] * pages["page_tokens"] + 1  # the last token is sampled, never stored
        assert room < 256, "the tiny model's context is 256 tokens"
        assert [model.model_extra["max_model_len"] for model in client.models.list().data] == [room]
        reply = client.chat.completions.create(model="tiny", messages=CHAT, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens <= room
        with pytest.raises(openai.BadRequestError, match=f"fills the KV cache's {room} tokens") as refused:
            client.completions.create(model="tiny", prompt=[7] * room)
        assert refused.value.code == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="tiny", prompt=[7] * 10, max_tokens=room)
        assert refused.value.code == "context_length_exceeded" and refused.value.param == "max_tokens"
        assert refused.value.body["message"].startswith(
            f"This model's maximum context length is {room} tokens. However, you requested {10 + room} tokens "
            f"(10 in the prompt, {room} in the completion). The prompt (10 tokens) plus max_tokens ({room}) is "
            f"{10 + room} tokens, more than the whole KV cache"), refused.value.body
        assert server.stop() == 0


def test_sigterm_drains_the_requests_in_flight_then_exits_zero(long_model: Path) -> None:
    with ServeProcess("--model", str(long_model), "--served-model-name", "long", "--drain-seconds", "120") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model="long", prompt="Drain me", max_tokens=6000, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream)]
        server.process.send_signal(15)
        assert wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503)
        assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "draining"
        with pytest.raises(openai.InternalServerError, match="shutting down") as refused:
            client.completions.create(model="long", prompt="too late", max_tokens=2)
        assert refused.value.code == "shutting_down", refused.value.body
        chunks += list(stream)
        assert chunks[-1].usage.completion_tokens == 6000, "the request in flight ran to its end"
        assert server.process.wait(60) == 0


def test_a_drain_deadline_ends_what_is_unfinished_with_an_error(long_model: Path) -> None:
    with ServeProcess("--model", str(long_model), "--served-model-name", "long", "--drain-seconds", "0.5") as server:
        server.wait_ready()
        streamed = {"model": "long", "prompt": "Cut me", "max_tokens": 6000, "temperature": 0, "stream": True,
                    "ignore_eos": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=streamed, timeout=120) as stream:
            events = (line for line in stream.iter_lines() if line.startswith("data: "))
            next(events)
            whole: list[httpx.Response] = []  # a request answered whole, in flight beside the stream
            asking = threading.Thread(target=lambda: whole.append(httpx.post(
                f"{server.url}/v1/completions", timeout=120,
                json={"model": "long", "prompt": "Cut me too", "max_tokens": 6000, "ignore_eos": True})))
            asking.start()
            assert wait_until(lambda: httpx.get(f"{server.url}/v1/pie/status",
                                                timeout=10).json()["requests"]["running"] == 2)
            server.process.send_signal(15)
            *_, error, last = events
        error_body = json.loads(error.removeprefix("data: "))["error"]
        assert "shut down before this request finished (drain of 0.5 s)" in error_body["message"]
        assert error_body["code"] == "shutting_down"
        assert last == "data: [DONE]", "the stream ends as every stream does, after its error (as vLLM's)"
        asking.join(60)
        assert whole[0].status_code == 503 and whole[0].headers["retry-after"] == "5", whole
        assert whole[0].json()["error"]["code"] == "shutting_down"
        assert re.fullmatch(r"cmpl-[0-9a-f]{32}", whole[0].headers["x-request-id"]), "named by its completion's id"
        assert server.process.wait(60) == 0


def test_a_second_signal_ends_what_is_in_flight_at_once_and_exits_by_it(long_model: Path) -> None:
    """It once cancelled the server's tasks mid-write: tracebacks in the log, streams cut with no error event, and
    exit status 0, so nothing told a supervisor that requests were lost."""
    with ServeProcess("--model", str(long_model), "--served-model-name", "long", "--drain-seconds", "120") as server:
        server.wait_ready()
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        stream = client.completions.create(model="long", prompt="Quit on me", max_tokens=6000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        next(stream)
        server.process.send_signal(2)
        assert wait_until(lambda: "draining" in server.log)
        time.sleep(ONE_DELIVERY_S)  # a person's second Ctrl-C, not the same one delivered twice
        server.process.send_signal(2)
        with pytest.raises(openai.APIError, match="^the server was stopped before this request finished$"):
            for _ in stream:  # it said "drain of 0 s", though the drain given was 120 s
                pass
        assert server.process.wait(60) == 128 + 2
        assert "quitting now" in server.log and "Traceback" not in server.log, server.log


def test_sigterm_drains_when_stderr_is_a_closed_pipe(tiny_model: Path) -> None:
    """`pie serve 2>&1 | head -c 10`: telling of the drain raised BrokenPipeError before the drain was started, so the
    first two SIGTERMs were lost and only a third (or SIGKILL) stopped the server."""
    process = subprocess.Popen(
        [PIE, "serve", "--host", "127.0.0.1", "--port", "0", "--model", str(tiny_model)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PIE_ENGINES": "cpu"},
    )
    try:
        assert process.stderr is not None
        url = ""
        for _ in range(50):  # the few lines before it listens
            found = LISTENING.search(process.stderr.readline())
            if found:
                url = found.group(1)
                break
        assert url, "pie serve did not say where it listens"
        process.stderr.close()  # what `| head -c 10` does once it has its bytes
        assert wait_until(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, timeout=90)
        process.send_signal(signal.SIGTERM)
        assert process.wait(30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


class _Drains:
    """A Drainable that notes each drain it is asked for."""

    def __init__(self) -> None:
        self.settings = ServeSettings(drain_seconds=30.0)
        self.in_flight = 1
        self.drains: list[float] = []

    async def drain(self, seconds: float) -> None:
        self.drains.append(seconds)


def test_the_same_signal_twice_at_once_is_one_request_to_stop() -> None:
    """GNU `timeout` sends SIGTERM to the server and then to its process group: two at once. The second was taken for
    the operator's "quit now", and cut the requests the first had begun to drain."""
    drains = _Drains()
    server = DrainingServer(uvicorn.Config(create_app(ServerState(drains.settings))), drains)
    loop = asyncio.new_event_loop()
    server._loop = loop
    try:
        server.handle_exit(signal.SIGTERM, None)
        server.handle_exit(signal.SIGTERM, None)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert drains.drains == [30.0] and server.exit_code == 0
        server.handle_exit(signal.SIGINT, None)  # another signal is the operator's second word at once
        loop.run_until_complete(asyncio.sleep(0.01))
        assert drains.drains == [30.0, 0] and server.exit_code == 128 + signal.SIGINT
    finally:
        loop.close()


def test_a_stream_whose_client_left_before_its_headers_is_counted_out(
    tiny_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Under ASGI 2.4 a server's send of the response's start raises for a client already gone, and the stream's
    body is then never iterated: its release, inside the body's generator, never ran, so the request stayed in
    flight (draining waited for it, admission counted it) and its generation ran on for no one."""
    body = json.dumps({"model": "tiny", "prompt": "gone", "max_tokens": 200, "stream": True,
                       "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "root_path": "", "query_string": b"", "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}

    async def main() -> tuple[int, int, int]:
        state = ServerState(ServeSettings(served_model_name="tiny"))
        state.attach(LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048), asyncio.get_running_loop())
        app = create_app(state)
        sent = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            if sent:
                return sent.pop()
            await asyncio.Event().wait()  # no disconnect is ever told: the failed send is all there is
            raise AssertionError

        async def send(message: dict[str, object]) -> None:
            if message["type"] == "http.response.start":
                raise OSError("the client is gone")

        try:
            await app(scope, receive, send)
        except Exception:  # noqa: BLE001 - how it ends for the server is not what this test is about
            pass
        assert state.engine is not None
        deadline = time.monotonic() + 30
        while state.engine.running_count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        try:
            return state.in_flight, len(state.active), state.engine.running_count
        finally:
            state.close()

    assert asyncio.run(main()) == (0, 0, 0)
    assert "internal error" not in caplog.text, "a client gone is not a fault of the server's"


def test_while_loading_health_and_requests_answer_503() -> None:
    with in_process(ServerState(ServeSettings(served_model_name="later"))) as url:
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "loading"
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError, match="the model is loading") as caught:
            client.chat.completions.create(model="later", messages=CHAT)
        assert caught.value.status_code == 503 and caught.value.response.headers["retry-after"] == "5"


def _first_reading(program: list, slot: int) -> tuple[int, tuple]:
    """The index of a pass program's first entry that reads ``slot``, and the entry (launcher, inputs, output, name)."""
    return next((i, entry) for i, entry in enumerate(program) if slot in entry[1])


def test_a_kernel_short_of_memory_is_a_503_to_retry_and_the_server_goes_on(tiny_model: Path) -> None:
    """Out of device memory was a 500 kernel_failed: to the Ray ingress, a failing replica."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    plan = llm.runner.plan
    program = list(plan._program)
    index, (launcher, inputs, output, name) = _first_reading(program, plan.slots["in.ids"])
    short = {"of_memory": True}

    def short_of_memory(*args: object) -> object:
        if short["of_memory"]:
            raise MemoryError("out of device memory for a buffer of 1073741824 bytes")
        return launcher(*args)

    program[index] = (short_of_memory, inputs, output, name)
    plan._program = tuple(program)
    with in_process(ServerState(ServeSettings(served_model_name="tiny"), llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        for stream in (False, True):
            with pytest.raises(openai.APIStatusError, match="out of memory for this request") as refused:
                reply = client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4, stream=stream)
                list(reply) if stream else None
            assert refused.value.status_code == 503 and refused.value.body["code"] == "out_of_memory"
            assert refused.value.response.headers["retry-after"] == "1"
        assert httpx.get(f"{url}/health", timeout=10).json()["status"] == "ready"
        short["of_memory"] = False
        assert client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4


def test_a_kernel_failure_fails_the_requests_of_its_batch_and_the_server_goes_on(tiny_model: Path) -> None:
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    plan = llm.runner.plan
    ids_slot, positions_slot = plan.slots["in.ids"], plan.slots["in.positions"]
    program = list(plan._program)
    index, (launcher, inputs, output, name) = _first_reading(program, ids_slot)
    poison = {"token": 7, "from_position": 10_000}
    at, positions_entry = _first_reading(program, positions_slot)
    positions_launcher, positions_inputs, positions_output, positions_name = positions_entry

    def failing_on_a_token(*args: object) -> object:
        if poison["token"] in np.asarray(args[inputs.index(ids_slot)]):
            raise RuntimeError("the device fell over")
        return launcher(*args)

    def failing_past_a_position(*args: object) -> object:
        if np.asarray(args[positions_inputs.index(positions_slot)]).max() >= poison["from_position"]:
            raise RuntimeError("the device fell over")
        return positions_launcher(*args)

    program[index] = (failing_on_a_token, inputs, output, name)
    program[at] = (failing_past_a_position, positions_inputs, positions_output, positions_name)
    plan._program = tuple(program)
    with in_process(ServerState(ServeSettings(served_model_name="tiny"), llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match=f"kernel {name} failed: RuntimeError: the device") as bad:
            client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4)
        assert bad.value.status_code == 500 and bad.value.body["code"] == "kernel_failed"
        with pytest.raises(openai.InternalServerError, match="kernel"):
            client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4, stream=True)
        assert client.completions.create(model="tiny", prompt=[5, 8, 9], max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        poison.update(token=-1, from_position=20)
        stream = client.completions.create(model="tiny", prompt=[5, 8, 9], max_tokens=40, temperature=0, stream=True)
        received = []
        with pytest.raises(openai.APIError, match=f"kernel {positions_name} failed"):
            for chunk in stream:
                received.append(chunk)
        assert received, "tokens went out before the failure, which then ended the stream"
        poison.update(from_position=10_000)
        assert client.completions.create(model="tiny", prompt=[5, 8, 9], max_tokens=4,
                                        extra_body={"ignore_eos": True}).usage.completion_tokens == 4
        assert llm.runner.pages.used_count == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_batch_that_one_prompts_failure_ends_is_an_error_not_also_a_cancel(tiny_model: Path, stream: bool) -> None:
    """The prompts of a batch that a failure of one ended, stopped by the server, were counted in
    pie:requests_cancelled ("their client left") too: an operator saw cancels no client made."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    plan = llm.runner.plan
    ids_slot = plan.slots["in.ids"]
    program = list(plan._program)
    index, (launcher, inputs, output, name) = _first_reading(program, ids_slot)

    def failing_on_a_token(*args: object) -> object:
        if 7 in np.asarray(args[inputs.index(ids_slot)]):
            raise RuntimeError("the device fell over")
        return launcher(*args)

    program[index] = (failing_on_a_token, inputs, output, name)
    plan._program = tuple(program)
    state = ServerState(ServeSettings(served_model_name="tiny", max_running=1), llm)  # the second waits its turn
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.APIError, match=f"kernel {name} failed"):
            reply = client.completions.create(model="tiny", prompt=[[5, 7, 9], [5, 8, 9]], max_tokens=200,
                                              stream=stream, extra_body={"ignore_eos": True})
            list(reply) if stream else None
        assert wait_until(lambda: state.in_flight == 0, timeout=30)
    sample = state.metrics.registry.get_sample_value
    assert sample("pie:request_errors_total", {"status": "500"}) == 1
    assert sample("pie:requests_cancelled_total") == 0


def test_a_device_lost_for_good_fails_the_server_and_every_later_request_at_once(tiny_model: Path) -> None:
    """A lost device (a browser page closed) once left the server "ready", answering every request 500: a load
    balancer, or the Ray ingress, kept sending it traffic."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    plan = llm.runner.plan
    program = list(plan._program)
    launcher, inputs, output, name = program[0]
    calls = {"after the loss": 0}

    def losing_the_device(*args: object) -> object:
        calls["after the loss"] += 1
        raise DeviceLost("the browser's page was closed")

    program[0] = (losing_the_device, inputs, output, name)
    plan._program = tuple(program)
    with in_process(ServerState(ServeSettings(served_model_name="tiny"), llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError, match="device was lost: kernel .* page was closed") as lost:
            client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4)
        assert lost.value.status_code == 503 and lost.value.body["code"] == "device_lost"
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the browser's page was closed" in health.json()["error"]
        assert calls["after the loss"] == 1
        with pytest.raises(openai.InternalServerError, match="device was lost") as later:
            client.completions.create(model="tiny", prompt=[5, 7, 9], max_tokens=4, stream=True)
        assert later.value.status_code == 503 and later.value.body["code"] == "device_lost"
        assert calls["after the loss"] == 1, "a later request is refused, not run"


RUN_FAILURES = {
    "kernel-failed": (RuntimeError("the device fell over"), 500, "kernel_failed"),
    "out-of-memory": (MemoryError("out of device memory for a buffer of 1073741824 bytes"), 503, "out_of_memory"),
    "device-lost": (DeviceLost("the browser's page was closed"), 503, "device_lost"),
}


@pytest.mark.parametrize("kind", RUN_FAILURES)
def test_an_engine_failure_ends_an_inferlet_run_as_it_ends_a_completion(tiny_model: Path, kind: str) -> None:
    """A pass of a served run whose kernel failed was never answered: the run hung until its wall-clock limit.
    And the server learnt of a lost device only from a completion's failure: one serving inferlet runs alone
    stayed "ready", each run failing. Then a run that a kernel's failure ended was a 500 inferlet_failed whatever
    the failure: short of memory too (a completion's is a 503 to retry), and a lost device too."""
    raised, status, code = RUN_FAILURES[kind]
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    program = list(llm.runner.plan._program)
    _, inputs, output, name = program[0]

    def failing(*args: object) -> object:
        raise raised

    program[0] = (failing, inputs, output, name)
    llm.runner.plan._program = tuple(program)
    source = "async def main(ctx, args):\n    return await ctx.context('hello').generate_tokens(2)\n"
    state = ServerState(ServeSettings(served_model_name="tiny", allow_uploads=True), llm)
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.APIError, match=f"kernel {name} failed: ") as failed:
            list(client.post("/inferlets/runs", body={"source": source}, cast_to=object, stream=True,
                             stream_cls=openai.Stream[object]))
        assert failed.value.code == code and failed.value.type == "server_error"
        assert "upload.py:2 in main" in failed.value.body["where"], "where in the inferlet it ended"
        errors = state.metrics.registry.get_sample_value
        assert errors("pie:request_errors_total", {"status": str(status)}) == 1
        assert sum(errors("pie:request_errors_total", {"status": other}) or 0 for other in ("500", "503")) == 1
        health = httpx.get(f"{url}/health", timeout=10)
        if kind == "device-lost":
            assert health.status_code == 503 and health.json()["status"] == "failed"
            assert "the browser's page was closed" in health.json()["error"]
        else:
            assert health.json()["status"] == "ready"


CAUGHT = ("async def main(ctx, args):\n    try:\n        await ctx.context('hello').generate_tokens(2)\n"
          "    except Exception as exc:\n")
RUN_ENDINGS = {
    "swallowed": (CAUGHT + "        pass\n    raise ValueError('a bug of its own')\n", "inferlet_failed"),
    "quoted-later": (CAUGHT + "        said = str(exc)\n    raise ValueError(f'a bug of its own, not {said}')\n",
                     "inferlet_failed"),
    "quoted-from-none": (CAUGHT + "        raise ValueError(f'a bug of its own, not {exc}') from None\n",
                         "inferlet_failed"),
    "wrapped": (CAUGHT + "        raise RuntimeError('the generation failed') from exc\n", "kernel_failed"),
    "raised-while-handling": (CAUGHT + "        raise RuntimeError('the generation failed')\n", "kernel_failed"),
    "task-group": ("import asyncio\n\n\nasync def main(ctx, args):\n    async with asyncio.TaskGroup() as group:\n"
                   "        group.create_task(ctx.context('hello').generate_tokens(2))\n", "kernel_failed"),
}


@pytest.mark.parametrize("ending", RUN_ENDINGS)
def test_a_run_is_answered_as_an_engine_failure_where_it_ended_by_one(tiny_model: Path, ending: str) -> None:
    """A run is answered as the engine's failure where it ended by one: the exception a failed pass raised in the
    inferlet, raised from it or while handling it, or among a task group's; not where it caught it and failed later
    of its own. Its error's text decided: one that wrapped the failure in words of its own was inferlet_failed, and
    one that quoted the failure in its own error was the engine's."""
    if ending == "task-group" and not hasattr(asyncio, "TaskGroup"):
        pytest.skip("asyncio.TaskGroup is Python 3.11's")
    source, code = RUN_ENDINGS[ending]
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    program = list(llm.runner.plan._program)
    _, inputs, output, name = program[0]

    def failing(*args: object) -> object:
        raise RuntimeError("the device fell over")

    program[0] = (failing, inputs, output, name)
    llm.runner.plan._program = tuple(program)
    with in_process(ServerState(ServeSettings(served_model_name="tiny", allow_uploads=True), llm)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with pytest.raises(openai.APIError) as failed:
            list(client.post("/inferlets/runs", body={"source": source}, cast_to=object, stream=True,
                             stream_cls=openai.Stream[object]))
        assert failed.value.code == code, failed.value.body
        if code == "kernel_failed":
            assert re.fullmatch(f"kernel {re.escape(name)} failed: .*the device fell over", failed.value.message)
        else:
            assert "a bug of its own" in failed.value.message
        assert "upload.py:" in failed.value.body["where"]


def test_a_model_that_loads_after_a_shutdown_signal_is_not_served(capsys: pytest.CaptureFixture[str]) -> None:
    """A SIGTERM while the model loaded drained the (empty) server, and then the loaded model started an engine
    (and its inferlet workers) and printed "ready" on the way out."""
    state = ServerState(ServeSettings(served_model_name="late"))
    state.phase = "draining"
    loop = asyncio.new_event_loop()
    try:
        loaded = loop.create_future()
        loaded.set_result(object())  # never looked at: nothing of it is started
        _attach(state, None, loaded, loop, "http://127.0.0.1:1")  # type: ignore[arg-type]  # no server is failed
    finally:
        loop.close()
    assert state.engine is None and state.phase == "draining"
    assert "ready" not in capsys.readouterr().err
