"""A process group of the XLA engine that fails: each way ends in one clear line, every process gone, none hung.

Two processes of ``python -m pie_engine_xla.serve`` on loopback (JAX on the CPU, gloo collectives), each killed by the
test if it outlives its bound.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_multiprocess import _environment, _free_ports, _serve, _wait_listening

pytest.importorskip("fastapi", reason="pie serve needs pie-core's serve extra")

EXIT_TIMEOUT_S = 90.0
"""The longest a process may take to end once it should (a dead follower holds rank 0's leaving up 10 s)."""
JAX_ABORT = "Check failure stack trace"
"""What JAX prints when it aborts a process (its C++ stack trace follows)."""


@pytest.fixture
def group(tmp_path: Path) -> Iterator[Group]:
    started = Group(tmp_path)
    try:
        yield started
    finally:
        started.kill()


class Group:
    """Two ranks of ``python -m pie_engine_xla.serve`` on free loopback ports, their output in rank{i}.log."""

    def __init__(self, folder: Path):
        from pie.testing.models import make_gguf_model

        self.folder = folder
        self.model = str(make_gguf_model(folder / "tiny.gguf", "F32", lm_head_scale=20.0))
        self.coordinator, self.passes = (f"127.0.0.1:{port}" for port in _free_ports(2))
        self.processes: dict[int, subprocess.Popen[str]] = {}

    def start(self, rank: int, *options: str, model: str | None = None, env: dict[str, str] | None = None,
              num_processes: int = 2) -> subprocess.Popen[str]:
        command = [sys.executable, "-m", "pie_engine_xla.serve", "--coordinator", self.coordinator,
                   "--num-processes", str(num_processes), "--process-id", str(rank), "--pass-address", self.passes,
                   "--model", model or self.model, "--served-model-name", "tiny", "--port", "0", "--kv-tokens", "2048",
                   *options]
        self.processes[rank] = _serve(command, self.log(rank), {**_environment(), **(env or {})})
        return self.processes[rank]

    def log(self, rank: int) -> Path:
        return self.folder / f"rank{rank}.log"

    def ended(self, rank: int) -> tuple[int, str]:
        """Rank ``rank``'s exit status once it ends (within EXIT_TIMEOUT_S), and what it printed."""
        code = self.processes[rank].wait(EXIT_TIMEOUT_S)
        return code, self.log(rank).read_text()

    def kill(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)


def _post(url: str, body: dict[str, object]) -> tuple[int, dict]:
    import httpx

    reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=120)
    return reply.status_code, reply.json()


