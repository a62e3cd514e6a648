"""Running inferlets: user programs ``async def main(ctx, args)``, many at once over one scheduler.

Each runs as an asyncio task with its own :class:`Session`; their forward passes
are batched together. One that raises, runs past its timeout or asks for more KV
cache than fits ends with a clear error and its pages back; the others go on.
Others run while an inferlet awaits; one whose code runs past its timeout without
awaiting (a runaway loop) is stopped from a watchdog thread (see
:mod:`pie.inferlet.watchdog`), so it holds the others up for its timeout at most.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import inspect
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pie.inferlet.forks import forks_refused, without_forks
from pie.inferlet.session import Session
from pie.inferlet.tasks import end_generators, end_tasks, held_tasks
from pie.inferlet.watchdog import InferletStalled, UserInterrupt, Watchdog
from pie.model.tokenizer import Tokenizer
from pie.scheduler.core import RequestTooLarge, SchedulerConfig
from pie.scheduler.driver import Scheduler

if TYPE_CHECKING:
    from pie.runtime.llm import LLM

InferletMain = Callable[[Session, list[str]], Awaitable[Any]]

DEFAULT_TIMEOUT_S = 600.0


class InferletLoadError(RuntimeError):
    """An inferlet file cannot be loaded (missing, broken, or without ``async def main(ctx, args)``)."""


@dataclass
class InferletResult:
    name: str
    value: Any = None
    error: str | None = None
    """One line saying what went wrong; None on success."""
    details: str = ""
    """The traceback, when the inferlet raised."""
    where: str = ""
    """Where in the inferlet's own file it raised (``file:line in function: code``), if it did there."""
    raised: BaseException | None = field(default=None, repr=False, compare=False)
    """The exception it ended with (none where it returned, exited or ran out of time)."""
    elapsed_s: float = 0.0
    dropped_contexts: int = 0
    """Contexts still open when it ended, dropped by the host (their pages returned)."""
    exited: bool = False
    """It ended by ``sys.exit`` (argparse's ``--help`` among them), not by returning."""

    @property
    def ok(self) -> bool:
        return self.error is None


def load_inferlet(path: str | Path) -> InferletMain:
    """Import an inferlet (a file, or a package folder) and return its ``main``."""
    path = Path(path)
    try:
        resolved = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # absent, a link that leads nowhere, a loop of links (RuntimeError)
        why = getattr(exc, "strerror", None) or exc
        raise InferletLoadError(f"{path}: no such inferlet file or package ({why})") from None
    name = f"pie_inferlet_{path.stem}_{abs(hash(resolved))}"
    if path.is_dir() and (path / "__init__.py").is_file():
        spec = importlib.util.spec_from_file_location(
            name, path / "__init__.py", submodule_search_locations=[str(path)]
        )
    elif path.is_file():
        spec = importlib.util.spec_from_file_location(name, path)
    elif path.is_dir():
        raise InferletLoadError(f"{path}: a folder without __init__.py is no inferlet package")
    elif path.exists():
        raise InferletLoadError(f"{path}: not a Python file or package (a device, a FIFO or a socket)")
    else:
        raise InferletLoadError(f"{path}: no such inferlet file or package")
    if spec is None or spec.loader is None:
        raise InferletLoadError(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        with forks_refused():
            spec.loader.exec_module(module)
    except BaseException as exc:  # its SystemExit, KeyboardInterrupt or own BaseException too: they are its failure
        sys.modules.pop(name, None)
        if isinstance(exc, UserInterrupt):
            raise  # the user's Ctrl-C
        if isinstance(exc, SystemExit):
            raise InferletLoadError(f"{path}: importing it exited with status {exc.code}") from None
        if isinstance(exc, InferletStalled):
            raise InferletLoadError(f"{path}: importing it did not finish in time and was stopped") from None
        raise InferletLoadError(f"{path}: importing it failed: {named(exc)}") from exc
    main = getattr(module, "main", None)
    if main is None or not inspect.iscoroutinefunction(main):
        raise InferletLoadError(f"{path}: an inferlet defines `async def main(ctx, args)`")
    if len(inspect.signature(main).parameters) != 2:
        raise InferletLoadError(f"{path}: main must take exactly (ctx, args)")
    return main


def run_in_new_loop(run: Coroutine[Any, Any, InferletResult], name: str) -> InferletResult:
    """``asyncio.run(run)``, a run of the inferlet ``name``: one that stops the event loop it runs on
    (``loop.stop()``) before it has ended fails, saying so, where asyncio raises a RuntimeError of its own."""
    raised: list[BaseException] = []

    async def watched() -> InferletResult:
        try:
            return await run
        except BaseException as exc:
            raised.append(exc)
            raise

    try:
        return asyncio.run(watched())
    except RuntimeError as exc:
        if any(exc is error for error in raised):
            raise  # the host's own
        return InferletResult(name, error=f"inferlet {name!r} stopped the event loop it runs on before it ended")


def named(exc: BaseException) -> str:
    """``Type: message``, or the type alone where the exception says nothing more (``raise KeyboardInterrupt``)."""
    message = describe(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def describe(exc: BaseException) -> str:
    """``str(exc)``, or a word on why it has none: an inferlet's exception may fail even to say what it is."""
    try:
        return str(exc)
    except Exception as failure:  # noqa: BLE001 - describing an error must not raise another
        return f"(its message could not be made: {type(failure).__name__})"


def positive_int(text: str) -> int:
    """An ``argparse`` type for the counts an inferlet takes (samples, beams, turns, tokens): a whole number
    of at least 1, or a usage error naming the argument."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not at least 1")
    return value


class _Exited(Exception):
    def __init__(self, code: object):
        super().__init__(code)
        self.code = code


class _Interrupted(Exception):
    def __init__(self, raised: KeyboardInterrupt):
        super().__init__(raised)
        self.raised = raised


async def _exits_as_errors(run: Awaitable[Any]) -> Any:
    """SystemExit (argparse on bad arguments, --help) and a KeyboardInterrupt the inferlet raises would stop the
    whole event loop (asyncio passes both on from any task): make them the inferlet's. A real Ctrl-C is none of
    these: ``asyncio.run`` turns it into the main task's cancellation, or, while the inferlet's code runs,
    :func:`~pie.inferlet.watchdog.interrupts_stop_inferlets` raises it there as a UserInterrupt, passed on."""
    try:
        return await run
    except SystemExit as exc:
        raise _Exited(exc.code) from None
    except UserInterrupt:
        raise
    except KeyboardInterrupt as exc:
        raise _Interrupted(exc) from None


async def _within(main: asyncio.Task[Any], timeout: float) -> Any:
    """The result of ``main``'s task, or TimeoutError once ``timeout`` has passed and it has been ended (see
    :func:`pie.inferlet.tasks.end_tasks`: ``asyncio.wait_for`` would wait without end for one that will not stop)."""
    try:
        done, _ = await asyncio.wait({main}, timeout=timeout)
    except asyncio.CancelledError:  # the host's stop (a Ctrl-C): asyncio.run waited for ever on one that will not end
        await end_tasks([main])
        raise
    if done:
        return main.result()
    await end_tasks([main])
    raise TimeoutError


def _host_cancelled() -> bool:
    """Whether the task running the host is being cancelled (a CancelledError the inferlet raises itself is not
    that: its task was never asked to stop). Before Python 3.11 a task cannot say so: every one is the host's."""
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is None or task is None or cancelling() > 0


def where_in(main: InferletMain, exc: BaseException) -> str:
    """The innermost line of ``exc``'s traceback in the file that defines ``main``, or ""."""
    code = getattr(main, "__code__", None)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if code and f.filename == code.co_filename]
    if not frames:
        return ""
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {frame.line}"


