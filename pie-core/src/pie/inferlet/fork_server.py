"""The host's handle on the fork server (:mod:`pie.inferlet.zygote`), which forks every inferlet worker.

A worker started as a fresh interpreter pays a process start, numpy's and pie's imports, the model's tokenizer
and (for constrained generation) llguidance's vocabulary: hundreds of milliseconds of CPU, spent while other
runs are being served. The fork server pays them once; a worker is a fork of it. The fork server is the
workers' parent, so it reaps them and reports each exit status; the host kills a worker through the pidfd the
fork server sends with its pid. If the fork server dies, its workers die with it (PDEATHSIG) and every
worker not yet reaped ends with :data:`LOST_WITH_FORK_SERVER`; the pool starts another fork server.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any

from pie.inferlet.wire import WireError, encode, read_with_fds, send_with_fds

START_TIMEOUT_S = 60.0
"""Longest the fork server may take from its start to ready (imports, the tokenizer, the grammar vocabulary)."""
STOP_TIMEOUT_S = 5.0
WORKER_ENVIRONMENT = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # its thread pool would make the fork server multi-threaded
}
_SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()
"""The flag that keeps the current directory off the fork server's ``sys.path``, where Python has it."""
LOST_WITH_FORK_SERVER = -1000
"""The status of a worker whose fork server died before reporting its exit (no exit status is a negative
signal number this low)."""


class ForkServerError(RuntimeError):
    """The fork server could not start, or could not fork a worker; the message says why."""


