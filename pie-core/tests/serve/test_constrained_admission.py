"""Output constraints and the server's places: a full server refuses a constrained request before it compiles
anything, a compiling request holds its place, and compiles take turns (the model served in this process, its
grammar engine watched)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn
from pie.generation import constraints
from pie.generation.constraints import GrammarSpec
from pie.runtime.llm import LLM
from pie.serve import app as serve_app
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.testing.serve_process import wait_until

pytest.importorskip("llguidance", reason="constrained output needs the grammar extra")


@contextmanager
def serving(state: ServerState) -> Iterator[str]:
    """The application under uvicorn on a thread of this process, on a free loopback port; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(create_app(state), host="127.0.0.1", port=0, log_config=None,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: server.started, timeout=60)
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)


def engine_compiles(monkeypatch: pytest.MonkeyPatch, then: Callable[[GrammarSpec], None] = lambda spec: None
                    ) -> list[GrammarSpec]:
    """The specs the grammar engine is asked to compile from now on; ``then`` runs in the compile, after each is
    noted (to hold it)."""
    asked: list[GrammarSpec] = []
    engine_grammar = constraints._engine_grammar

    def noting(spec: GrammarSpec) -> str:
        asked.append(spec)
        then(spec)
        return engine_grammar(spec)

    monkeypatch.setattr(constraints, "_engine_grammar", noting)
    return asked


def constrained(url: str, pattern: str) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"prompt": "Code:", "max_tokens": 4, "guided_regex": pattern})


def in_background(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def test_a_full_server_refuses_a_constrained_request_before_compiling_it(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At capacity a plain request got its 503 at once, but one with a large schema compiled it first (28 s
    under contention, beside the running requests) and got the same 503 then. Here the running request's
    generation waits (its grammar takes its first token only once released) while another comes."""
    generating, release = threading.Event(), threading.Event()
    accept = constraints.Matcher.accept

    def held_accept(matcher: constraints.Matcher, token: int) -> None:
        generating.set()
        assert release.wait(30)
        accept(matcher, token)

    monkeypatch.setattr(constraints.Matcher, "accept", held_accept)
    asked = engine_compiles(monkeypatch)
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=4096)
    state = ServerState(ServeSettings(served_model_name="tiny", max_running=1, max_waiting=0), llm)
    with serving(state) as url:
        running, answers = in_background(lambda: constrained(url, "[0-9]{3}"))
        try:
            assert wait_until(lambda: generating.is_set() and state.working == 1, timeout=30)
            asked.clear()  # (the running request's own compile)
            refused = constrained(url, "[a-z]{3}")
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "overloaded", refused.text
            assert asked == [], "nothing was compiled for a request the server had no place for"
        finally:
            release.set()
            running.join(60)
        assert answers[0].status_code == 200, answers[0].text


def test_a_request_holds_its_place_while_its_constraint_compiles(
    tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request counted nowhere while it compiled: at --max-running 1 --max-waiting 0, any number of requests
    compiled at once, and each was refused only afterwards (or went past the limits)."""
    compiling, release = threading.Event(), threading.Event()

    def hold_the_first(spec: GrammarSpec) -> None:
        if spec.source == "[0-9]{3}":
            compiling.set()
            assert release.wait(30)

    asked = engine_compiles(monkeypatch, hold_the_first)
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=4096)
    state = ServerState(ServeSettings(served_model_name="tiny", max_running=1, max_waiting=0), llm)
    with serving(state) as url:
        first, answers = in_background(lambda: constrained(url, "[0-9]{3}"))
        try:
            assert compiling.wait(30)
            assert state.working == 1, "the compiling request holds its place"
            refused = constrained(url, "[a-z]{3}")
            assert refused.status_code == 503, refused.text
        finally:
            release.set()
            first.join(60)
        assert answers[0].status_code == 200, answers[0].text
        assert [spec.source for spec in asked] == ["[0-9]{3}"]
        assert state.working == 0
        assert constrained(url, "[a-z]{3}").status_code == 200, "its place is given back"


def test_constraints_compile_in_turns(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every constrained request compiled at once, up to the 40 threads that tokenizing and building responses
    share with them; with one turn (GRAMMAR_COMPILES 1) a second compile waits, without a thread, for the first."""
    monkeypatch.setattr(serve_app, "GRAMMAR_COMPILES", 1)
    compiling, release = threading.Event(), threading.Event()
    running: list[str] = []
    most = [0]

    def hold_the_first(spec: GrammarSpec) -> None:
        running.append(spec.source)
        most[0] = max(most[0], len(running))
        if spec.source == "[0-9]{3}":
            compiling.set()
            assert release.wait(30)
        running.remove(spec.source)

    asked = engine_compiles(monkeypatch, hold_the_first)
    llm = LLM.load(str(tiny_model), "cpu", max_cached_tokens=4096)
    state = ServerState(ServeSettings(served_model_name="tiny", max_running=4, max_waiting=4), llm)
    with serving(state) as url:
        first, first_answers = in_background(lambda: constrained(url, "[0-9]{3}"))
        second, second_answers = None, []
        try:
            assert compiling.wait(30)
            second, second_answers = in_background(lambda: constrained(url, "[a-z]{3}"))
            assert wait_until(lambda: state.working == 2, timeout=30), "the second request holds its place"
            assert [spec.source for spec in asked] == ["[0-9]{3}"], "and waits for its turn to compile"
        finally:
            release.set()
            first.join(60)
            if second is not None:
                second.join(60)
    assert [answer.status_code for answer in first_answers + second_answers] == [200, 200]
    assert [spec.source for spec in asked] == ["[0-9]{3}", "[a-z]{3}"] and most[0] == 1
