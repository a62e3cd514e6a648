"""What the server's metrics count of a request's life, read from the state of a server run in this process."""

from __future__ import annotations

import json
import logging
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings
from pie.testing.serve_process import in_process, wait_until

TOKENIZING_S = 100.0


class StoppedClock:
    """A clock that moves only when told to."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_time_to_first_token_starts_when_the_request_arrives(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                             stream: bool) -> None:
    """The time to first token (and the latency) started once the prompt was tokenized and its grammar compiled:
    a client waits from its request's arrival."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    state = ServerState(ServeSettings(served_model_name="tiny"), llm)
    clock = state.metrics.clock = StoppedClock()
    encode = llm.tokenizer.encode_text

    def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        clock.now += TOKENIZING_S  # the clock moves only while the prompt is tokenized
        return encode(text, add_special_tokens)

    monkeypatch.setattr(llm.tokenizer, "encode_text", slow_encode)
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        reply = client.completions.create(model="tiny", prompt="Tell me about the fox.", max_tokens=3, stream=stream,
                                          extra_body={"ignore_eos": True})
        if stream:
            list(reply)
    sample = state.metrics.registry.get_sample_value
    assert sample("pie:time_to_first_token_seconds_count") == 1
    assert sample("pie:time_to_first_token_seconds_sum") == TOKENIZING_S
    assert sample("pie:e2e_request_latency_seconds_sum") == TOKENIZING_S
    assert sample("pie:time_per_output_token_seconds_sum") == 0.0


@pytest.mark.parametrize("sent", [b"", b'{"model": "tiny", "prompt": "Tell me'], ids=["no-body", "half-a-body"])
def test_a_client_that_leaves_before_its_body_is_read_is_counted_as_cancelled(
        tiny_model: Path, caplog: pytest.LogCaptureFixture, sent: bytes) -> None:
    """A client that sent a request's head and left before its body was read left no trace: no count, no line."""
    caplog.set_level(logging.DEBUG, logger="pie.serve")
    state = ServerState(ServeSettings(served_model_name="tiny"), LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048))
    with in_process(state) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pie\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 1000\r\n\r\n" + sent)
        cancelled = lambda: state.metrics.registry.get_sample_value("pie:requests_cancelled_total")  # noqa: E731
        assert wait_until(lambda: cancelled() == 1, timeout=10), "the request is counted as cancelled"
        assert state.in_flight == 0
    assert state.metrics.registry.get_sample_value("pie:request_errors_total", {"status": "400"}) is None, "not an error"
    left = [record for record in caplog.records if "closed before" in record.getMessage()]
    assert [record.levelno for record in left] == [logging.DEBUG], caplog.text
    assert "POST /v1/completions" in left[0].getMessage()
    assert "internal error" not in caplog.text


FOREVER = '''async def main(ctx, args):
    while True:
        context = ctx.context("Forever and ever")
        for _ in range(10):
            await context.step()
        context.drop()
        ctx.emit("round")
'''


def test_an_inferlet_run_cancelled_or_left_is_counted_as_cancelled_not_as_an_error(tiny_model: Path) -> None:
    """A run whose client left was counted nowhere, and one cancelled with DELETE was counted as an error (499)."""
    state = ServerState(ServeSettings(served_model_name="tiny", allow_uploads=True),
                        LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048))
    sample = state.metrics.registry.get_sample_value
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)

        def start() -> tuple[openai.Stream[Any], str]:
            stream = client.post("/inferlets/runs", body={"source": FOREVER}, cast_to=object, stream=True,
                                 stream_cls=openai.Stream[object])
            events = iter(stream)
            run = next(events)
            assert next(events) == {"type": "emit", "value": "round"}
            return stream, run["id"]

        stream, run_id = start()
        assert client.delete(f"/runs/{run_id}", cast_to=object)["cancelled"] is True
        with pytest.raises(openai.APIError, match="cancelled") as cancelled:
            list(stream)
        assert cancelled.value.code == "cancelled"
        assert wait_until(lambda: state.in_flight == 0, timeout=30)
        assert sample("pie:requests_cancelled_total") == 1
        stream, _ = start()
        stream.close()  # the client leaves
        assert wait_until(lambda: state.in_flight == 0, timeout=30)
        assert sample("pie:requests_cancelled_total") == 2
    assert sample("pie:request_errors_total", {"status": "499"}) is None


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_leaves_during_the_prompts_pass_is_counted_as_cancelled(tiny_model: Path, stream: bool) -> None:
    """Its prompt's pass is held running until the server has seen it leave: counted once, as a cancel, not an
    error, and its pages come back once the pass is over."""
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=2048)
    program = list(llm.runner.plan._program)
    launcher, inputs, output, name = program[0]
    running, go_on = threading.Event(), threading.Event()

    def held(*args: object) -> object:
        running.set()
        assert go_on.wait(30)
        return launcher(*args)

    program[0] = (held, inputs, output, name)
    llm.runner.plan._program = tuple(program)
    state = ServerState(ServeSettings(served_model_name="tiny"), llm)
    sample = state.metrics.registry.get_sample_value
    body = json.dumps({"model": "tiny", "prompt": [5, 7, 9], "max_tokens": 50, "stream": stream}).encode()
    with in_process(state) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as connection:
            connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: pie\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert running.wait(30)
        assert wait_until(lambda: sample("pie:requests_cancelled_total") == 1, timeout=10)
        go_on.set()
        assert wait_until(lambda: state.in_flight == 0 and llm.runner.pages.used_count == 0, timeout=30)
    assert sample("pie:requests_cancelled_total") == 1
    assert b"pie:request_errors_total{" not in state.metrics.text(), "no error of any status"


def test_the_host_pool_gauge_counts_the_pages_preempted_requests_wait_in(tiny_model: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Read at each swap out and in, on the engine's thread, so no short wait is missed: a 64-token device pool
    holds one of four 60-token requests; the others wait in the host pool, where the gauge shows their pages."""
    from pie.scheduler import HostPagePool

    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=64)
    state = ServerState(ServeSettings(served_model_name="tiny", host_kv_tokens=1024, prefix_caching=False), llm)
    sample = state.metrics.registry.get_sample_value
    seen: list[tuple[str, int, float | None]] = []
    store, load = HostPagePool.store, HostPagePool.load

    def storing(pool: HostPagePool, device: Any, pages: Any) -> Any:
        stored = store(pool, device, pages)
        seen.append(("out", pool.used_count, sample("pie:kv_host_pages_used")))
        return stored

    def loading(pool: HostPagePool, device: Any, host: Any) -> Any:
        loaded = load(pool, device, host)
        seen.append(("in", pool.used_count, sample("pie:kv_host_pages_used")))
        return loaded

    monkeypatch.setattr(HostPagePool, "store", storing)
    monkeypatch.setattr(HostPagePool, "load", loading)
    with in_process(state) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda i: client.completions.create(
                model="tiny", prompt=[5 + i, 9, 11, 13], max_tokens=60, extra_body={"ignore_eos": True}), range(4)))
        assert [reply.usage.completion_tokens for reply in replies] == [60] * 4
        assert sample("pie:kv_host_pages_capacity") == 1024 // 16 and sample("pie:kv_host_pages_used") == 0
    assert {direction for direction, _, _ in seen} == {"out", "in"}, seen
    assert all(gauge == used for _, used, gauge in seen), seen
    assert max(gauge or 0 for _, _, gauge in seen) > 0, seen
