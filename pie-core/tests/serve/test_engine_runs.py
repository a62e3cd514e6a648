"""The serving engine without HTTP: a cancelled run never starts its inferlet; a cancel never keeps a slot."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from pie.runtime.llm import LLM
from pie.inferlet.workers import RunLimits
from pie.serve import engine as engine_module
from pie.serve.engine import Delta, Done, Engine, Failed, GenerationRequest, NoWorkerReady, RequestHandle, RunRequest
from pie.serve.failures import engine_error
from pie.testing.models import make_gguf_model


class CancelledOnArrival:
    """A worker pool whose worker comes in the same step as a cancel of the run that takes it: the race a client
    that disconnects just after a run starts makes. ``asyncio.wait_for`` before Python 3.12 then returns the
    worker and forgets the cancel, and the run went on with no one to stop it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.handle: RequestHandle | None = None
        self.given_back: list[str] = []

    def start(self) -> None:
        """Nothing to start: the pool holds no processes."""

    async def close(self) -> None:
        """Nothing to end."""

    async def take(self, inferlet: str | None = None) -> str:
        while self.handle is None:  # set by the test's thread once submit_run returns
            await asyncio.sleep(0.001)
        self.engine.cancel(self.handle)
        return "worker"

    async def give_back(self, worker: str) -> None:
        self.given_back.append(worker)