@dataclass
class Child:
    """A worker process forked by the fork server, until its exit is known."""

    pid: int
    pidfd: int | None
    exited: asyncio.Future[int] = field(repr=False)
    """Its exit status as :attr:`subprocess.Popen.returncode` gives it, or :data:`LOST_WITH_FORK_SERVER`."""

    def kill(self) -> None:
        """SIGKILL, unless its exit is known (a pid already reaped may belong to another process)."""
        if self.exited.done():
            return
        try:
            if self.pidfd is not None:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass  # dead, not yet reported

    def release(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


class ForkServer:
    """One fork server process: :meth:`start` it, :meth:`fork` workers from it, :meth:`close` it."""

    def __init__(self, init: dict[str, Any]):
        """``init`` is the message each worker used to start from: ``tokenizer``, ``vocab``, ``sandbox``."""
        self._init = init
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[Child]] = {}
        self._children: dict[int, Child] = {}
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self._stderr: Any = None
        self._ready: asyncio.Future[None] | None = None
        self._exiting: asyncio.Task[None] | None = None
        self.lost: str | None = None
        """Why the fork server is gone (None while it serves)."""

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def alive(self) -> bool:
        return self.lost is None and self._process is not None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        host_end, server_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._stderr = tempfile.TemporaryFile()
        try:
            # No folder anyone else may write on its sys.path: "-m" puts the current directory first (-P, from Python
            # 3.11, leaves it off), so that is "/", root's to write; it was the temporary folder, anyone's.
            self._process = subprocess.Popen(
                [sys.executable, *_SAFE_PATH, "-m", "pie.inferlet.zygote", str(server_end.fileno())],
                pass_fds=(server_end.fileno(),),
                cwd="/",
                env=_environment(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                start_new_session=True,
            )
        except OSError as exc:
            host_end.close()
            self.lost = f"could not be started: {exc}"
            raise ForkServerError(f"the fork server {self.lost}") from None
        finally:
            server_end.close()
        self._control = host_end
        threading.Thread(target=self._read, args=(loop,), name="pie-fork-server", daemon=True).start()
        try:
            await asyncio.to_thread(host_end.sendall, encode(self._init))  # megabytes of tokenizer: off the loop
            await asyncio.wait_for(asyncio.shield(self._ready), START_TIMEOUT_S)
        except (OSError, TimeoutError, ForkServerError) as exc:
            reason = f"did not start within {START_TIMEOUT_S:g} s" if isinstance(exc, TimeoutError) else str(exc)
            await self.close()
            raise ForkServerError(f"the fork server failed to start ({reason}): {self.last_words()}") from None

    async def fork(self, fds: list[int], workdir: str) -> Child:
        """A new worker, given copies of ``fds`` (its socket, its logit rows, its stderr), in ``workdir``."""
        if not self.alive or self._control is None:
            raise ForkServerError(f"the fork server {self.lost or 'is not started'}")
        request = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._pending[request] = future
        try:
            send_with_fds(self._control, {"op": "fork", "id": request, "workdir": workdir}, fds)
        except OSError as exc:
            self._pending.pop(request, None)
            self._lose(f"could not be reached ({exc})")
            raise ForkServerError(f"the fork server {self.lost}") from None
        return await future

    def last_words(self) -> str:
        return last_line(self._stderr.fileno()) if self._stderr is not None else ""

    async def close(self) -> None:
        """Stop the fork server (its workers die with it) and reap it."""
        if self._control is not None:
            control, self._control = self._control, None
            try:
                control.shutdown(socket.SHUT_RDWR)  # wakes the reader thread (a close alone would not)
            except OSError:
                pass  # the fork server is gone already
            control.close()
        process = self._process
        if process is not None:
            try:
                await asyncio.wait_for(asyncio.to_thread(process.wait), STOP_TIMEOUT_S)
            except TimeoutError:
                process.kill()
                await asyncio.to_thread(process.wait)
        self._lose(f"was stopped ({_describe(process)})" if process else "was stopped")

    # -- the reader thread, and what it hands to the event loop ---------------------------

    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        control = self._control
        assert control is not None
        try:
            while True:
                message, fds = read_with_fds(control, 1)
                loop.call_soon_threadsafe(self._on_message, message, fds)
        except (WireError, OSError, ValueError) as exc:
            try:
                loop.call_soon_threadsafe(self._on_closed, str(exc))
            except RuntimeError:
                pass  # the loop is closed: nobody is left to tell

    def _on_message(self, message: dict[str, Any], fds: list[int]) -> None:
        op = message.get("op")
        if op == "ready" and self._ready is not None and not self._ready.done():
            self._ready.set_result(None)
        elif op == "forked":
            future = self._pending.pop(message.get("id"), None)  # type: ignore[arg-type]
            if "error" in message:
                if future is not None and not future.done():
                    future.set_exception(ForkServerError(f"the fork server could not fork a worker: {message['error']}"))
                return
            child = Child(int(message["pid"]), fds[0] if fds else None, asyncio.get_running_loop().create_future())
            self._children[child.pid] = child
            if future is None or future.done():  # its start was cancelled meanwhile
                child.kill()
                child.exited.add_done_callback(lambda _: child.release())
            else:
                future.set_result(child)
        elif op == "exited":
            child = self._children.pop(int(message["pid"]), None)
            if child is not None and not child.exited.done():
                child.exited.set_result(int(message["status"]))

    def _on_closed(self, reason: str) -> None:
        if self.lost is None and self._control is not None:  # not closed by close()
            self._exiting = asyncio.get_running_loop().create_task(self._lost_on_its_own(reason))

    async def _lost_on_its_own(self, reason: str) -> None:
        """The fork server closed its socket by itself: wait for its exit (briefly), reap it, say how it ended."""
        process = self._process
        assert process is not None
        try:
            await asyncio.to_thread(process.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            await asyncio.to_thread(process.wait)
            reason = f"closed its socket ({reason}) and was killed"
        else:
            reason = _describe(process)
        said = self.last_words()
        self._lose(f"{reason}{': ' + said if said else ''}")

    def _lose(self, why: str) -> None:
        """The fork server is gone: its workers are killed, everything waiting on it is told."""
        if self.lost is None:
            self.lost = why
        for child in self._children.values():
            child.kill()  # PDEATHSIG kills them too; this covers the fork server's own slow death
            if not child.exited.done():
                child.exited.set_result(LOST_WITH_FORK_SERVER)
        self._children.clear()
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ForkServerError(f"the fork server {self.lost}"))
        self._pending.clear()
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(ForkServerError(f"the fork server {self.lost}"))
            self._ready.exception()  # retrieved: start() reports it, or nobody waits any more


def _environment() -> dict[str, str]:
    """Nothing of the server's environment (its API key above all) but where Python finds pie: the server's
    PYTHONPATH, each entry made absolute (the fork server runs in another folder), and none empty (which Python
    reads as the current folder)."""
    environment = dict(WORKER_ENVIRONMENT)
    path = [os.path.abspath(entry) for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    if path:
        environment["PYTHONPATH"] = os.pathsep.join(path)
    return environment


def _describe(process: subprocess.Popen[bytes] | None) -> str:
    return describe_exit(process.poll() if process is not None else None)


def describe_exit(status: int | None) -> str:
    """How a process ended, from its status as :attr:`subprocess.Popen.returncode` gives it."""
    if status is None:
        return "is still running"
    if status == LOST_WITH_FORK_SERVER:
        return "ended with its fork server"
    if status < 0:
        try:
            name = signal.Signals(-status).name
        except ValueError:
            name = f"signal {-status}"
        return f"was killed by signal {-status} ({name})"
    return f"exited with status {status}"


def last_line(fd: int) -> str:
    """The last line written to the file ``fd`` (a process's stderr, which shares the descriptor's offset), at most
    300 characters; a file of fixed size (a worker's) is read to where its writer got."""
    try:
        end = min(os.lseek(fd, 0, os.SEEK_CUR), os.fstat(fd).st_size)
        text = os.pread(fd, min(end, 4096), max(end - 4096, 0)).decode(errors="replace")
    except OSError:
        return ""
    lines = text.strip().splitlines()
    return lines[-1][:300] if lines else ""
