"""The serving engine's inferlet runs, without worker processes: a cancelled run never starts its inferlet."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from pie.runtime.llm import LLM
from pie.inferlet.workers import RunLimits
from pie.serve import engine as engine_module
from pie.serve.engine import Engine, RequestHandle, RunRequest
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