def test_a_run_cancelled_as_its_worker_arrives_never_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[str] = []

    async def serve_run(*args: Any, **kwargs: Any) -> None:
        started.append(args[2])

    monkeypatch.setattr(engine_module, "serve_run", serve_run)
    engine = Engine(LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu"))
    pool = engine.pool = CancelledOnArrival(engine)  # type: ignore[assignment]  # the calls the engine makes of a pool

    async def main() -> list[Any]:
        delivered: list[Any] = []
        engine.start(asyncio.get_running_loop())
        try:
            request = RunRequest("hello", "hello.py", (), RunLimits(wall_seconds=30))
            pool.handle = engine.submit_run(request, delivered.extend)
            deadline = time.monotonic() + 30
            while (not pool.given_back or engine.run_count) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            engine.stop()
        return delivered

    delivered = asyncio.run(main())
    assert pool.given_back == ["worker"], "the worker goes back to the pool"
    assert started == [], "the cancelled run's inferlet never started"
    assert engine.run_count == 0 and delivered == [], "nothing runs, and no one listens for an end"


def test_a_request_cancelled_as_it_is_admitted_gives_its_slot_back(tmp_path: Path) -> None:
    """A client that left while its request waited: the cancel reached the engine just after the request was
    admitted, before its task first ran. The task's own cleanup never ran, so the request kept its running slot
    for good, and with ``max_running`` slots gone every later request waited for ever."""
    engine = Engine(LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu"), max_running=1)
    first, waiting, later = (GenerationRequest(prompt_ids=(5, 6, 7), max_tokens=tokens) for tokens in (8, 4, 4))

    async def main() -> list[Any]:
        delivered: list[Any] = []
        engine.start(asyncio.get_running_loop())
        try:
            engine.submit(first, delivered.extend)
            handle = engine.submit(waiting, delivered.extend)

            def admit_then_cancel() -> None:  # both in one step of the engine's loop, as the race has them
                engine.max_running = 2
                engine._admit()
                engine.max_running = 1
                handle.cancelled = True
                engine._cancel(handle)

            engine._loop.call_soon_threadsafe(admit_then_cancel)
            engine.submit(later, delivered.extend)
            deadline = time.monotonic() + 30
            while sum(isinstance(event, Done) for event in delivered) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return delivered
        finally:
            engine.stop()

    delivered = asyncio.run(main())
    assert sum(isinstance(event, Done) for event in delivered) == 2, "the first and the later request finished"
    assert engine.running_count == 0 and engine.waiting_count == 0


def test_the_token_that_ends_a_choice_is_counted_and_shown_unless_it_is_the_models_end(tmp_path: Path) -> None:
    """An end token is generated like any other: vLLM's usage counts it (llama.cpp's too); ours once did not. A token
    of the client's stop_token_ids is shown too, as vLLM shows it (unless it is special: the decoder skips those); the
    model's own end token is not."""
    engine = Engine(LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu"))

    async def generate(request: GenerationRequest) -> list[Any]:
        delivered: list[Any] = []
        handle = engine.submit(request, delivered.extend)
        deadline = time.monotonic() + 30
        while not any(isinstance(event, Done) for event in delivered) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert not handle.cancelled
        return delivered

    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        engine.start(asyncio.get_running_loop())
        try:
            free = await generate(GenerationRequest(prompt_ids=(5, 8, 9), max_tokens=6))
            shown = [token for event in free if isinstance(event, Delta) for token in event.token_ids]
            stop = frozenset({shown[2]})
            by_client = await generate(GenerationRequest(prompt_ids=(5, 8, 9), max_tokens=6, stop_token_ids=stop))
            engine.llm.tokenizer.eos_token_ids = (shown[2],)
            by_model = await generate(GenerationRequest(prompt_ids=(5, 8, 9), max_tokens=6, stop_token_ids=stop))
            return free, by_client, by_model
        finally:
            engine.stop()

    free, by_client, by_model = asyncio.run(main())
    shown = [token for event in free if isinstance(event, Delta) for token in event.token_ids]
    assert len(shown) == 6 and shown[2] not in shown[:2], "the tiny model's greedy tokens: the third is new"
    for ended, tokens in ((by_client, shown[:3]), (by_model, shown[:2])):
        deltas = [event for event in ended if isinstance(event, Delta)]
        assert [token for delta in deltas for token in delta.token_ids] == tokens
        assert "".join(delta.text for delta in deltas) == engine.llm.tokenizer.decode(tokens)
        assert deltas[-1].finish_reason == "stop"
        (done,) = [event for event in ended if isinstance(event, Done)]
        assert done.completion_tokens == 3, "those shown, and the one that ended the choice"


@pytest.mark.parametrize("host_pages", [0, 32])
def test_two_choices_of_a_prompt_that_fills_the_kv_pool_both_finish(tmp_path: Path, host_pages: int) -> None:
    """The 62-token prompt fills the 16 pages of 4, the last one in part; both choices share that page and each
    needs a copy of it for its first token. One choice is preempted so the other writes the page in place; the
    request failed with 'no pass can be scheduled' instead, though the server had admitted it (``check_fits``)."""
    llm = LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu", page_size=4, max_cached_tokens=64)
    prompt = tuple(5 + i % 50 for i in range(62))
    llm.check_fits(len(prompt), 3)
    engine = Engine(llm, host_pages=host_pages)

    async def main() -> list[Any]:
        delivered: list[Any] = []
        engine.start(asyncio.get_running_loop())
        try:
            engine.submit(GenerationRequest(prompt_ids=prompt, max_tokens=3, n=2), delivered.extend)
            deadline = time.monotonic() + 30
            while not any(isinstance(event, (Done, Failed)) for event in delivered) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return delivered
        finally:
            engine.stop()

    (end,) = [event for event in asyncio.run(main()) if isinstance(event, (Done, Failed))]
    assert isinstance(end, Done) and end.completion_tokens == 6


class PanicException(BaseException):
    """What a Rust library (the tokenizers library) raises through pyo3 when it panics: no Exception."""


def test_a_rust_panic_while_generating_fails_that_request_and_the_engine_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A panic derives from BaseException: it went past the request's handler, which never ended it, and its client
    waited for good."""
    engine = Engine(LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu"))
    tokenizer = engine.llm.tokenizer
    real = tokenizer.stream_decoder

    def panicking() -> Any:
        raise PanicException("called `Option::unwrap()` on a `None` value")

    async def generate() -> list[Any]:
        delivered: list[Any] = []
        engine.submit(GenerationRequest(prompt_ids=(5, 8, 9), max_tokens=3), delivered.extend)
        deadline = time.monotonic() + 30
        while not any(isinstance(event, (Done, Failed)) for event in delivered) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return delivered

    async def main() -> tuple[list[Any], list[Any]]:
        engine.start(asyncio.get_running_loop())
        try:
            monkeypatch.setattr(tokenizer, "stream_decoder", panicking)
            failed = await generate()
            monkeypatch.setattr(tokenizer, "stream_decoder", real)
            return failed, await generate()
        finally:
            engine.stop()

    failed, after = asyncio.run(main())
    assert [type(event.error).__name__ for event in failed if isinstance(event, Failed)] == ["PanicException"]
    assert any(isinstance(event, Done) for event in after)


class NeverReady:
    """A worker pool none of whose workers becomes ready (each start fails, or they are all busy)."""

    failures = ["could not be started: [Errno 24] Too many open files"]

    def start(self) -> None:
        """Nothing to start: the pool holds no processes."""

    async def close(self) -> None:
        """Nothing to end."""

    async def take(self, inferlet: str | None = None) -> str:
        await asyncio.Event().wait()  # never set: no worker comes
        raise AssertionError("unreachable")


def test_a_run_that_gets_no_worker_is_a_503_to_retry(tmp_path: Path) -> None:
    """A run that no worker came for within its wall-clock limit ended as the inferlet's own failure (a 500
    inferlet_failed), where nothing of the inferlet had run: the server was short of workers, which may pass."""
    engine = Engine(LLM.load(str(make_gguf_model(tmp_path / "m.gguf", "F32")), "cpu"))
    engine.pool = NeverReady()  # type: ignore[assignment]  # the calls the engine makes of a pool

    async def main() -> list[Any]:
        delivered: list[Any] = []
        engine.start(asyncio.get_running_loop())
        try:
            engine.submit_run(RunRequest("hello", "hello.py", (), RunLimits(wall_seconds=0.2)), delivered.extend)
            deadline = time.monotonic() + 30
            while not delivered and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            engine.stop()
        return delivered

    [ended] = asyncio.run(main())
    assert isinstance(ended, Failed) and isinstance(ended.error, NoWorkerReady), ended
    error = engine_error(ended.error, lose_device=lambda error: pytest.fail(f"no device was lost: {error}"))
    assert (error.status, error.code, error.headers) == (503, "no_inferlet_worker", {"Retry-After": "5"})
    assert error.message == ("no inferlet worker was ready within 0.2 s; the last worker could not be started: "
                             "[Errno 24] Too many open files; retry later")
