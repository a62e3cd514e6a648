"""Served inferlets on the host side: a pool of pre-started worker processes, and the host's half of a run.

A run takes a worker from the pool (started, sandboxed and waiting), hands it the inferlet and its arguments,
and answers its messages: new sequences, forks, drops and forward passes, which go to the one batch scheduler
like any request's, so every worker's passes are batched with everyone else's. The host half is the only judge
of a run: it checks every message (a worker is untrusted code), counts the tokens, the emitted bytes and the
bytes its worker sends against the run's limits, and ends a run that overruns by SIGKILL, which nothing inside
the worker can refuse. However a run ends, its sequences are dropped (pages back). A worker taken for an
installed inferlet may then serve further runs of that inferlet (warm, as a function's instance serves its
next call), up to the pool's ``runs_per_worker``, but only after a run that ended with its result and no
error and left no thread running (every message names its run, and what an earlier run's leftovers send is
dropped); every other end (an error, a limit, a crash, cancellation, an uploaded inferlet) ends the worker, and
the pool forks another.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import os
import secrets
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pie.inferlet.context import ContextError
from pie.inferlet.fork_server import LOST_WITH_FORK_SERVER, Child, ForkServer, ForkServerError, describe_exit, last_line
from pie.inferlet.wire import (
    HEADER,
    LOGIT_ROWS,
    MAX_WORKER_MESSAGE,
    BadMessage,
    LogitRows,
    WireError,
    decode,
    encode,
    json_text,
)
from pie.scheduler.core import RequestTooLarge, SchedulerError, Sequence
from pie.scheduler.driver import Scheduler

START_TIMEOUT_S = 60.0
"""Longest a new worker may take from its fork to ready (the sandbox)."""
RESTART_PAUSE_S = 0.5
"""Pause after a worker (or the fork server) failed to start, before the next start may begin."""
EXIT_WAIT_S = 2.0
"""Longest a worker's end waits, after SIGKILL, for the fork server to report its exit."""
RUNS_PER_WORKER = 64
"""Runs of one installed inferlet a worker serves before it is ended (``pie serve --runs-per-worker``)."""
_CPU_SHARE_BEFORE_RETIRING = 0.5
"""A worker whose CPU time has reached this share of its sandbox's CPU limit serves no further run (the limit
counts its whole life, and the next run must not die of what earlier ones used)."""

WORKER_STDERR_BYTES = 64 * 2**10
"""What a worker's descriptor 2 holds (pie's own tracebacks, what C code and raw writes put there; the inferlet's
``sys.stderr`` is kept apart in the run): past it, a write fails with EPERM."""


