"""Hostile inferlets served beside healthy ones: each is stopped by its sandbox or its limits, nothing leaks.

Every attempt runs in a sandboxed worker process; the run ends with an error event that says what stopped it,
within its limit, its pages come back, the healthy runs' tokens equal a quiet run's, and the server goes on.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from typing import Any

import openai
from pie.testing.serve_process import ServeProcess, wait_until

SECRET = "pie-test-secret-key-1234567890"
MARKER = "/tmp/pie-hostile-marker"

HEALTHY = '''"""Greedy tokens of one prompt."""


async def main(ctx, args):
    context = ctx.context("The quick brown fox")
    return await context.generate_tokens(8)
'''

HOSTILE = {
    "shell": ("import os\n", f"assert os.system('touch {MARKER}') == 0, 'the shell did not run'", "the shell did not run"),
    "subprocess": ("import subprocess\n", f"subprocess.run(['touch', '{MARKER}'])", "raised PermissionError"),
    "passwd": ("", "return open('/etc/passwd').read()", "raised PermissionError"),
    "outside": ("", f"open('{MARKER}', 'w').write('x')", "raised PermissionError"),
    "connect": ("import socket\n", "socket.create_connection(('127.0.0.1', int(args[0])), timeout=2)",
                "raised PermissionError"),
    "exit": ("import os\n", "os._exit(3)", "its worker exited with status 3"),
    "segfault": ("import ctypes\n", "ctypes.string_at(0)", "killed by signal 11 (SIGSEGV)"),
    "stubborn": ("", "while True:\n        try:\n            while True:\n                pass\n"
                     "        except BaseException:\n            pass", "did not finish within 4 s"),
    "hoard": ("", "block = bytearray(10 * 2**30)\n    return len(block)", "raised MemoryError"),
    "forkbomb": ("import os\n", "while True:\n        os.fork()", "raised PermissionError"),
    "chatty": ("", "while True:\n        ctx.emit('x' * 1000)", "emitted more than"),
}


def source(imports: str, body: str) -> str:
    return f'"""Hostile."""\n{imports}\n\nasync def main(ctx, args):\n    {body}\n'


class Listener:
    """A loopback port the inferlets are told about; it counts who connects."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except (TimeoutError, OSError):
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


async def run(client: openai.AsyncOpenAI, name: str, args: list[str]) -> tuple[list[Any], str | None]:
    events: list[Any] = []
    try:
        stream = await client.post(f"/inferlets/{name}/runs", body={"args": args}, cast_to=object, stream=True,
                                   stream_cls=openai.AsyncStream[object])
        async for event in stream:
            events.append(event)
    except openai.APIError as exc:
        return events, exc.message
    return events, None


def test_hostile_inferlets_are_stopped_and_the_healthy_ones_are_not_disturbed(
    tiny_model: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "inferlets"
    folder.mkdir()
    (folder / "healthy.py").write_text(HEALTHY)
    for name, (imports, body, _) in HOSTILE.items():
        (folder / f"{name}.py").write_text(source(imports, body))
    (folder / "environment.py").write_text(source("import os\n", "return dict(os.environ)"))
    Path(MARKER).unlink(missing_ok=True)
    listener = Listener()
    args = ("--model", str(tiny_model), "--inferlets", str(folder), "--kv-tokens", "4096", "--inferlet-seconds", "4",
            "--inferlet-workers", "3", "--max-inferlet-runs", "32")
    try:
        with ServeProcess(*args, env={"PIE_API_KEY": SECRET}) as server:
            server.wait_ready()

            async def everything() -> tuple[Any, list[Any], list[Any], Any]:
                async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=SECRET, max_retries=0,
                                              timeout=120) as client:
                    quiet = await run(client, "healthy", [])
                    hostile = [run(client, name, [str(listener.port)]) for name in HOSTILE]
                    healthy = [run(client, "healthy", []) for _ in range(3)]
                    environment = run(client, "environment", [])
                    results = await asyncio.wait_for(asyncio.gather(*hostile, *healthy, environment), timeout=240)
                return quiet, results[: len(HOSTILE)], results[len(HOSTILE) : -1], results[-1]

            quiet, hostile, healthy, environment = asyncio.run(everything())
            quiet_events, quiet_error = quiet
            assert quiet_error is None, quiet_error
            tokens = quiet_events[-1]["value"]
            for (events, error), name in zip(hostile, HOSTILE, strict=True):
                assert error is not None and HOSTILE[name][2] in error, (name, error, events[-3:])
            for events, error in healthy:
                assert error is None and events[-1]["value"] == tokens, "a healthy run was disturbed"
            assert environment[1] is None and SECRET not in str(environment[0])
            assert wait_until(lambda: server.metrics()["pie:kv_pages_used"] == 0), server.metrics()
            assert server.metrics()["pie:inferlet_runs"] == 0
            served = openai.OpenAI(base_url=f"{server.url}/v1", api_key=SECRET, max_retries=0)
            assert served.completions.create(model=str(tiny_model), prompt="still here", max_tokens=3).usage
            assert server.stop() == 0, server.log
    finally:
        listener.close()
    assert listener.connections == 0, "an inferlet reached the test's listener"
    assert not Path(MARKER).exists(), "an inferlet wrote outside its folder"
