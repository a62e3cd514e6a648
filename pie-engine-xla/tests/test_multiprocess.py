"""The XLA engine as two processes on loopback (jax.distributed, gloo collectives on the CPU), the model
sharded over both: rank 0 runs the passes, rank 1 follows them (see pie.runtime.replicated)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from xla_helpers import SMOLLM2_TOKENS

HERE = Path(__file__).parent
RUN_TIMEOUT_S = 400.0


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "PIE_XLA_DEVICES")}
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _report(done: subprocess.CompletedProcess[str] | tuple[int, str, str]) -> dict:
    code, out, err = done if isinstance(done, tuple) else (done.returncode, done.stdout, done.stderr)
    assert code == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def run_single() -> dict:
    """The tiny workload on this process's XLA engine: the reference the two processes must equal."""
    from multiprocess_run import tiny_runner, tiny_workload
    from pie.plugins import EngineRegistry

    runner = tiny_runner(EngineRegistry().engine("xla").open(0))
    try:
        return tiny_workload(runner)
    finally:
        runner.close()


def run_two_processes(model: str, logs: Path) -> tuple[dict, dict]:
    """Both ranks at once, their output in files (a full pipe would stall one rank, and with it the other);
    each killed if it outlives the timeout, so a hang fails instead of blocking CI."""
    coordinator, passes = (f"127.0.0.1:{port}" for port in _free_ports(2))
    processes, files = [], []
    try:
        for rank in (0, 1):
            out, err = open(logs / f"rank{rank}.out", "w+"), open(logs / f"rank{rank}.err", "w+")
            files.append((out, err))
            processes.append(subprocess.Popen(
                [sys.executable, str(HERE / "multiprocess_run.py"), model, str(rank), coordinator, passes],
                env=_environment(), cwd=HERE, stdout=out, stderr=err, text=True))
        results = []
        for process, (out, err) in zip(processes, files):
            process.wait(timeout=RUN_TIMEOUT_S)
            out.seek(0)
            err.seek(0)
            results.append((process.returncode, out.read(), err.read()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        for out, err in files:
            out.close()
            err.close()
    return _report(results[0]), _report(results[1])


def test_two_processes_shard_the_model_and_match_one_process(tmp_path: Path) -> None:
    single = run_single()
    leader, follower = run_two_processes("tiny", tmp_path)
    assert (leader["jax_processes"], leader["processes"], leader["mesh_devices"]) == (2, 2, 2)
    # The stacked QKV weight lives half on each process (rows of its heads).
    assert leader["qkv_shape"] == single["qkv_shape"] == [256, 64] and leader["qkv_shard"] == [128, 64]
    # 6 passes, the fork's copy-on-write (one copy within the pool), the pool read back.
    assert follower["followed"] == 8
    for step, (ours, theirs) in enumerate(zip(leader["logits"], single["logits"], strict=True)):
        np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-5, rtol=0, err_msg=f"step {step}")
    assert leader["pool_max"] == pytest.approx(single["pool_max"], abs=1e-5)
    assert leader["pool_sum"] == pytest.approx(single["pool_sum"], rel=1e-5)


@pytest.mark.slow
def test_smollm2_on_two_processes_gives_the_cpu_engines_greedy_tokens(
    tmp_path: Path, smollm2_on_cpu: tuple[list[int], np.ndarray]
) -> None:
    leader, follower = run_two_processes("smollm2", tmp_path)
    assert (leader["jax_processes"], leader["mesh_devices"]) == (2, 2)
    assert follower["followed"] == SMOLLM2_TOKENS + 1
    assert leader["tokens"] == smollm2_on_cpu[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "2", "--process-id", "2"], "process id 2 is outside 0..1"),
        (["--num-processes", "0"], "the number of processes must be at least 1, not 0"),
        (["--coordinator", "127.0.0.1:1"], "cannot join the process group: Number of processes must be defined. "
                                           "(give --coordinator, --num-processes and --process-id"),
        (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
         "the coordinator 'localhost' is not HOST:PORT"),
    ],
)
def test_the_serve_module_refuses_a_group_it_cannot_be(args: list[str], message: str) -> None:
    pytest.importorskip("fastapi", reason="pie serve needs pie-core's serve extra")
    env = {k: v for k, v in _environment().items() if not k.startswith(("JAX_COORDINATOR", "PIE_PASS"))}
    done = subprocess.run([sys.executable, "-m", "pie_engine_xla.serve", *args], env=env, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 1 and message in done.stderr, done.stderr[-4000:]
    assert "Traceback" not in done.stderr


LISTENING = re.compile(r"listening on (http://[^\s;]+)")
REQUESTS = (
    {"prompt": "17 owls and the", "max_tokens": 12, "temperature": 0},
    {"prompt": "A king walked into", "max_tokens": 10, "temperature": 0, "n": 2},  # n=2 forks: copy-on-write
    {"prompt": [5, 9, 33, 41, 7, 7, 101], "max_tokens": 16, "temperature": 0},
)


def _wait_listening(log: Path, process: subprocess.Popen[str], timeout: float = 180.0) -> str:
    """The server's address once /health answers 200 (it prints where it listens first)."""
    import httpx

    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"the server exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        found = url or LISTENING.search(log.read_text())
        if found:
            url = found if isinstance(found, str) else found.group(1)
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"the server was not ready within {timeout} s:\n{log.read_text()[-4000:]}")


def _texts(url: str) -> list[list[str]]:
    import httpx

    answers = []
    for body in REQUESTS:
        reply = httpx.post(f"{url}/v1/completions", json={"model": "tiny", **body}, timeout=120)
        assert reply.status_code == 200, reply.text
        answers.append([choice["text"] for choice in reply.json()["choices"]])
    return answers


def _serve(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    with open(log, "w") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, text=True,
                                stdin=subprocess.DEVNULL)


def test_pie_serve_over_two_processes_answers_as_the_cpu_engine(tmp_path: Path) -> None:
    pytest.importorskip("fastapi", reason="pie serve needs pie-core's serve extra")
    from pie.testing.models import make_gguf_model

    model = str(make_gguf_model(tmp_path / "tiny.gguf", "F32", lm_head_scale=20.0))
    common = ["--model", model, "--served-model-name", "tiny", "--port", "0", "--kv-tokens", "2048"]
    env = _environment()
    processes: list[subprocess.Popen[str]] = []
    try:
        pie = str(Path(sys.executable).with_name("pie"))
        reference = _serve([pie, "serve", *common, "--engine", "cpu"], tmp_path / "cpu.log", env)
        processes.append(reference)
        expected = _texts(_wait_listening(tmp_path / "cpu.log", reference))
        reference.send_signal(signal.SIGTERM)
        assert reference.wait(30) == 0

        coordinator, passes = (f"127.0.0.1:{port}" for port in _free_ports(2))
        for rank in (0, 1):
            group = ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(rank),
                     "--pass-address", passes]
            processes.append(_serve([sys.executable, "-m", "pie_engine_xla.serve", *group, *common],
                                    tmp_path / f"rank{rank}.log", env))
        leader, follower = processes[1:]
        url = _wait_listening(tmp_path / "rank0.log", leader)
        assert _texts(url) == expected
        leader.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0, (tmp_path / "rank0.log").read_text()[-4000:]
        assert follower.wait(60) == 0, (tmp_path / "rank1.log").read_text()[-4000:]
        assert "the leader closed after" in (tmp_path / "rank1.log").read_text()
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
