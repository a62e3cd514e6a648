"""How a worker tells the host that the engine's failure of a pass ended its run: the host marks the failure in its
reply, the worker raises it as an EngineFailure and says, in its result, whether the run ended with it. The text of
the run's error decided before: an inferlet that quoted the failure in an error of its own was answered as the
engine's failure, one that wrapped it in words of its own as its own."""

from __future__ import annotations

import socket
import sys
import weakref
from typing import Any

import pytest
from pie.inferlet.wire import LogitRows, encode
from pie.inferlet.worker import Channel, EngineFailure, RemoteError, ended_by


def test_the_worker_raises_what_the_host_marked_as_the_engines_failure_as_an_engine_failure() -> None:
    replies: list[dict[str, Any]] = [
        {"type": "KernelFailed", "message": "kernel embed failed: out of memory", "engine_failure": True},
        {"type": "KernelFailed", "message": "kernel embed failed: out of memory", "engine_failure": False},
        {"type": "ValueError", "message": "not a token", "engine_failure": False},
    ]
    host_end, worker_end = socket.socketpair()
    rows = LogitRows.create(4)
    try:
        channel = Channel(worker_end, rows)
        futures = [channel.request({"op": "forward"}) for _ in replies]
        for request_id, error in enumerate(replies, 1):
            host_end.sendall(encode({"op": "reply", "id": request_id, "error": error}))
        raised = [future.exception(timeout=30) for future in futures]
    finally:
        host_end.close()  # the reader thread ends on it
        worker_end.close()
        rows.close()
    assert type(raised[0]) is EngineFailure and str(raised[0]) == "kernel embed failed: out of memory"
    assert type(raised[1]) is RemoteError
    assert type(raised[2]) is ValueError


def ended_with(body: str, failure: EngineFailure) -> BaseException:
    """What ``body`` ends with: code run with ``fail()``, which raises ``failure`` as a failed pass does, and
    ``caught()``, which returns it once raised and caught (as a task group gathers it)."""
    def fail() -> None:
        raise failure

    def caught() -> BaseException:
        try:
            fail()
        except EngineFailure as exc:
            return exc
        raise AssertionError("fail() raised nothing")

    try:
        exec(body, {"fail": fail, "caught": caught, "EngineFailure": EngineFailure})
    except BaseException as exc:  # noqa: BLE001 - what the inferlet's run would end with
        return exc
    raise AssertionError("the body raised nothing")


CATCH = "try:\n    fail()\nexcept Exception as exc:\n"
ENDINGS = {
    "uncaught": ("fail()\n", True),
    "raised-again": (CATCH + "    raise\n", True),
    "raised-again-later": (CATCH + "    saved = exc\nraise saved\n", True),
    "wrapped": (CATCH + "    raise RuntimeError('the generation failed') from exc\n", True),
    "wrapped-twice": (CATCH + "    try:\n        raise RuntimeError('one') from exc\n    except RuntimeError as one:\n"
                      "        raise RuntimeError('two') from one\n", True),
    "raised-while-handling": (CATCH + "    raise RuntimeError('the generation failed')\n", True),
    "swallowed": (CATCH + "    said = str(exc)\nraise ValueError(f'a bug of its own, not {said}')\n", False),
    "from-none": (CATCH + "    raise ValueError(f'a bug of its own, not {exc}') from None\n", False),
    "from-another": (CATCH + "    raise ValueError('a bug of its own') from KeyError('its own')\n", False),
    "a-lookalike": ("raise EngineFailure('kernel embed failed: out of memory')\n", False),
    "a-group": ("raise ExceptionGroup('tasks failed', [ValueError('a bug'), caught()])\n", True),
    "wrapped-group": ("raise RuntimeError('x') from ExceptionGroup('tasks failed', [caught()])\n", True),
    "its-own-group": ("raise ExceptionGroup('its own', [ValueError('a bug')])\n", False),
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_run_ended_by_the_engine_failure_is_the_failure_or_raised_from_it_or_while_handling_it(ending: str) -> None:
    body, expected = ENDINGS[ending]
    if "Group" in body and sys.version_info < (3, 11):
        pytest.skip("exception groups are Python 3.11's")
    failure = EngineFailure("kernel embed failed: out of memory")
    raised = ended_with(body, failure)
    assert ended_by(raised, weakref.WeakSet([failure])) is expected
    assert ended_by(raised, weakref.WeakSet()) is False, "no pass of the run failed: the failure is its own"


def test_an_exception_that_cannot_say_its_chain_or_whose_chain_loops_is_the_inferlets_own() -> None:
    class Liar(Exception):
        @property  # type: ignore[misc]
        def __cause__(self) -> BaseException:
            raise RuntimeError("no chain here")

    first, second = ValueError("one"), ValueError("two")
    first.__context__, second.__context__ = second, first
    failures: weakref.WeakSet[EngineFailure] = weakref.WeakSet([EngineFailure("kernel embed failed")])
    assert ended_by(Liar("a bug"), failures) is False
    assert ended_by(first, failures) is False
    assert ended_by(None, failures) is False