def test_a_follower_killed_while_serving_fails_its_requests_as_a_lost_device(group: Group) -> None:
    import httpx

    leader, follower = group.start(0), group.start(1)
    url = _wait_listening(group.log(0), leader)
    assert _post(url, {"prompt": "17 owls", "max_tokens": 4, "temperature": 0})[0] == 200
    events = []
    body = {"model": "tiny", "prompt": "A king", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                if len(events) == 3:
                    follower.kill()
    assert "choices" in events[0] and events[-1]["error"]["code"] == "device_lost", events[-1]
    # Whichever rank 0 learned first: its pass failing, or the follower's pass channel ending.
    assert "so the group cannot go on" in events[-1]["error"]["message"]
    code, answer = _post(url, {"prompt": "17 owls", "max_tokens": 4})
    assert code == 503 and answer["error"]["code"] == "device_lost", answer
    health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "failed", health.text
    assert "the group cannot go on" in health.json()["error"]
    leader.send_signal(signal.SIGTERM)
    code, log = group.ended(0)
    assert code == 0 and "Traceback" not in log and JAX_ABORT not in log, log[-4000:]


def test_a_follower_killed_while_rank_0_is_idle_fails_its_health_before_any_request(group: Group) -> None:
    """Rank 0 learned that a follower was gone only at its next device operation: /health said ready until a request
    came and failed."""
    import httpx

    leader, follower = group.start(0), group.start(1)
    url = _wait_listening(group.log(0), leader)
    follower.kill()
    follower.wait(EXIT_TIMEOUT_S)
    deadline = time.monotonic() + EXIT_TIMEOUT_S
    health = httpx.get(f"{url}/health", timeout=10)
    while health.status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(f"{url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "failed", health.text
    gone = "FollowerLost: process 1 of the group of 2 (at 127.0.0.1) is gone: its pass channel "
    assert f"the device was lost: {gone}" in health.json()["error"], health.text
    code, answer = _post(url, {"prompt": "17 owls", "max_tokens": 4})
    assert code == 503 and answer["error"]["code"] == "device_lost" and gone in answer["error"]["message"], answer
    leader.send_signal(signal.SIGTERM)
    code, log = group.ended(0)
    assert code == 0 and "Traceback" not in log and JAX_ABORT not in log, log[-4000:]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_process_whose_group_never_forms_gives_up_at_the_group_timeout(group: Group, rank: int) -> None:
    group.start(rank, env={"PIE_XLA_GROUP_TIMEOUT": "3"})  # the other rank never comes
    code, log = group.ended(rank)
    assert code == 1, log[-4000:]
    assert (f"pie: the process group did not form within 3 s (PIE_XLA_GROUP_TIMEOUT): process {rank} waited for all "
            f"2 processes to join the coordinator at {group.coordinator}") in log
    assert "Traceback" not in log and JAX_ABORT not in log


def test_the_group_timeout_must_be_seconds(group: Group) -> None:
    group.start(1, env={"PIE_XLA_GROUP_TIMEOUT": "soon"})
    code, log = group.ended(1)
    assert code == 1 and "pie: PIE_XLA_GROUP_TIMEOUT='soon' is not a number of seconds above 0" in log, log[-4000:]


def test_a_coordinator_port_in_use_is_named(group: Group) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        group.coordinator = f"127.0.0.1:{port}"
        group.start(0)
        code, log = group.ended(0)
    assert code == 1, log[-4000:]
    assert (f"pie: process 0 cannot start the group's coordinator on port {port} (--coordinator "
            f"{group.coordinator}): Address already in use; give a free port") in log


def test_a_pass_address_in_use_is_named_before_the_model_loads(group: Group) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        group.passes = f"127.0.0.1:{taken.getsockname()[1]}"
        group.start(0)
        group.start(1)
        code, log = group.ended(0)
    assert code == 1, log[-4000:]
    assert (f"pie: process 0 cannot listen for the followers' pass channels on {group.passes} (--pass-address "
            f"{group.passes}): Address already in use; give a free port") in log
    assert "Traceback" not in log and JAX_ABORT not in log


def test_a_follower_told_another_process_count_leaves_and_rank_0_says_why(group: Group) -> None:
    group.start(0)
    group.start(1, num_processes=3)
    why = "process 1 was started with --num-processes 3, but process 0 formed the group for 2"
    code, log = group.ended(1)
    assert code == 1 and f"pie: {why}: give every process the same --num-processes" in log, log[-4000:]
    code, log = group.ended(0)
    assert code == 1 and f"cannot serve: process 1 left the group: {why}" in log, log[-4000:]
    assert "Traceback" not in log and JAX_ABORT not in log


@pytest.mark.parametrize(
    ("setting", "difference"),
    [
        ("--model", "process 1 loaded another model: its weight 0 (float32 [400, 64]) holds other values than this "
                    "process's (start every process with the same --model and --dtype)"),
        ("--kv-tokens", "process 1 has a KV cache of 64 pages of 16 tokens in float32, this process a KV cache of 128 "
                        "pages of 16 tokens in float32 (give every process the same --kv-tokens and --kv-dtype)"),
    ],
    ids=["model", "kv-tokens"],
)
def test_a_follower_started_otherwise_stops_the_group(group: Group, setting: str, difference: str) -> None:
    from pie.testing.models import make_gguf_model

    group.start(0)
    if setting == "--model":
        group.start(1, model=str(make_gguf_model(group.folder / "other.gguf", "F32", lm_head_scale=20.0, seed=1)))
    else:
        group.start(1, "--kv-tokens", "1024")
    code, log = group.ended(0)
    assert code == 1 and f"cannot serve: {difference}" in log, log[-4000:]
    assert "Traceback" not in log and JAX_ABORT not in log
    code, log = group.ended(1)
    assert code == 1 and "pie: process 1 cannot follow: " in log and "process 0 " in log, log[-4000:]
    assert "internal error" not in log and JAX_ABORT not in log  # the follower's refusal was an internal error