def _stderr_file() -> int:
    """A worker's stderr: a memory file of WORKER_STDERR_BYTES sealed so that it cannot grow. A file in the host's
    temporary folder took whatever a worker wrote: up to its file-size limit, 256 MiB each (without a sandbox, all)."""
    fd = os.memfd_create("pie-worker-stderr", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, WORKER_STDERR_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
    except OSError:
        os.close(fd)
        raise
    return fd


MESSAGE_COST = 128
"""Bytes each message from a worker counts beside its own against ``RunLimits.received_bytes``: handling a small
one costs the host about what parsing 128 bytes of the costliest JSON (nested empty lists) does."""
RECEIVED_BYTES_PER_TOKEN = 1024
"""What a run's worker may send for each token of its budget: a decode step's pass takes about 220 bytes (its
message's and ``MESSAGE_COST``), the rest pays for the forks, drops and questions around the passes."""
EMIT_COST = 128
"""Bytes each emitted value counts beside its JSON text against ``RunLimits.emit_bytes``: about what the host holds
for one beside its text until its client reads it (its event, and the list that carries it)."""
SMALL_MESSAGE = 256
"""The most bytes a message takes beside the tokens of a pass (the values of an emit or a result are counted
against the emit budget and ``RunLimits.received_bytes``)."""


@dataclass(frozen=True)
class RunLimits:
    token_budget: int = 100_000
    """Tokens all of a run's forward passes may take together."""
    wall_seconds: float = 300.0
    emit_bytes: int = 8 << 20
    """Bytes a run may emit in all: each value's JSON text, and ``EMIT_COST`` more for each."""
    sequences: int = 4096
    """Sequences (contexts) a run may have open at once."""

    @property
    def received_bytes(self) -> int:
        """Bytes a run's worker may send the host in all, each message counted with ``MESSAGE_COST`` more: its
        emit budget, and ``RECEIVED_BYTES_PER_TOKEN`` for each token of its token budget. The host reads no message
        past it (the run is stopped), so what a worker costs the host in parsing follows from its budgets."""
        return self.emit_bytes + self.token_budget * RECEIVED_BYTES_PER_TOKEN


@dataclass
class RunOutcome:
    value: Any = None
    error: str | None = None
    where: str = ""
    failure: BaseException | None = None
    """The engine's failure of a pass (a kernel's) that ended the run, what a server answers it as: its worker said
    the inferlet ended with the exception a failed pass raised, or one raised from it or while handling it
    (:func:`pie.inferlet.worker.ended_by`); the run's first failure where it met several. None where it met none,
    or caught them and then failed of its own."""

    @property
    def ok(self) -> bool:
        return self.error is None


class Worker:
    """One worker process, ready for a run."""

    def __init__(self, child: Child, fork_server: ForkServer, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, rows: LogitRows, workdir: Path, stderr_fd: int):
        self.child = child
        self.fork_server = fork_server
        self.reader = reader
        self.writer = writer
        self.rows = rows
        self.workdir = workdir
        self._stderr_fd = stderr_fd
        self.layers: list[str] = []
        self.last_words = ""
        """The last line the worker wrote to its stderr, read when it ended."""
        self.inferlet: str | None = None
        """The installed inferlet (its path) this worker was taken for and may serve again; None: one run only."""
        self.runs = 0
        """Runs it has ended cleanly (its result, no error)."""
        self.given_back = 0.0
        """When it last went back to its pool, warm (``time.monotonic``)."""
        self._ended: str | None = None

    @property
    def running(self) -> bool:
        return not self.child.exited.done() and self._ended is None

    def cpu_seconds(self) -> float | None:
        """CPU time the process has used (None where /proc does not say)."""
        try:
            with open(f"/proc/{self.child.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def kill(self) -> None:
        self.child.kill()

    async def end(self) -> str:
        """Kill the process (if it still runs), wait for its exit, release everything; returns how it ended."""
        if self._ended is not None:
            return self._ended
        self.kill()
        self.writer.close()
        try:
            status: int | None = await asyncio.wait_for(asyncio.shield(self.child.exited), EXIT_WAIT_S)
        except TimeoutError:
            status = None
        self.child.release()
        self.last_words = last_line(self._stderr_fd)
        os.close(self._stderr_fd)
        self.rows.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
        self._ended = describe_exit(status)
        if status == LOST_WITH_FORK_SERVER:
            self._ended += f" (which {self.fork_server.lost})"
        return self._ended


async def read_message(reader: asyncio.StreamReader,
                       admit: Callable[[int], None] = lambda size: None) -> tuple[dict[str, Any], int]:
    """The next message from a worker and its size in bytes. ``admit(size)`` is called before its body is read,
    and may refuse it by raising."""
    try:
        (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
        if size > MAX_WORKER_MESSAGE:
            raise BadMessage(f"a message of {size} bytes is over the limit of {MAX_WORKER_MESSAGE}")
        admit(size)
        return decode(await reader.readexactly(size)), size
    except asyncio.IncompleteReadError:
        raise WireError("the worker closed its end") from None


class WorkerPool:
    """``size`` workers started ahead of need, each forked, sandboxed and waiting for a run.

    Every worker is forked from one fork server (:mod:`pie.inferlet.fork_server`), started with the pool
    and started again when it dies. Besides them the pool keeps, up to ``size`` in all, workers that have
    served an installed inferlet and wait for its next run (:meth:`take` with ``inferlet``, then
    :meth:`give_back`).
    """

    def __init__(self, tokenizer_json: str, vocab: int, size: int, sandbox: dict[str, Any] | None,
                 runs_per_worker: int = RUNS_PER_WORKER):
        """``sandbox`` (None: none) is what each worker locks itself down to: ``memory_bytes``, ``cpu_seconds``,
        ``read_only`` (folders it may read beside the Python installation: where inferlets are) and
        ``required`` (layers without which a worker refuses to start; see :mod:`pie.inferlet.sandbox`).
        ``runs_per_worker``: the most runs of one installed inferlet a worker serves (1: a new process for
        every run)."""
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, not {size}")
        if runs_per_worker < 1:
            raise ValueError(f"a worker serves at least one run, not {runs_per_worker}")
        self._init = {"op": "init", "tokenizer": tokenizer_json, "vocab": vocab, "sandbox": sandbox}
        self.vocab = vocab
        self.size = size
        self.runs_per_worker = runs_per_worker
        self._cpu_limit = float(sandbox["cpu_seconds"]) if sandbox and sandbox.get("cpu_seconds") else None
        self._ready: asyncio.Queue[Worker] = asyncio.Queue()
        self._warm: dict[str, list[Worker]] = {}
        """Workers that served an installed inferlet (by its path) and may serve it again, the newest last."""
        self._starting: set[asyncio.Task[None]] = set()
        self._fork_server: ForkServer | None = None
        self._fork_server_lock = asyncio.Lock()
        self.failures: list[str] = []
        """Why recent workers failed to start (the newest last)."""
        self.start_seconds: deque[float] = deque(maxlen=100)
        """How long recent workers took from the fork request to ready (the newest last)."""

    def start(self) -> None:
        for _ in range(self.size):
            self._spawn()

    def _spawn(self) -> None:
        """Start a worker, unless the ready ones and those starting make the pool's size already: a replacement
        asked for by a path that did not pair with a take would otherwise grow the pool for good."""
        if self._ready.qsize() + len(self._starting) >= self.size:
            return
        task = asyncio.get_running_loop().create_task(self._start_one())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def fork_server(self) -> ForkServer:
        """The fork server, started (again, when the last one died) if need be."""
        async with self._fork_server_lock:
            if self._fork_server is None or not self._fork_server.alive:
                if self._fork_server is not None:
                    await self._fork_server.close()
                server = ForkServer(self._init)
                await server.start()
                self._fork_server = server
            return self._fork_server

    async def _start_one(self) -> None:
        try:
            with ExitStack() as undo:  # what a failed start leaves is closed and removed (a cancel's too)
                host_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                undo.callback(host_end.close)
                with worker_end:  # the worker has its own copy once forked
                    rows = LogitRows.create(self.vocab)
                    undo.callback(rows.close)
                    workdir = Path(tempfile.mkdtemp(prefix="pie-inferlet-"))  # the sandbox wants it empty
                    undo.callback(shutil.rmtree, workdir, ignore_errors=True)
                    stderr_fd = _stderr_file()
                    undo.callback(os.close, stderr_fd)
                    fork_server = await self.fork_server()
                    asked = time.perf_counter()
                    child = await fork_server.fork([worker_end.fileno(), rows.fd, stderr_fd], str(workdir))
                undo.pop_all()  # the worker's now
        except (ForkServerError, OSError) as exc:  # no fork server, or no descriptor left (EMFILE), no disk
            self.failures = [*self.failures[-9:], f"a worker could not be started: {exc}"]
            await asyncio.sleep(RESTART_PAUSE_S)  # no tight loop of starts that fail
            return
        reader, writer = await asyncio.open_unix_connection(sock=host_end)
        worker = Worker(child, fork_server, reader, writer, rows, workdir, stderr_fd)
        try:
            ready, _ = await asyncio.wait_for(read_message(reader), START_TIMEOUT_S)
            if ready.get("op") != "ready":
                raise WireError(f"a worker answered {ready.get('op')!r} to its start")
            worker.layers = [str(layer) for layer in ready.get("layers", [])]
            self.start_seconds.append(time.perf_counter() - asked)
        except (WireError, TimeoutError, OSError) as exc:
            how = await worker.end()
            self.failures = [*self.failures[-9:], f"a worker {how} while starting ({exc}): {worker.last_words}"]
            await asyncio.sleep(RESTART_PAUSE_S)  # no tight loop of starts that fail
            return
        self._ready.put_nowait(worker)

    @property
    def ready_count(self) -> int:
        """Workers started and waiting for a run."""
        return self._ready.qsize()

    @property
    def warm_count(self) -> int:
        """Workers waiting for another run of the installed inferlet they served."""
        return sum(len(workers) for workers in self._warm.values())

    async def take(self, inferlet: str | None = None) -> Worker:
        """A worker for a run: for an installed ``inferlet`` (its path) one that served it before where one
        waits, else a ready one (waiting for one if none is), and another is started in its place. A worker
        taken with ``inferlet`` may serve it again: hand it to :meth:`give_back` after its run."""
        warm = self._warm.get(inferlet or "")
        while warm:
            worker = warm.pop()
            if worker.running:
                return worker
            await worker.end()
        worker = await self._take_ready()
        worker.inferlet = inferlet
        return worker

    async def give_back(self, worker: Worker) -> None:
        """After a run: keep ``worker`` for its inferlet's next run where it may serve one, else end it."""
        if not self._may_serve_again(worker):
            await worker.end()
            return
        assert worker.inferlet is not None
        worker.given_back = time.monotonic()
        self._warm.setdefault(worker.inferlet, []).append(worker)
        if self.warm_count > self.size:  # the one idle longest goes (each list's first is its longest idle)
            oldest = min((workers for workers in self._warm.values() if workers), key=lambda w: w[0].given_back)
            await oldest.pop(0).end()

    def _may_serve_again(self, worker: Worker) -> bool:
        if worker.inferlet is None or not worker.running or worker.runs == 0 or worker.runs >= self.runs_per_worker:
            return False
        if self._cpu_limit is None:
            return True
        used = worker.cpu_seconds()
        return used is not None and used < _CPU_SHARE_BEFORE_RETIRING * self._cpu_limit

    async def _take_ready(self) -> Worker:
        while True:
            if self._ready.empty() and not self._starting:
                self._spawn()  # every start failed: keep trying, the caller's own deadline bounds the wait
            worker = await self._next_ready()
            if worker is None:
                continue  # every start in progress ended without a worker (a fork server died): start again
            self._spawn()
            if worker.running:
                return worker
            await worker.end()

    async def _next_ready(self) -> Worker | None:
        """The next ready worker, or None once no start in progress can give one."""
        if not self._ready.empty():
            return self._ready.get_nowait()
        getter = asyncio.ensure_future(self._ready.get())
        try:
            while not getter.done() and self._starting:
                await asyncio.wait({getter, *self._starting}, return_when=asyncio.FIRST_COMPLETED)
            if not getter.done():
                getter.cancel()
            await asyncio.wait({getter})
        except asyncio.CancelledError:
            getter.cancel()
            if getter.done() and not getter.cancelled():
                self._ready.put_nowait(getter.result())  # taken just as the caller gave up: keep it
            raise
        return None if getter.cancelled() else getter.result()

    async def close(self) -> None:
        for task in list(self._starting):
            task.cancel()
        await asyncio.gather(*self._starting, return_exceptions=True)
        while not self._ready.empty():
            await self._ready.get_nowait().end()
        warm, self._warm = self._warm, {}
        for workers in warm.values():
            for worker in workers:
                await worker.end()
        if self._fork_server is not None:
            await self._fork_server.close()


class RunStopped(Exception):
    """The host ended a run (a limit, a protocol violation); the message says why."""


_RUN_NUMBERS = itertools.count(1)


@dataclass
class _Run:
    scheduler: Scheduler
    worker: Worker
    limits: RunLimits
    on_tokens: Callable[[int, int], None]
    """Called with (prompt tokens, generation tokens) as each pass is done (see :func:`serve_run`)."""
    on_emit: Callable[[bytes], None]
    """Called with each value the inferlet emits, as its JSON text (see :func:`serve_run`)."""
    sequences: dict[int, Sequence] = field(default_factory=dict)
    cache_salt: str = field(default_factory=lambda: secrets.token_hex(16))
    """Its sequences' prefix-cache salt, its own: they find only this run's pages in the cache, and no other run or
    request finds theirs (an inferlet's page refcounts would tell it which prompts others have cached)."""
    number: int = field(default_factory=lambda: next(_RUN_NUMBERS))
    """What every message of this run names as its ``run`` (every run's is another)."""
    leftovers: bool = False
    """Whether something of this run or an earlier one is left in its worker: a thread the run left running, or
    a message an earlier run's leftovers sent (dropped); the worker then serves no further run."""
    named: dict[int, int] = field(default_factory=dict)
    """Each page a ``pages`` answer has named, to the sequence it named it for: the one a refcount of it asks about."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    failure: BaseException | None = None
    """The first pass of the run that the engine failed (not one the scheduler refused): see RunOutcome.failure."""
    tokens: int = 0
    emitted: int = 0
    received: int = 0
    """Bytes its worker has sent, as ``RunLimits.received_bytes`` counts them."""
    expected: int = 0
    """Passes the worker is likely computing (one after its run's start, one after each pass answered) and
    has not sent yet, nor its result: the scheduler's next step waits a moment for them (``Scheduler.expect``)."""

    async def serve(self) -> RunOutcome:
        while True:
            message, size = await read_message(self.worker.reader, self.admit)
            op = message["op"]
            handler = self.check(message, size)
            if _int(message, "run") != self.number:  # sent by what an earlier run in this worker left running
                self.leftovers = True
                continue
            if self.expected and op in ("forward", "result"):
                self.expected -= 1
                self.scheduler.arrived()
            try:
                if (outcome := handler(self, message)) is not None:
                    return outcome
            except (SchedulerError, ContextError, ValueError) as exc:  # what an honest worker's Context never asks
                raise RunStopped(f"the worker's {op!r} could not be done: {exc}") from None
            # A worker that does not read its replies is not read either: they never pile up in the host, and a burst
            # of requests for them holds the engine's loop no longer than the transport's buffer takes to fill.
            await self.worker.writer.drain()
            if op == "forward":
                await asyncio.sleep(0)  # the pass it started reaches the scheduler before the next message

    def admit(self, size: int) -> None:
        self.received += size + MESSAGE_COST
        if self.received > self.limits.received_bytes:
            raise RunStopped(f"the inferlet's worker sent more than the {self.limits.received_bytes} bytes its budgets "
                             "let it send")

    def check(self, message: dict[str, Any], size: int) -> _Handler:
        """The handler of ``message``, which holds nothing the protocol has no place for and is no larger than what
        it carries needs; RunStopped otherwise."""
        op = message["op"]
        if op not in _OPS:
            raise RunStopped(f"the worker sent an unknown message {op!r:.100}")
        keys, handler = _OPS[op]
        if extra := message.keys() - keys:
            raise RunStopped(f"the worker's {op!r} carried what the protocol has no place for: {sorted(extra)!r:.200}")
        if op not in ("emit", "result"):
            tokens = message.get("tokens")
            digits = len(str(self.worker.rows.vocab - 1)) + 1  # a token id's, and a comma
            needed = SMALL_MESSAGE + (digits * len(tokens) if isinstance(tokens, list) else 0)
            if size > needed:
                raise RunStopped(f"the worker's {op!r} took {size} bytes, more than the {needed} it needs")
        return handler

    def result(self, message: dict[str, Any]) -> RunOutcome:
        value = message.get("value")
        json_text(value)  # its client is sent it: strict JSON text, or ValueError
        self.leftovers |= _int(message, "threads_left") > 0
        error = _text(message.get("error"))
        ended_by = _bool(message, "engine_failure") and error is not None
        failure = self.failure if ended_by else None
        return RunOutcome(value, error, _text(message.get("where")) or "", failure)

    def reply(self, message: dict[str, Any]) -> None:
        self.worker.writer.write(encode(message))

    def refuse(self, request_id: int, exc: Exception, *, engine_failure: bool = False) -> None:
        """Answer request ``request_id`` with ``exc``, which the worker raises where the inferlet asked: as an
        ``EngineFailure`` where ``engine_failure`` says the engine failed the pass it asked for."""
        error = {"type": type(exc).__name__, "message": str(exc), "engine_failure": engine_failure}
        self.reply({"op": "reply", "id": request_id, "error": error})

    def sequence(self, message: dict[str, Any], key: str = "seq") -> Sequence:
        seq = self.sequences.get(_int(message, key))
        if seq is None:
            raise RunStopped(f"the worker named a sequence it never made ({message.get(key)!r})")
        return seq

    def new_id(self, message: dict[str, Any], key: str) -> int:
        sid = _int(message, key)
        if sid in self.sequences:
            raise RunStopped(f"the worker reused the sequence id {sid}")
        if len(self.sequences) >= self.limits.sequences:
            raise RunStopped(f"the inferlet opened more than {self.limits.sequences} contexts at once")
        return sid

    def on_new(self, message: dict[str, Any]) -> None:
        sid = self.new_id(message, "seq")
        priority = min(_int(message, "priority"), 0)  # never above others
        self.sequences[sid] = self.scheduler.new_sequence(priority, cache_salt=self.cache_salt)

    def on_fork(self, message: dict[str, Any]) -> None:
        parent = self.sequence(message)
        sid = self.new_id(message, "child")
        self.sequences[sid] = self.scheduler.core.fork(parent)

    def on_drop(self, message: dict[str, Any]) -> None:
        seq = self.sequence(message)
        del self.sequences[_int(message, "seq")]
        self.scheduler.core.drop(seq)

    def on_pages(self, message: dict[str, Any]) -> None:
        seq = self.sequence(message)
        pages = list(seq.device.pages) if seq.device else []
        self.named.update(dict.fromkeys(pages, _int(message, "seq")))
        self.reply({"op": "reply", "id": _int(message, "id"), "value": pages})

    def on_refcount(self, message: dict[str, Any]) -> None:
        """How many sequences hold a page that one of the run's holds (the one a ``pages`` answer named it for), all
        of them the run's own (its cache salt sees to that); any other page is refused."""
        page, request_id = _int(message, "page"), _int(message, "id")
        sid = self.named.get(page)
        seq = None if sid is None else self.sequences.get(sid)
        if seq is None or seq.device is None or page not in seq.device.pages:
            self.refuse(request_id, ValueError(f"page {page} is not held by this run's contexts (a context's "
                                               "kv_pages() names those it holds)"))
            return
        self.reply({"op": "reply", "id": request_id, "value": self.scheduler.runner.pages.refcount(page)})

    def on_emit(self, message: dict[str, Any]) -> None:
        text = json_text(message.get("value"))
        self.emitted += len(text) + EMIT_COST
        if self.emitted > self.limits.emit_bytes:
            raise RunStopped(f"the inferlet emitted more than {self.limits.emit_bytes} bytes")
        self.on_emit(text)

    def on_forward(self, message: dict[str, Any]) -> None:
        seq = self.sequence(message)
        request_id = _int(message, "id")
        tokens = message.get("tokens")
        vocab = self.worker.rows.vocab
        if not isinstance(tokens, list) or not tokens or not all(type(t) is int and 0 <= t < vocab for t in tokens):
            raise RunStopped("the worker sent a pass whose tokens are not ids of the vocabulary")
        self.tokens += len(tokens)
        if self.tokens > self.limits.token_budget:
            raise RunStopped(f"the inferlet's passes took more than its budget of {self.limits.token_budget} tokens")
        all_logits, logits = _bool(message, "all_logits"), _bool(message, "logits")
        rows = len(tokens) if all_logits else int(logits)
        row = _int(message, "row")
        if rows and not 0 <= row <= LOGIT_ROWS - rows:
            raise RunStopped(f"the worker asked for logit rows {row}..{row + rows} of {LOGIT_ROWS}")
        continues = len(tokens) == 1 and bool(seq.history)
        task = asyncio.ensure_future(self._forward(request_id, seq, tokens, logits, all_logits, row, continues))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _forward(self, request_id: int, seq: Sequence, tokens: list[int], logits: bool, all_logits: bool,
                       row: int, continues: bool) -> None:
        try:
            result = await self.scheduler.forward(seq, tokens, logits=logits, all_logits=all_logits)
        except RequestTooLarge as exc:
            error = {"type": "RequestTooLarge", "message": str(exc), "tokens": exc.tokens, "pages": exc.pages,
                     "pool_pages": exc.pool_pages, "page_size": self.scheduler.core.page_size}
            self.reply({"op": "reply", "id": request_id, "error": error})
            return
        except Exception as exc:  # (the scheduler's refusals, and a kernel's failure: the inferlet may go on)
            engine_failure = not isinstance(exc, (SchedulerError, ValueError))
            if engine_failure and self.failure is None:
                self.failure = exc
            self.refuse(request_id, exc, engine_failure=engine_failure)
            return
        if continues:
            self.on_tokens(0, 1)
        else:
            self.on_tokens(len(tokens), 0)
        if result is not None:
            self.worker.rows.write(row, result if all_logits else result[None])
        self.reply({"op": "reply", "id": request_id})
        self.expected += 1
        self.scheduler.expect()

    async def close(self, keep_worker: bool) -> str:
        """End the run's passes and drop its sequences; end the worker too unless ``keep_worker``."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for seq in self.sequences.values():
            self.scheduler.core.drop(seq)
        self.sequences.clear()
        self.scheduler.arrived(self.expected)
        self.expected = 0
        return "kept" if keep_worker else await self.worker.end()


_Handler = Callable[[_Run, dict[str, Any]], RunOutcome | None]
_OPS: dict[str, tuple[frozenset[str], _Handler]] = {
    op: (frozenset({"op", "run", *keys.split()}), handler) for op, keys, handler in (
        ("new", "seq priority", _Run.on_new),
        ("fork", "seq child", _Run.on_fork),
        ("drop", "seq", _Run.on_drop),
        ("pages", "seq id", _Run.on_pages),
        ("refcount", "page id", _Run.on_refcount),
        ("emit", "value", _Run.on_emit),
        ("forward", "seq tokens logits all_logits row id", _Run.on_forward),
        ("result", "value error where threads_left engine_failure", _Run.result),
    )
}
"""Each message a worker may send: the keys it may hold (every one names its run), and its handler (the result's
ends the run)."""


def _int(message: dict[str, Any], key: str) -> int:
    value = message.get(key)
    if type(value) is not int:
        raise RunStopped(f"the worker sent {key}={value!r:.100} where an integer belongs")
    return value


def _bool(message: dict[str, Any], key: str) -> bool:
    value = message.get(key)
    if type(value) is not bool:
        raise RunStopped(f"the worker sent {key}={value!r:.100} where true or false belongs")
    return value


def _text(value: Any) -> str | None:
    """The worker's words on how a run ended, for its client: a lone surrogate in them is replaced (with '?'), not
    refused as in a value, so that the failure is still told."""
    return None if value is None else str(value)[:2000].encode("utf-8", "replace").decode()


async def serve_run(
    scheduler: Scheduler,
    worker: Worker,
    name: str,
    path: str | Path,
    args: list[str],
    limits: RunLimits,
    on_emit: Callable[[bytes], None],
    *,
    source: str | None = None,
    on_tokens: Callable[[int, int], None] = lambda prompt, generation: None,
) -> RunOutcome:
    """Run one inferlet in ``worker`` to its end; never raises for what the inferlet did. With ``source`` (an
    upload) the worker writes it to ``path``, a file name, in its own folder, and runs that.

    ``on_emit`` gets each value the inferlet emits as its JSON text (UTF-8), which is all the host keeps of it:
    a client is sent that text as it is, and the emit budget counts it.

    ``on_tokens(prompt, generation)`` counts each pass as it is done. The worker samples, out of the host's
    sight, so a pass is counted by its shape: one token continuing a context is a decode step, its token
    generation; any other pass (a prompt, a fill) is prompt tokens. The last token a context samples and
    never forwards is not counted.

    The run's sequences are dropped however it ended (result, error, a limit, the worker's death,
    cancellation of this coroutine). The worker is ended too, except after a run that ended with its
    result and no error in a worker taken for this inferlet (``WorkerPool.take(inferlet)``), and left nothing
    running there (a thread; a message of an earlier run reaching this one says something was), which then
    goes back to its pool (``WorkerPool.give_back``).
    """
    if worker.inferlet is not None and worker.inferlet != str(path):
        raise ValueError(f"a worker taken for {worker.inferlet} cannot run {path}")
    run = _Run(scheduler, worker, limits, on_tokens, on_emit)
    outcome: RunOutcome | None = None
    try:
        run_message = {"op": "run", "run": run.number, "name": name, "path": str(path), "args": list(args)}
        worker.writer.write(encode(run_message if source is None else {**run_message, "source": source}))
        run.expected += 1  # its first pass, most likely
        scheduler.expect()
        outcome = await asyncio.wait_for(run.serve(), limits.wall_seconds)
    except TimeoutError:
        outcome = RunOutcome(error=f"inferlet {name!r} did not finish within {limits.wall_seconds:g} s and was stopped")
    except RunStopped as exc:
        outcome = RunOutcome(error=f"inferlet {name!r} was stopped: {exc}")
    except BadMessage as exc:
        outcome = RunOutcome(error=f"inferlet {name!r} was stopped: its worker broke the protocol ({exc})")
    except (WireError, OSError):
        pass  # the worker died: how, it tells once it is reaped
    finally:
        clean = (outcome is not None and outcome.ok and worker.inferlet is not None and worker.running
                 and not run.leftovers)
        how = await run.close(keep_worker=clean)
        if clean:
            worker.runs += 1
    if outcome is None:
        said = f" ({worker.last_words})" if worker.last_words else ""
        outcome = RunOutcome(error=f"inferlet {name!r} ended without a result: its worker {how}{said}")
    return outcome
