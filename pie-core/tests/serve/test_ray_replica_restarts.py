"""The ingress restarts a replica whose server exited or could not load its model, and gives it up past a bound.

Ray restarts a replica's actor only when its process dies; a server that stopped inside a live actor is the
ingress's to notice. Here the replicas are stand-in actor handles whose process the test scripts (its pid, its
server's phase, whether it answers at all), ``ray.kill`` is recorded instead of done, and the ingress's clock is
the test's: every decision is one ``watch_once`` at a chosen time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

pytest.importorskip("ray", reason="pie serve --ray needs the ray extra")
pytest.importorskip("fastapi", reason="pie serve needs the serve extra")

import pie.serve.ray as ray_serve  # noqa: E402
from actor_calls import ActorCall  # noqa: E402
from pie.serve.app import ServeSettings  # noqa: E402
from pie.serve.ray import RESTART_DELAY_S, RESTART_LIMIT, RESTART_WINDOW_S, Ingress  # noqa: E402

PAGE = 16
PROMPT = list(range(1000, 1000 + 4 * PAGE))
MAX_POLLS = 1000
"""Polls any scenario below may take: a loop that does not end within them fails its test."""


class ScriptedActor:
    """A replica's actor handle whose process the test controls; ``kills`` counts the ingress's ``ray.kill``."""

    def __init__(self, index: int):
        self.index = index
        self.pid = 100 + index
        self.phase = "ready"
        self.error: str | None = None
        self.alive = True
        self.kills = 0
        self.info = ActorCall(self._info)
        self.tokenizer_json = ActorCall(lambda: None)

    def _info(self) -> dict[str, Any]:
        if not self.alive:
            raise RuntimeError("The actor is temporarily unavailable: it is restarting.")
        return {"index": self.index, "url": f"http://replica-{self.index}", "pid": self.pid, "node": "n",
                "phase": self.phase, "error": self.error, "page_size": PAGE}

    def die(self) -> None:
        """The process is gone; Ray is starting another."""
        self.alive = False

    def come_back(self, phase: str, error: str | None = None) -> None:
        """Ray's new process answers, its server in ``phase``."""
        self.alive, self.pid, self.phase, self.error = True, self.pid + 1000, phase, error


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def kill(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """``ray.kill`` recorded as (replica, no_restart), the actor's process left as the test scripts it."""
    calls: list[tuple[int, bool]] = []

    def recorded(handle: ScriptedActor, *, no_restart: bool = True) -> None:
        calls.append((handle.index, no_restart))
        handle.kills += 1

    monkeypatch.setattr(ray_serve.ray, "kill", recorded)
    yield calls


def _ingress(actors: list[ScriptedActor], clock: Clock) -> Ingress:
    return Ingress(ServeSettings(model="unused"), actors, clock=clock)


def _detail(ingress: Ingress, index: int) -> dict[str, Any]:
    return ingress.health()[0]["detail"][index]


def test_an_exited_replica_is_restarted_once_after_its_delay(kill: list[tuple[int, bool]]) -> None:
    clock = Clock()
    actors = [ScriptedActor(0), ScriptedActor(1)]
    ingress = _ingress(actors, clock)

    async def scenario() -> None:
        await ingress.watch_once()
        assert ingress.phase == "ready"
        assert ingress.router.choose(PROMPT, {1}).replica == 1  # replica 1 now holds the prompt's prefix
        ingress.router.finished(1)

        actors[1].phase, actors[1].error = "exited", "RuntimeError: the engine crashed"
        await ingress.watch_once()
        assert ingress.phase == "degraded" and ingress.available() == {0}
        clock.now = RESTART_DELAY_S / 2
        await ingress.watch_once()
        assert kill == []  # not before its delay

        clock.now = RESTART_DELAY_S
        await ingress.watch_once()
        assert kill == [(1, False)]  # no_restart=False: Ray starts the actor again
        assert _detail(ingress, 1)["status"] == "restarting" and ingress.available() == {0}

        actors[1].die()  # Ray restarts it; its calls fail meanwhile
        for _ in range(3):
            clock.now += 10 * RESTART_DELAY_S
            await ingress.watch_once()
        assert kill == [(1, False)] and _detail(ingress, 1)["status"] == "restarting"

        actors[1].come_back("loading")
        await ingress.watch_once()
        assert _detail(ingress, 1)["status"] == "loading" and ingress.available() == {0}
        actors[1].phase = "ready"
        await ingress.watch_once()
        assert ingress.phase == "ready" and ingress.available() == {0, 1}
        route = ingress.router.choose(PROMPT, {0, 1})  # what replica 1 held went with its process
        assert route is not None and route.reason == "least_loaded"

    asyncio.run(scenario())
    assert _detail(ingress, 1)["restarts"] == 1  # one new process, counted once
    assert ingress.registry.get_sample_value("pie:replica_restarts", {"replica": "1"}) == 1
    assert ingress.registry.get_sample_value("pie:ingress_restarts_total", {"replica": "1"}) == 1
    assert ingress.registry.get_sample_value("pie:ingress_restarts_total", {"replica": "0"}) is None


@pytest.mark.parametrize("phase", ["failed", "exited"])
def test_a_model_that_never_loads_is_given_up_past_the_limit(
        kill: list[tuple[int, bool]], capsys: pytest.CaptureFixture[str], phase: str) -> None:
    clock = Clock()
    actor = ScriptedActor(0)
    actor.phase, actor.error = phase, "no such model: /models/missing"
    ingress = _ingress([actor], clock)
    killed_at: list[float] = []

    async def scenario() -> None:
        for _ in range(MAX_POLLS):
            await ingress.watch_once()
            if ingress.phase == "failed":
                break
            if actor.kills > len(killed_at):
                killed_at.append(clock.now)
                actor.come_back(phase, "no such model: /models/missing")  # its new process fails the same way
            else:
                clock.now += 1.0
        for _ in range(20):  # given up: it stays down, whatever the time
            clock.now += RESTART_WINDOW_S
            await ingress.watch_once()

    asyncio.run(scenario())
    assert kill == [(0, False)] * RESTART_LIMIT
    waits = [later - earlier for earlier, later in zip([0.0, *killed_at], killed_at)]
    assert waits == [RESTART_DELAY_S * 2**k for k in range(RESTART_LIMIT)]  # each delay twice the one before
    body, status = ingress.health()
    assert status == 503 and body["status"] == "failed"
    assert body["detail"][0]["status"] == "given up"
    assert body["detail"][0]["error"] == "no such model: /models/missing"
    assert body["detail"][0]["restarts"] == RESTART_LIMIT
    assert ingress.registry.get_sample_value("pie:replicas_given_up") == 1
    said = [line for line in capsys.readouterr().err.splitlines() if "giving up" in line]
    assert len(said) == 1 and "replica 0" in said[0] and "no such model" in said[0], said

    async def replaced_by_ray() -> None:  # its node came back, say, and Ray started the actor anew
        actor.come_back("ready")
        await ingress.watch_once()

    asyncio.run(replaced_by_ray())
    assert ingress.phase == "ready" and ingress.available() == {0}
    assert ingress.registry.get_sample_value("pie:replicas_given_up") == 0


def test_restarts_spread_wider_than_the_window_never_give_up(kill: list[tuple[int, bool]]) -> None:
    clock = Clock()
    actor = ScriptedActor(0)
    ingress = _ingress([actor], clock)
    crashes = 3 * RESTART_LIMIT

    async def scenario() -> None:
        for _ in range(crashes):
            actor.phase = "exited"
            for _ in range(MAX_POLLS):  # down until restarted
                await ingress.watch_once()
                if actor.kills:
                    break
                clock.now += 1.0
            actor.kills = 0
            actor.come_back("ready")
            await ingress.watch_once()
            clock.now += RESTART_WINDOW_S / 2  # a crash now and then: at most two in any window

    asyncio.run(scenario())
    assert len(kill) == crashes
    assert ingress.phase == "ready" and _detail(ingress, 0)["restarts"] == crashes


def test_a_draining_ingress_restarts_nothing(kill: list[tuple[int, bool]]) -> None:
    clock = Clock()
    actor = ScriptedActor(0)
    ingress = _ingress([actor], clock)

    async def scenario() -> None:
        await ingress.watch_once()
        await ingress.drain(0)
        actor.phase = "exited"
        for _ in range(10):
            clock.now += RESTART_WINDOW_S
            await ingress.watch_once()

    asyncio.run(scenario())
    assert kill == [] and ingress.phase == "draining" and _detail(ingress, 0)["status"] == "exited"


def test_a_replica_ray_restarts_meanwhile_is_not_killed_again(kill: list[tuple[int, bool]]) -> None:
    """Its server exited, and before its delay ran out its process died too: Ray's restart is the one it needs."""
    clock = Clock()
    actor = ScriptedActor(0)
    ingress = _ingress([actor], clock)

    async def scenario() -> None:
        actor.phase = "exited"
        await ingress.watch_once()
        actor.die()
        for _ in range(5):
            clock.now += RESTART_DELAY_S
            await ingress.watch_once()
        assert _detail(ingress, 0)["status"] == "unavailable"
        actor.come_back("loading")
        await ingress.watch_once()

    asyncio.run(scenario())
    assert kill == [] and _detail(ingress, 0)["status"] == "loading" and _detail(ingress, 0)["restarts"] == 1


def test_the_killed_process_answering_once_more_is_not_killed_twice(kill: list[tuple[int, bool]]) -> None:
    """A kill takes a moment: the old process may answer one more poll, still exited, before it dies."""
    clock = Clock()
    actor = ScriptedActor(0)
    ingress = _ingress([actor], clock)

    async def scenario() -> None:
        actor.phase = "exited"
        await ingress.watch_once()
        clock.now = RESTART_DELAY_S
        await ingress.watch_once()
        assert kill == [(0, False)]
        clock.now += ray_serve.WATCH_INTERVAL_S
        await ingress.watch_once()  # the same pid, still exited
        actor.die()
        clock.now += ray_serve.WATCH_INTERVAL_S
        await ingress.watch_once()
        actor.come_back("ready")
        await ingress.watch_once()

    asyncio.run(scenario())
    assert kill == [(0, False)] and ingress.phase == "ready" and _detail(ingress, 0)["restarts"] == 1


def test_health_says_degraded_as_soon_as_a_request_finds_a_replica_failed() -> None:
    """/health said ready, with one of two replicas ready, until the watcher's next poll (5 s and more while another
    replica's actor is frozen: each poll waits for it): a replica a request found failed, or taken out of routing,
    changed the count at once and the status only then."""
    ingress = _ingress([ScriptedActor(0), ScriptedActor(1)], Clock())
    asyncio.run(ingress.watch_once())
    assert ingress.health()[0]["status"] == "ready"
    ingress.replica_failed(0, ConnectionResetError("reset by peer"))
    body, status = ingress.health()
    assert (status, body["status"], body["replicas"]["ready"]) == (200, "degraded", 1), body
    asyncio.run(ingress.watch_once())  # its actor answers: ready again
    for _ in range(ray_serve.FAILURES_IN_A_ROW):
        ingress._failed(1, "answered 500")
    body, status = ingress.health()
    assert (status, body["status"], body["replicas"]["ready"]) == (200, "degraded", 1), body


class FrozenCall:
    """An actor method of a frozen process: its calls never answer."""

    def remote(self) -> FrozenCall:
        return self

    def future(self) -> Future[Any]:
        return Future()


ROUND_TIMEOUT_S = 30.0
"""Far more than a watch round takes (WATCH_INTERVAL_S at most, per pending call), far less than the actor timeout
the test below sets."""


def test_a_frozen_actor_does_not_hold_the_watch_of_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each poll waited ACTOR_CALL_TIMEOUT_S for a frozen actor's answer, and a watch round waited for all its polls:
    one frozen replica held every other replica's state, the streams' silence bound and the restarts as long each
    round."""
    monkeypatch.setattr(ray_serve, "ACTOR_CALL_TIMEOUT_S", 4 * ROUND_TIMEOUT_S)
    actors = [ScriptedActor(0), ScriptedActor(1)]
    ingress = _ingress(actors, Clock())

    async def scenario() -> None:
        await ingress.watch_once()
        actors[0].info = FrozenCall()
        actors[1].phase, actors[1].error = "exited", "RuntimeError: the engine crashed"
        await asyncio.wait_for(ingress.watch_once(), ROUND_TIMEOUT_S)

    asyncio.run(scenario())
    assert _detail(ingress, 1)["status"] == "exited" and ingress.phase == "degraded"
    assert _detail(ingress, 0)["status"] == "ready"  # (not late yet: its call is pending)


def test_a_replica_whose_engine_stalls_is_routed_around_and_back_once_its_step_returns(
    kill: list[tuple[int, bool]],
) -> None:
    """A replica's server says stalled while its engine's step runs past --stall-seconds (see ServerState.phase): no
    new request goes to it, nothing restarts it (the step may yet return; its requests in flight wait for it)."""
    clock = Clock()
    actors = [ScriptedActor(0), ScriptedActor(1)]
    ingress = _ingress(actors, clock)

    async def scenario() -> None:
        await ingress.watch_once()
        actors[1].phase = "stalled"
        for _ in range(3):
            clock.now += 10 * RESTART_DELAY_S
            await ingress.watch_once()
        assert ingress.phase == "degraded" and ingress.available() == {0}
        assert _detail(ingress, 1)["status"] == "stalled" and kill == []
        actors[1].phase = "ready"
        await ingress.watch_once()
        assert ingress.phase == "ready" and ingress.available() == {0, 1}

    asyncio.run(scenario())


def _stall(actor: ScriptedActor) -> None:
    actor.phase = "stalled"
    actor.error = f"the engine's step of replica {actor.index} has run for 700.0 s (bound --stall-seconds 600)"


def test_every_replica_stalled_is_the_ingress_stalled_unless_one_may_come_back_first(
    kill: list[tuple[int, bool]],
) -> None:
    """With every replica stalled the ingress said loading, as if the replicas were loading a model, and refused new
    requests as having no replica: nothing said that their engines hung. One loading beside the stalled ones may serve
    before any stall ends: that is still loading; one given up never serves again: the rest's stalls are the story."""
    clock = Clock()
    actors = [ScriptedActor(0), ScriptedActor(1), ScriptedActor(2)]
    ingress = _ingress(actors, clock)

    async def scenario() -> None:
        await ingress.watch_once()
        _stall(actors[0])
        _stall(actors[1])
        actors[2].phase = "loading"
        await ingress.watch_once()
        assert ingress.phase == "loading" and ingress.stall_error() is None
        assert ingress.health()[1] == 503 and "error" not in ingress.health()[0]

        _stall(actors[2])
        await ingress.watch_once()
        body, status = ingress.health()
        assert (status, body["status"]) == (503, "stalled"), body
        assert body["error"] == "3 of 3 replicas stalled: " + "; ".join(
            f"replica {i}: the engine's step of replica {i} has run for 700.0 s (bound --stall-seconds 600)"
            for i in range(3)), body
        refused = ingress.stall_error()
        assert refused is not None and (refused.status, refused.code) == (503, "engine_stalled")
        assert refused.message == body["error"] and refused.headers == {"Retry-After": "5"}
        assert ingress.registry.get_sample_value("pie:replicas_stalled") == 3

        actors[2].phase, actors[2].error = "failed", "no such model: /models/missing"  # and never loads again
        for _ in range(MAX_POLLS):
            await ingress.watch_once()
            if _detail(ingress, 2)["status"] == "given up":
                break
            if actors[2].kills:
                actors[2].kills = 0
                actors[2].come_back("failed", "no such model: /models/missing")
            clock.now += 1.0
        assert _detail(ingress, 2)["status"] == "given up"
        body, status = ingress.health()
        assert (status, body["status"]) == (503, "stalled"), body
        assert body["error"].startswith("2 of 3 replicas stalled (1 given up): replica 0: "), body

        actors[1].phase, actors[1].error = "ready", None  # its step returned
        await ingress.watch_once()
        assert ingress.phase == "degraded" and ingress.stall_error() is None and ingress.available() == {1}
        assert ingress.registry.get_sample_value("pie:replicas_stalled") == 1

    asyncio.run(scenario())
    assert kill == [(2, False)] * RESTART_LIMIT  # (a stalled replica is never restarted)