class InferletHost:
    """Runs inferlets against one model, batching all their forward passes."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        *,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        on_emit: Callable[[Any], None] | None = None,
    ):
        """``on_emit`` receives every value an inferlet emits (see ``Session.emit``)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.on_emit = on_emit
        self.watchdog = Watchdog()

    @classmethod
    def from_llm(
        cls,
        llm: LLM,
        *,
        host_pages: int | None = None,
        config: SchedulerConfig | None = None,
        timeout_s: float | None = DEFAULT_TIMEOUT_S,
        on_emit: Callable[[Any], None] | None = None,
    ) -> InferletHost:
        """A host over a loaded model; preempted contexts swap to ``host_pages`` host pages
        (default: half the device pool)."""
        if host_pages is None:
            host_pages = max(llm.runner.pages.num_pages // 2, 1)
        scheduler = Scheduler.create(llm.runner, host_pages=host_pages, config=config)
        return cls(scheduler, llm.tokenizer, timeout_s=timeout_s, on_emit=on_emit)

    async def run(
        self, main: InferletMain, args: Seq[str] = (), *, name: str = "inferlet", timeout_s: float | None = None
    ) -> InferletResult:
        """Run one inferlet to its end; never raises for the inferlet's own failures."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        session = Session(self.scheduler, self.tokenizer, name, self.on_emit)
        result = InferletResult(name)
        start = time.perf_counter()
        program = _exits_as_errors(without_forks(main(session, list(args))))
        try:
            if timeout is None:
                result.value = await program
            else:
                with held_tasks(self.watchdog, timeout) as tasks:
                    try:
                        result.value = await _within(tasks.start_main(self.watchdog.watch(program, timeout)), timeout)
                    finally:
                        await end_tasks(tasks.started)  # what it started ends with it
                        await end_generators(tasks)
        except _Exited as exc:
            result.exited = True
            if exc.code not in (0, None):
                result.error = f"inferlet {name!r} exited with status {exc.code}"
        except (TimeoutError, InferletStalled):
            result.error = f"inferlet {name!r} did not finish within {timeout:g} s and was stopped"
        except RequestTooLarge as exc:
            result.error = f"inferlet {name!r} asked for more KV cache than fits: {exc}"
            result.details, result.where, result.raised = traceback.format_exc(), where_in(main, exc), exc
        except KeyboardInterrupt:
            raise  # the user's own stop
        except BaseException as exc:  # an inferlet's own BaseException subclass too: it must not stop the host
            if isinstance(exc, asyncio.CancelledError) and _host_cancelled():
                raise  # the host's own stop, not one the inferlet raised
            raised = exc.raised if isinstance(exc, _Interrupted) else exc
            result.error = f"inferlet {name!r} raised {named(raised)}"
            try:
                result.details = "".join(traceback.format_exception(raised))
            except Exception:  # noqa: BLE001 - its message is what it could not make: the rest is told above
                result.details = ""
            result.where, result.raised = where_in(main, raised), raised
        finally:
            result.dropped_contexts = session.close()
            result.elapsed_s = time.perf_counter() - start
        return result

    async def run_many(self, programs: Iterable[tuple[str, InferletMain, Seq[str]]]) -> list[InferletResult]:
        """Run ``(name, main, args)`` programs concurrently; results in the same order."""
        return list(await asyncio.gather(*(self.run(main, args, name=name) for name, main, args in programs)))
