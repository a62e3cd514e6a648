"""A stand-in for a Ray actor's method, for tests of the ingress without a cluster."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ActorCall:
    """An actor method: ``.remote().future()`` is a concurrent future of what ``answer`` returns or raises."""

    def __init__(self, answer: Callable[[], Any]):
        self.answer = answer

    def remote(self) -> ActorCall:
        return self

    def future(self) -> Future[Any]:
        done: Future[Any] = Future()
        try:
            done.set_result(self.answer())
        except Exception as exc:
            done.set_exception(exc)
        return done
