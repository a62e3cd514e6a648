"""`pie serve` as a child process on a free loopback port, started and stopped by the test that uses it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from pie.serve.app import ServerState

PIE = str(Path(sys.executable).with_name("pie"))
LISTENING = re.compile(r"listening on (http://[^\s;]+)")
START_TIMEOUT_S = 90.0


class ServeProcess:
    """A running `pie serve --port 0 ARGS`; ``url`` is its address, ``log`` what it printed so far."""

    def __init__(self, *args: str, env: dict[str, str] | None = None):
        environment = {**os.environ, "PIE_ENGINES": "cpu", **(env or {})}
        self.args = args
        self.process = subprocess.Popen(
            [PIE, "serve", "--host", "127.0.0.1", "--port", "0", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=environment,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = self._wait_for(LISTENING).group(1)

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def _wait_for(self, pattern: re.Pattern[str], timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = pattern.search(self.log)
            if found:
                return found
            if self.process.poll() is not None:
                time.sleep(0.1)  # let the reader take the last lines
                found = pattern.search(self.log)
                if found:
                    return found
                raise AssertionError(f"pie serve exited with {self.process.returncode}:\n{self.log}")
            time.sleep(0.02)
        raise AssertionError(f"pie serve did not print {pattern.pattern!r} within {timeout} s:\n{self.log}")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> ServeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"pie serve exited with {self.process.returncode}:\n{self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"pie serve was not ready within {timeout} s:\n{self.log}")

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name (labels appended as name{k=v,...} when present)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return samples

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code (killed, and the test failed, if it does not exit in time)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)
            raise AssertionError(f"pie serve did not exit within {timeout} s of SIGTERM:\n{self.log}") from None

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@contextmanager
def in_process(state: ServerState) -> Iterator[str]:
    """The application of ``state`` under uvicorn on a thread of this process (no signals), on a free loopback port;
    yields its URL. A test reaches into ``state`` (its model, its engine) while the server runs."""
    import uvicorn

    from pie.serve.app import create_app

    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    assert wait_until(lambda: server.started, timeout=30)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def wait_until(condition, timeout: float = 20.0, interval: float = 0.05) -> bool:  # type: ignore[no-untyped-def]
    """Poll ``condition()`` until it is true or ``timeout`` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value or time.monotonic() > deadline:
            return bool(value)
        time.sleep(interval)


def named_bytes(token: str) -> list[int]:
    """The bytes a log-probability's token names: its text's, or those of OpenAI's ``bytes:\\xf0\\x9f``."""
    if token.startswith("bytes:"):
        return [int(pair, 16) for pair in token.removeprefix("bytes:").split("\\x")[1:]]
    return list(token.encode())
