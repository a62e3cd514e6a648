"""The fork server (zygote): one process that does a worker's start-up once, and forks every worker from it.

Started by :class:`pie.inferlet.fork_server.ForkServer` with the almost empty environment a worker gets (one
BLAS thread, the tokenizers library's thread pool off), it reads one ``init`` message (the tokenizer, the
vocabulary size, the sandbox policy), imports what a worker runs, builds the tokenizer and llguidance's
vocabulary, and says ``ready``. Then, for each ``fork`` message (the worker's socket, its logit rows and its
stderr passed as descriptors, and its private directory), it forks; the child closes every descriptor of the
fork server's (its socket to the host above all: no worker can talk to it), takes those three and the
directory, and becomes a worker (:func:`pie.inferlet.worker.serve_one`), which locks itself down before it
reads its run. The fork server answers ``forked`` with the child's pid and a pidfd (by which the host kills
it, with no risk of a reused pid), and, being the child's parent, reaps it and sends ``exited`` with its
status.

It stays single-threaded: a fork copies only the calling thread, so a lock another thread held would stay
held in the child, and the sandbox's namespaces need a single-threaded process. It holds nothing a worker may
not see: it starts from an empty environment and is sent only the tokenizer and the policy.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import select
import signal
import socket
import sys
import traceback
from typing import Any

from pie.inferlet.wire import WireError, encode, read_blocking, read_with_fds, send_with_fds
from pie.inferlet.worker import serve_one
from pie.model.tokenizer import Tokenizer

FORK_FDS = 3
"""Descriptors a ``fork`` message carries: the worker's socket, its logit rows, its stderr."""
_PR_SET_PDEATHSIG = 1


class _Parent:
    """What the fork server keeps: its socket to the host, what each worker starts from, the SIGCHLD wake-up."""

    def __init__(self, control: socket.socket, init: dict[str, Any]):
        self.control = control
        self.tokenizer = Tokenizer.from_json(init["tokenizer"])
        self.vocab = int(init["vocab"])
        self.sandbox: dict[str, Any] | None = init.get("sandbox")
        self.python: tuple[str, ...] = ()
        """What of the Python installation a locked-down worker may read."""
        self.wake_read, self.wake_write = os.pipe()
        os.set_blocking(self.wake_write, False)

    def prepare(self) -> None:
        """Everything a worker would otherwise do first: the imports, the grammar vocabulary, libseccomp."""
        import argparse  # noqa: F401  (what runs import lazily, a share of a short run's CPU otherwise)
        import resource  # noqa: F401
        import secrets  # noqa: F401

        import numpy.random  # noqa: F401  (seeded sampling)

        from pie.generation.constraints import GrammarUnavailable, GrammarVocabulary, grammar_available

        if grammar_available():
            try:
                GrammarVocabulary.for_tokenizer(self.tokenizer, self.vocab)  # a worker's first grammar finds it
            except GrammarUnavailable:
                pass  # a worker that asks for a grammar gets this error itself
        if self.sandbox is not None:
            try:
                import pyseccomp  # noqa: F401  (its import runs ldconfig, which a locked-down worker cannot)
            except (ImportError, RuntimeError):
                pass  # the sandbox says so in each worker, where the policy decides whether it matters
            from pie.inferlet.sandbox import python_paths

            self.python = python_paths()  # what every worker finds the same: it imports nothing before it
        threads = _thread_count()
        if threads > 1:
            raise RuntimeError(f"the fork server runs {threads} threads after its start-up; it must run one")
        gc.freeze()  # what is made so far is never collected: a worker's collections do not copy its pages

    def serve(self) -> None:
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(self.wake_write)
        self.control.sendall(encode({"op": "ready", "pid": os.getpid()}))
        while True:
            readable, _, _ = select.select([self.control, self.wake_read], [], [])
            if self.wake_read in readable:
                os.read(self.wake_read, 4096)
                self.reap()
            if self.control in readable:
                try:
                    message, fds = read_with_fds(self.control, FORK_FDS)
                except WireError:
                    return  # the host is gone: so is the fork server (and, by PDEATHSIG, its workers)
                self.fork(message, fds)

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.control.sendall(encode({"op": "exited", "pid": pid, "status": os.waitstatus_to_exitcode(status)}))

    def fork(self, message: dict[str, Any], fds: list[int]) -> None:
        request = message.get("id")
        try:
            if message.get("op") != "fork" or len(fds) != FORK_FDS:
                raise OSError(f"a fork request needs op 'fork' and {FORK_FDS} descriptors")
            pid = os.fork()
        except OSError as exc:
            self.control.sendall(encode({"op": "forked", "id": request, "error": str(exc)}))
            _close(fds)
            return
        if pid == 0:
            self.become_worker(fds, str(message["workdir"]))
        _close(fds)
        pidfd = [os.pidfd_open(pid)] if hasattr(os, "pidfd_open") else []  # not reaped yet: it is this child
        send_with_fds(self.control, {"op": "forked", "id": request, "pid": pid}, pidfd)
        _close(pidfd)

    def become_worker(self, fds: list[int], workdir: str) -> None:
        """In the child: leave the fork server behind, serve one run, exit (never returns)."""
        code = 1
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            parent = os.getppid()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # no worker outlives the fork server
            if os.getppid() != parent:
                os._exit(1)
            sock_fd, rows_fd, stderr_fd = fds
            os.dup2(stderr_fd, 2)
            _close_all_but({0, 1, 2, sock_fd, rows_fd})  # the socket to the host and the wake-up pipe above all
            os.chdir(workdir)
            code = serve_one(socket.socket(fileno=sock_fd), rows_fd, self.tokenizer, self.vocab, self.sandbox,
                             self.python)
        except BaseException:  # the host sees the exit status; the traceback goes to the worker's stderr
            with contextlib.suppress(BaseException):
                traceback.print_exc()
        finally:  # whatever the inferlet did to its streams, the child never returns into the fork server's code
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)


def _thread_count() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        import threading

        return threading.active_count()


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _close_all_but(keep: set[int]) -> None:
    low = 0
    for fd in sorted(keep):
        if low < fd:  # closerange(n, n) would close every descriptor from n on (close_range's last is fd - 1)
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[1]))
    parent = _Parent(control, read_blocking(control))
    parent.prepare()
    parent.serve()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv)
    except BaseException:  # the host sees the exit status; the traceback goes to the fork server's stderr
        traceback.print_exc()
        code = 1
    sys.stderr.flush()
    os._exit(code)
