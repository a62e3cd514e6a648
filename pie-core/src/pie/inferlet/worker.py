"""An inferlet's worker process: `python -m pie.inferlet.worker SOCKET_FD ROWS_FD`, started by the host.

The worker runs the inferlet exactly as `pie run --inferlet` does, through the same
:class:`InferletHost`, :class:`Session` and :class:`Context`, over a
:class:`RemoteScheduler` that forwards every pass to the host's scheduler (and the
host batches it with everyone else's). Text is tokenized and detokenized here,
with a copy of the model's tokenizer; logits arrive in shared memory.

Its life: forked from the fork server (:mod:`pie.inferlet.zygote`), which has
imported everything and built the tokenizer, it locks itself down
(:mod:`pie.inferlet.sandbox`, when the policy asks), says ``ready``, waits in the
host's pool for a ``run``, runs it and sends the ``result``, saying how many threads
the run left running. The host may then send it another run of the same inferlet
(the host decides which runs may share a worker: :class:`pie.inferlet.workers.WorkerPool`),
which finds the inferlet's module as the last run left it; the worker exits when
the host closes its socket. Every message a run sends names it, so that the host
drops what an earlier run's leftovers send.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import io
import itertools
import os
import queue
import socket
import sys
import threading
import weakref
from collections.abc import Sequence as Seq
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

from pie.inferlet.fork_server import WORKER_ENVIRONMENT
from pie.inferlet.host import InferletHost, load_inferlet, run_in_new_loop
from pie.inferlet.wire import (
    LOGIT_ROWS,
    MAX_WORKER_MESSAGE,
    LogitRows,
    RowAllocator,
    WireError,
    encode,
    json_text,
    read_blocking,
)
from pie.model.tokenizer import Tokenizer
from pie.scheduler.core import PastContext, RequestTooLarge, SchedulerError


class RemoteError(RuntimeError):
    """The host refused an operation for a reason the inferlet cannot have caused by its own checks."""


class EngineFailure(RemoteError):
    """The engine failed a pass (a kernel's failure, memory it was short of, a lost device), as the host's reply
    marked it. The inferlet may catch it and go on; a run that ends with it is answered as the engine's failure,
    not the inferlet's (see :func:`ended_by`)."""


class Channel:
    """The worker's end of the socket: requests out (from the event loop's thread), replies in (a reader thread)."""

    def __init__(self, sock: socket.socket, rows: LogitRows):
        self._sock = sock
        self._rows = rows
        self._send_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._waiting: dict[int, tuple[Future[Any], tuple[int, int] | None]] = {}
        self._lock = threading.Lock()
        self._closed: BaseException | None = None
        self._runs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.row_allocator = RowAllocator()
        threading.Thread(target=self._read, name="pie-worker-reader", daemon=True).start()

    def next_run(self) -> dict[str, Any] | None:
        """The host's next ``run`` message, or None once the host has closed its end."""
        return self._runs.get()

    def send(self, message: dict[str, Any]) -> None:
        with self._send_lock:
            self._sock.sendall(encode(message))

    def request(self, message: dict[str, Any], rows: tuple[int, int] | None = None) -> Future[Any]:
        """Send ``message`` with a fresh id; the future gets the reply (the logit ``rows`` copied out, if any)."""
        future: Future[Any] = Future()
        with self._lock:
            if self._closed is not None:
                raise RemoteError(f"the host is gone: {self._closed}")
            request_id = next(self._ids)
            self._waiting[request_id] = (future, rows)
        self.send({**message, "id": request_id})
        return future

    def _read(self) -> None:
        try:
            while True:
                reply = read_blocking(self._sock)
                if reply.get("op") == "run":
                    self._runs.put(reply)
                    continue
                with self._lock:
                    future, rows = self._waiting.pop(int(reply["id"]))
                error = reply.get("error")
                if error is not None:
                    future.set_exception(_remote_error(error))
                elif rows is not None:
                    future.set_result(self._rows.read(*rows))
                else:
                    future.set_result(reply.get("value"))
        except (WireError, OSError, KeyError, ValueError) as exc:
            with self._lock:
                self._closed = exc
                waiting, self._waiting = self._waiting, {}
            for future, _ in waiting.values():
                future.set_exception(RemoteError(f"the host is gone: {exc}"))
            self._runs.put(None)


def _remote_error(error: dict[str, Any]) -> BaseException:
    kind, message = error.get("type"), str(error.get("message", "the host refused the operation"))
    if error.get("engine_failure") is True:
        return EngineFailure(message)
    if kind == "RequestTooLarge":
        return RequestTooLarge(*(int(error[key]) for key in ("tokens", "pages", "pool_pages", "page_size")))
    if kind == "ContextError":
        from pie.inferlet.context import ContextError

        return ContextError(message)
    if kind == "SchedulerError":
        return SchedulerError(message)
    if kind == "PastContext":
        return PastContext(message)
    if kind == "ValueError":
        return ValueError(message)
    return RemoteError(message)


class _RemotePages:
    def __init__(self, scheduler: RemoteScheduler, seq_id: int):
        self._scheduler = scheduler
        self._seq_id = seq_id

    @property
    def pages(self) -> list[int]:
        return list(self._scheduler.call({"op": "pages", "seq": self._seq_id}))


class RemoteSequence:
    """What a Context holds of its sequence: the host has the KV; here are its id and its history."""

    def __init__(self, sid: int, scheduler: RemoteScheduler):
        self.id = sid
        self.history: list[int] = []
        self.dropped = False
        self._scheduler = scheduler

    @property
    def device(self) -> _RemotePages:
        return _RemotePages(self._scheduler, self.id)


class _RemoteCore:
    def __init__(self, scheduler: RemoteScheduler):
        self._scheduler = scheduler

    def fork(self, parent: RemoteSequence) -> RemoteSequence:
        child = self._scheduler._sequence()
        child.history = list(parent.history)
        self._scheduler.send({"op": "fork", "seq": parent.id, "child": child.id})
        return child

    def drop(self, seq: RemoteSequence) -> None:
        if not seq.dropped:
            seq.dropped = True
            self._scheduler.send({"op": "drop", "seq": seq.id})


class _RemotePagePool:
    def __init__(self, scheduler: RemoteScheduler):
        self._scheduler = scheduler

    def refcount(self, page: int) -> int:
        return int(self._scheduler.call({"op": "refcount", "page": int(page)}))


class _RemoteConfig:
    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size


class _RemoteRunner:
    def __init__(self, scheduler: RemoteScheduler, vocab_size: int):
        self.config = _RemoteConfig(vocab_size)
        self.pages = _RemotePagePool(scheduler)


class RemoteScheduler:
    """The part of :class:`pie.scheduler.Scheduler` an inferlet's session uses, answered by the host, for one run:
    every message it sends names that run (``run``), so that the host drops what a run's leftovers (a thread, a
    signal handler) send once a later run has begun."""

    def __init__(self, channel: Channel, vocab_size: int, run: int):
        self.channel = channel
        self.run = run
        self.runner = _RemoteRunner(self, vocab_size)
        self.core = _RemoteCore(self)
        self._ids = itertools.count(1)
        self._rows_freed = asyncio.Condition()
        self.engine_failures: weakref.WeakSet[EngineFailure] = weakref.WeakSet()
        """The engine failures the run's passes raised in the inferlet (while it holds them)."""

    def send(self, message: dict[str, Any]) -> None:
        self.channel.send({**message, "run": self.run})

    def request(self, message: dict[str, Any], rows: tuple[int, int] | None = None) -> Future[Any]:
        return self.channel.request({**message, "run": self.run}, rows)

    def call(self, message: dict[str, Any]) -> Any:
        """A request answered before returning (for the inferlet API's few synchronous questions)."""
        return self.request(message).result()

    def _sequence(self) -> RemoteSequence:
        return RemoteSequence(next(self._ids), self)

    def new_sequence(self, priority: int = 0) -> RemoteSequence:
        seq = self._sequence()
        self.send({"op": "new", "seq": seq.id, "priority": int(priority)})
        return seq

    async def forward(
        self, seq: RemoteSequence, tokens: Seq[int], *, logits: bool = True, all_logits: bool = False
    ) -> np.ndarray | None:
        tokens = [int(t) for t in tokens]
        count = len(tokens) if all_logits else int(logits)
        if count > LOGIT_ROWS:
            raise ValueError(f"a served inferlet gets at most {LOGIT_ROWS} rows of logits from one pass, not {count}")
        start = 0
        if count:
            async with self._rows_freed:  # every row in flight: wait for a pass to give some back
                while (taken := self.channel.row_allocator.take(count)) is None:
                    await self._rows_freed.wait()
                start = taken
        message = {"op": "forward", "seq": seq.id, "tokens": tokens, "logits": bool(logits),
                   "all_logits": bool(all_logits), "row": start}
        try:
            result = await asyncio.wrap_future(self.request(message, (start, count) if count else None))
        except EngineFailure as exc:
            self.engine_failures.add(exc)
            raise
        finally:
            if count:
                self.channel.row_allocator.give(start, count)
                async with self._rows_freed:
                    self._rows_freed.notify_all()
        seq.history.extend(tokens)
        if not count:
            return None
        return result if all_logits else result[0]


def _lock_down(settings: dict[str, Any], python: tuple[str, ...]) -> list[str]:
    """The sandbox, with the working directory this process was started in (private, empty) and, readable,
    the Python installation (``python``: :func:`pie.inferlet.sandbox.python_paths`) and the folders the host
    names (where inferlets live). Of its environment only the thread settings it was started with stay: the
    tokenizers library reads its own at each call, and would start a thread pool in the middle of a run (which
    then looks like threads the run left behind)."""
    from pie.inferlet.sandbox import SandboxPolicy, lock_down

    policy = SandboxPolicy(
        workdir=os.getcwd(),
        memory_bytes=int(settings["memory_bytes"]),
        cpu_seconds=int(settings["cpu_seconds"]),
        read_only_paths=(*python, *(str(path) for path in settings["read_only"])),
        required=frozenset(settings["required"]),
        environment=WORKER_ENVIRONMENT,
    )
    return lock_down(policy)


MAX_SAID = 2000
"""The last characters of what a failed run wrote to stderr that its error carries."""
MAX_VALUE_BYTES = MAX_WORKER_MESSAGE - MAX_SAID - 1024
"""Most bytes of JSON an emitted value or a result may take: what the host reads in one message, less the rest
of the message."""


def serve_one(sock: socket.socket, rows_fd: int, tokenizer: Tokenizer, vocab: int,
              sandbox: dict[str, Any] | None, python: tuple[str, ...]) -> int:
    """Lock down (when ``sandbox`` says how; ``python``: what of the Python installation stays readable), say
    ``ready`` on ``sock``, run each inferlet the host sends until it closes the socket; the exit status.
    Called in a process just forked for it, in its private working directory."""
    rows = LogitRows(rows_fd, vocab, writable=False)
    status = os.open("/proc/self/status", os.O_RDONLY | os.O_CLOEXEC)  # the lock-down refuses /proc: opened before
    layers = [] if sandbox is None else _lock_down(sandbox, python)
    sock.sendall(encode({"op": "ready", "layers": layers, "pid": os.getpid()}))
    channel = Channel(sock, rows)
    loaded: dict[str, Any] = {}  # path -> the inferlet's main, imported by the first run that names it
    while (run := channel.next_run()) is not None:
        threads = _inferlet_threads(status)
        result = _run_one(channel, run, tokenizer, vocab, loaded)
        # A thread the run started and left running may send into the next run: the host then ends this worker.
        result["threads_left"] = max(_inferlet_threads(status) - threads, 0)
        channel.send({"op": "result", "run": run["run"], **result})
    return 0


def _inferlet_threads(status: int) -> int:
    """Threads of this process now but pie's own (``threading`` threads named ``pie-...``: its reader, the
    grammar's mask thread, which a run may start), from ``status``, a descriptor of /proc/self/status: every OS
    thread counts, those ``threading`` does not list too (``_thread``'s, a C extension's). This catches what an
    inferlet leaves running by mistake; an inferlet that means to outlive its run can name its thread ``pie-...``
    or replace this function, as any code in the process can: warm reuse trusts the installed inferlet (see
    examples/README.md)."""
    ours = sum(thread.name.startswith("pie-") for thread in threading.enumerate())
    for line in os.pread(status, 1 << 16, 0).splitlines():
        if line.startswith(b"Threads:"):
            return int(line.split()[1]) - ours
    raise RuntimeError("/proc/self/status names no thread count")


def _run_one(channel: Channel, run: dict[str, Any], tokenizer: Tokenizer, vocab: int,
             loaded: dict[str, Any]) -> dict[str, Any]:
    """One run, to the fields of its ``result`` message."""
    channel.row_allocator = RowAllocator()  # the host has ended every pass of the run before
    scheduler = RemoteScheduler(channel, vocab, int(run["run"]))
    host = InferletHost(scheduler, tokenizer, timeout_s=None, on_emit=lambda value: _emit(scheduler, value))  # type: ignore[arg-type]
    path = str(run["path"])
    if "source" in run:  # uploaded: into this worker's own folder (its working directory), which no other run reads
        path = Path(path).name
        Path(path).write_text(str(run["source"]), encoding="utf-8")
        sys.dont_write_bytecode = True  # the folder holds the source and what the inferlet writes, nothing of ours
    if path not in loaded:
        try:
            loaded[path] = load_inferlet(path)
        except Exception as exc:  # InferletLoadError and what importing it raised
            return {"error": str(exc), "where": "", "value": None, "engine_failure": False}
    # What the inferlet writes (argparse's usage, error and --help): nobody else reads a worker's output.
    said, printed = _Written(), _Written()
    name = str(run["name"])
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(printed):
        result = run_in_new_loop(host.run(loaded[path], [str(a) for a in run.get("args", [])], name=name), name)
    if result.error and said.getvalue().strip():
        result.error += f"; it wrote: {said.getvalue().strip()[-MAX_SAID:]}"
    elif result.exited and result.value is None:  # --help: what it printed is the answer
        result.value = printed.getvalue() or None
    try:
        _checked_size(result.value)
    except (TypeError, ValueError) as exc:
        return {"error": f"main returned {exc}", "where": "", "value": None, "engine_failure": False}
    return {"error": result.error, "where": result.where, "value": result.value,
            "engine_failure": ended_by(result.raised, scheduler.engine_failures)}


def ended_by(raised: BaseException | None, failures: weakref.WeakSet[EngineFailure]) -> bool:
    """Whether a run that ended with ``raised`` was ended by one of the engine ``failures`` its passes met:
    ``raised`` is one (uncaught, or caught and raised again), or holds one in the chain its traceback shows (its
    ``__cause__``, else its ``__context__`` unless raised ``from None``: wrapped, or raised while handling one),
    at any depth, or among an exception group's (an ``asyncio.TaskGroup`` whose task met one). An inferlet that
    caught the failure and went on, then failed, failed of its own, even where its message quotes the engine's;
    as does one whose exception cannot say its chain (an inferlet's class may make reading it raise)."""
    groups = getattr(builtins, "BaseExceptionGroup", ())  # (Python 3.11 on)
    held = list(failures)  # alive while compared: their ids are theirs
    ours = {id(failure) for failure in held}
    seen: set[int] = set()  # a chain that loops back is read once
    waiting = [raised]
    try:
        while waiting:
            exc = waiting.pop()
            if not isinstance(exc, BaseException) or id(exc) in seen:
                continue
            if id(exc) in ours:
                return True
            seen.add(id(exc))
            if exc.__cause__ is not None:
                waiting.append(exc.__cause__)
            elif not exc.__suppress_context__:
                waiting.append(exc.__context__)
            if isinstance(exc, groups):
                waiting.extend(exc.exceptions)
    except Exception:  # noqa: BLE001 - an inferlet's exception that fails to say its chain is its own failure
        return False
    return False


class _Written(io.StringIO):
    """What the inferlet writes to its stdout or stderr, kept when it closes them."""

    def close(self) -> None:
        pass


def _checked_size(value: Any) -> None:
    """TypeError or ValueError unless ``value`` is JSON of at most what the host reads in one message."""
    try:
        size = len(json_text(value))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"a value JSON cannot hold: {exc}") from None
    if size > MAX_VALUE_BYTES:
        raise ValueError(f"a value of {size} bytes of JSON, over the limit of {MAX_VALUE_BYTES}")


def _emit(scheduler: RemoteScheduler, value: Any) -> None:
    """An ``emit`` the host will take, or the error the inferlet sees at its ``emit`` call."""
    try:
        _checked_size(value)
    except ValueError as exc:
        raise ValueError(f"emit: {exc}") from None
    scheduler.send({"op": "emit", "value": value})
