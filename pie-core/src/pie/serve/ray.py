"""`pie serve --ray`: replicas of the server on a Ray cluster, behind one OpenAI-compatible ingress.

A replica is the same server ``pie serve`` runs (:func:`pie.serve.server.run_server`), started
inside a Ray actor that holds one node's device (``num_cpus``/``num_gpus``/custom resources),
listening on that node's address. The ingress runs in the process that started them: it holds
no model, only the model's tokenizer (fetched from a replica), and proxies each request's HTTP
exchange to the replica the router chose (:mod:`pie.serve.router`), streaming included.

Faults: a request whose replica fails before any of its tokens reached the client is sent once
more, to another replica; a stream that already carried tokens ends with an error event (never a
silent truncation). A replica that fails without a word (its process frozen, its node cut off the
network: nothing resets the connections) fails its requests when the ingress gives up on it: its
actor silent for SILENT_LIMIT_S, its process replaced, or one of its streams silent for
STREAM_SILENCE_S. Ray restarts a dead replica (``max_restarts=-1``); the ingress watches each
replica through its actor and routes only to those whose server is ready, and not to one that failed
FAILURES_IN_A_ROW completions in a row (but for a probe now and then). A replica whose server
stopped while its actor lives on (it crashed, or the model could not load) the ingress has Ray
restart, a bounded number of times (``RESTART_LIMIT``). ``/health`` says ``degraded`` while fewer
replicas than wanted are ready, and ``stalled`` while every one it counts on is (new requests get 503
``engine_stalled``, as from a stalled ``pie serve``). ``/metrics`` holds the ingress's own numbers and every ready or
stalled replica's, each labelled ``replica``.

Ray is the ``ray`` extra (``pip install 'pie-core[ray]'``); only this module imports it, and only
when ``pie serve --ray`` runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from fastapi.sse import format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from pie.model.tokenizer import Tokenizer
from pie.runtime.kv_cache import cache_root
from pie.serve.app import (
    KEEPALIVE_S,
    LONG_TEXT,
    BodyLimit,
    RequestIds,
    ServerState,
    ServeSettings,
    UnexpectedErrors,
    allow_origins,
    http_api_error,
    key_rule,
    unless,
    unless_disconnected,
)
from pie.serve.auth import KeyCheck
from pie.serve.protocol import APIError, template_role
from pie.serve.responses import input_messages
from pie.serve.router import PrefixRouter, Route
from pie.serve.server import DrainingServer, listen, raise_open_file_limit, say, uvicorn_config
from pie.serve.streams import FastAPIWithConnections, ReleasingStream
from pie.sockets import keep_alive

WATCH_INTERVAL_S = 0.5
"""How often the ingress asks every replica's actor how its server is."""
ROUTING_PREFIX_CHARS = 32_768
"""How much of a prompt's text the ingress tokenizes to route it by its prefix: a prompt's start is what the prefix
cache shares, and all of a long one (up to the body limit, megabytes) would take the ingress seconds a request."""
ACTOR_CALL_TIMEOUT_S = 5.0
"""An actor that does not answer within this is counted as not ready (it may be restarting)."""
RESTART_DELAY_S = 5.0
"""How long a replica whose server stopped (exited, or failed to load the model) stays down before the ingress
kills its actor for Ray to start again; doubled for every restart of it the ingress made within RESTART_WINDOW_S."""
RESTART_LIMIT = 5
"""Restarts of one replica within RESTART_WINDOW_S after which the ingress gives it up: it stays down, and
``/health`` says why. Five delays (5 s to 80 s, 155 s in all) let a passing cause pass (a device another process
held a moment, a shared file system's hiccup)."""
RESTART_WINDOW_S = 3600.0
"""Long against a model's load, so a model that can never load is given up within it however slowly it fails;
short against the time between rare crashes, so a replica that crashes now and then always comes back."""
DOWN = ("exited", "failed")
"""A replica's server phases that only a new process leaves."""
SILENT_LIMIT_S = 20.0
"""How long a replica's actor may stay not answering or unavailable before the ingress ends the requests in flight on
it (a stream with an error event; one not answered yet goes to another replica): a frozen process, or a node cut off
the network, resets no connection, and its requests would wait for ever. Ray's own calls to a busy replica answer
within ACTOR_CALL_TIMEOUT_S: silent four times that long, its process is taken for gone."""
STREAM_SILENCE_S = 3 * KEEPALIVE_S
"""How long the ingress waits on a stream that sends nothing before it ends the stream as its replica's failure: a
replica's stream sends a keepalive comment every KEEPALIVE_S however long its next token takes, so only a frozen
server or a broken network is silent this long. (A whole answer, not streamed, is silent until it is done, however
long that takes: it has no such bound; the watcher's verdict on its replica ends it, or the connection's TCP keepalive
when the replica's host is gone: UPSTREAM_PROBE_IDLE_S.)"""
FAILURES_IN_A_ROW = 3
"""Completions in a row a replica fails (it answers 5xx other than 503, or ends a stream with an error event of such a
status, or their clients leave before it answers, while it answers nothing to any request; and any request whose
connection to it fails: see Ingress.replica_failed) after which the ingress routes no more to it, until it answers one:
a replica whose device is lost, or whose engine is stuck, while its server and its actor say it is ready, would
otherwise take every request its prefixes draw. (Any answer in between, from any request on it, starts the count
again.)"""
NO_FAULT_CODES = ("out_of_memory", "shutting_down", "device_lost", "engine_stalled")
"""The error codes a replica's server answers 503 with (short of memory for this batch, draining, its device gone:
then its server says failed, and the ingress restarts it; its engine stalled: it says so, and the ingress routes
around it until it is ready again): what tells a 503 in a stream's error event from an older replica, whose events
carry no status (a replica's now carry theirs: see APIError.event_body). Like a 503 answer, they count against no
replica."""
PROBE_INTERVAL_S = 10.0
"""How often a replica taken out of routing that way is sent one request, to see whether it answers again."""
REPLICA_START_TIMEOUT_S = 120.0
"""How long a replica's actor waits for its server to listen before giving up."""
SCRAPE_TIMEOUT_S = 5.0
CONNECT_TIMEOUT_S = 5.0
CUT_GRACE_S = 5.0
"""After a drain's deadline, how long the requests it ends have to send their clients the error."""
SHUT_DOWN = "the server shut down before this request finished"
UPSTREAM_KEEPALIVE_S = 2.0
"""How long an idle connection to a replica is kept for the next request: under the replicas' own (uvicorn's
``timeout_keep_alive``, 5 s), so the ingress never sends a request on a connection the replica is closing, which
fails it as a replica's fault (a POST is not retried on a fresh connection)."""
UPSTREAM_PROBE_IDLE_S = 10
"""How long a connection to a replica may carry nothing before the ingress's kernel probes the replica's host (TCP
keepalive): a whole answer, not streamed, is silent until it is done, and a replica's host that dropped off the
network, or a path to it that a firewall's or NAT's dropped state cut, never says so. Ray's own path to the replica
may still work meanwhile (its actor answers, so the watcher sees nothing wrong)."""
UPSTREAM_PROBE_INTERVAL_S = 5
UPSTREAM_PROBES = 3
"""Probes unanswered after which the connection fails (a replica's failure, as a reset is): within
UPSTREAM_PROBE_IDLE_S + UPSTREAM_PROBES * UPSTREAM_PROBE_INTERVAL_S seconds (25) of silence. A replica's kernel answers
them however busy or frozen its process is: only its host or the network gone fails them."""
UPSTREAM_FAILED = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, aiohttp.ClientResponseError)
"""What a replica's connection breaking looks like: refused, reset, closed mid-answer, an answer that is not HTTP."""
FORWARDED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
RETURNED_HEADERS = ("content-type", "retry-after", "cache-control", "x-request-id")
ENV_PREFIX = "PIE_"
"""The ingress's environment variables that replicas get too (PIE_ENGINES, PIE_MODEL_DIR, ...)."""


# -- the replica: pie serve inside a Ray actor -------------------------------------


class Replica:
    """A Ray actor's body: ``run_server`` on a thread, on this node's address and a free port.

    The actor's own methods answer the ingress's questions about it; they never wait on the model.
    """

    def __init__(self, settings: ServeSettings, index: int, pin_cores: int | None = None):
        from pie.serve.server import run_server

        if pin_cores:
            _pin(index, pin_cores)
        self.index = index
        self.exit_code: int | None = None
        self._server: DrainingServer | None = None
        self._url: str | None = None
        self._error: str | None = None
        self._listening = threading.Event()
        host = ray.util.get_node_ip_address()

        def serve() -> None:
            try:
                self.exit_code = run_server(settings, host, 0, started=self._started)
            except BaseException as exc:  # noqa: B036 - reported through info(), the thread ends anyway
                self._error = f"{type(exc).__name__}: {exc}"
                self.exit_code = 1
            finally:
                self._listening.set()

        self._thread = threading.Thread(target=serve, name=f"pie-replica-{index}", daemon=True)
        self._thread.start()
        if not self._listening.wait(REPLICA_START_TIMEOUT_S):
            raise RuntimeError(f"replica {index}: the server did not listen within {REPLICA_START_TIMEOUT_S:g} s")
        if self._url is None:
            raise RuntimeError(f"replica {index}: the server did not start: {self._error}")

    def _started(self, server: DrainingServer, url: str) -> None:
        self._server, self._url = server, url
        self._listening.set()

    def info(self) -> dict[str, Any]:
        """Where the server listens and how it is: phase loading, ready, stalled, failed, draining or exited, and why
        it does not serve where it says (a stall's words, a failed load's or lost device's)."""
        assert self._server is not None
        state = self._server.state
        assert isinstance(state, ServerState)  # (run_server's)
        phase = "exited" if not self._thread.is_alive() else state.phase
        llm = state.llm
        error = state.phase_error(phase)
        return {
            "index": self.index,
            "url": self._url,
            "pid": os.getpid(),
            "node": ray.get_runtime_context().get_node_id(),
            "phase": phase,
            "error": error or self._error,
            "page_size": None if llm is None else llm.runner.page_size,
        }

    def tokenizer_json(self) -> str | None:
        """The model's tokenizer, for the ingress to route by tokens (None until the model is loaded)."""
        assert self._server is not None
        llm = getattr(self._server.state, "llm", None)
        return None if llm is None else llm.tokenizer.to_json()

    def drain(self) -> None:
        """Start the server's drain, as SIGTERM would."""
        if self._server is not None:
            self._server.handle_exit(15, None)


def _pin(index: int, count: int) -> None:
    """Hold replica ``index``'s threads to ``count`` cores of its own among this host's (the threads started
    from here on: the server's, the engine's, the kernels'). For several replicas sharing one host."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[(index * count + k) % len(cores)] for k in range(count)})


# -- the ingress ---------------------------------------------------------------------


class Loss:
    """Set once the requests in flight on one process of a replica are to end; ``why`` says why."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.why = ""

    def declare(self, why: str) -> None:
        if not self.event.is_set():
            self.why = why
            self.event.set()


class ReplicaLost(Exception):
    """A request's replica was given up on before it answered (by the watcher: no fault this request can tell)."""


@dataclass
class ReplicaView:
    """What the ingress knows of one replica."""

    index: int
    handle: Any
    url: str | None = None
    pid: int | None = None
    node: str | None = None
    phase: str = "starting"
    error: str | None = None
    restarts: int = 0
    """Times its process was seen replaced (by Ray after it died, or restarted by the ingress)."""
    down_since: float | None = None
    """When the ingress first saw this process's server stopped (its clock); None while it was not."""
    restarted_at: list[float] = field(default_factory=list)
    """When the ingress restarted it, within RESTART_WINDOW_S."""
    given_up: bool = False
    """Restarted RESTART_LIMIT times within RESTART_WINDOW_S and down again: the ingress restarts it no more."""
    pending: asyncio.Future[Any] | None = field(default=None, repr=False)
    asked_at: float = 0.0
    """When ``pending`` was asked (the event loop's clock: what its timeout is measured with)."""
    silent_since: float | None = None
    """When the ingress first found this replica's actor not answering or unavailable; None once it answers."""
    loss: Loss = field(default_factory=Loss, repr=False)
    """What ends the requests in flight on this replica's process when the ingress gives up on it (then a new one,
    for the next requests)."""
    failures: int = 0
    """Completions this process failed in a row."""
    failing: str | None = None
    """Why the ingress routes no requests to this process, but a probe every PROBE_INTERVAL_S: it failed
    FAILURES_IN_A_ROW completions in a row. None once it answers one, or its process is replaced."""
    probed_at: float = 0.0
    """When it was last sent a probe (the ingress's clock)."""
    progress: int = 0
    """Counts what it sent that shows its engine working: answers' heads, and stream chunks that carry events (not only
    keepalive comments, which its server sends however stuck its engine is)."""

    @property
    def ready(self) -> bool:
        return self.phase == "ready" and self.url is not None

    @property
    def stalled(self) -> bool:
        """Its server says its engine's step has run past --stall-seconds: routed no requests until the step returns,
        its server answers /health and /metrics all the same."""
        return self.phase == "stalled" and self.url is not None

    @property
    def routed(self) -> bool:
        """Ready, and not failing: a replica the ingress sends requests to."""
        return self.ready and self.failing is None


class Ingress:
    """Routes OpenAI requests to the replicas, retries what a failure left unanswered, merges metrics."""

    def __init__(self, settings: ServeSettings, handles: list[Any], *, min_match: float = 0.5, balance_slack: int = 8,
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        """What the restarts' delays and window are measured with."""
        self.replicas = [ReplicaView(i, handle) for i, handle in enumerate(handles)]
        self.router = PrefixRouter(len(handles), min_match=min_match, balance_slack=balance_slack)
        self.tokenizer: Tokenizer | None = None
        self.draining = False
        self.in_flight = 0
        self.client: aiohttp.ClientSession | None = None
        self.registry = CollectorRegistry()
        self.requests = Counter("pie:ingress_requests", "Requests the ingress sent to a replica, by replica and "
                                "how it was chosen.", ["replica", "route"], registry=self.registry)
        self.retries = Counter("pie:ingress_retries", "Requests sent again to another replica after a failure "
                               "left them unanswered.", registry=self.registry)
        self.broken_streams = Counter("pie:ingress_broken_streams", "Streams ended with an error event because "
                                      "their replica failed after tokens were sent.", registry=self.registry)
        self.unanswered = Counter("pie:ingress_unavailable", "Requests answered 503 because no replica could take "
                                  "them.", registry=self.registry)
        self.restarted = Counter("pie:ingress_restarts", "Replicas the ingress restarted because their server had "
                                 "stopped (each also counts in pie:replica_restarts once its new process answers).",
                                 ["replica"], registry=self.registry)
        self.registry.register(_ReplicaGauges(self))
        self._watcher: asyncio.Task[None] | None = None
        self._announced = False
        self._cut = asyncio.Event()
        """Set once a drain's time is up: what is still in flight ends with an error (as ``ServerState.drain``)."""
        self._streaming: list[dict[aiohttp.ClientResponse, float | None]] = [{} for _ in handles]
        """Each replica's answers being streamed to clients now (closed when the drain cuts them, or the ingress gives
        up on the replica), each with when the ingress began waiting on it for more (None while it sends to its
        client)."""

    @property
    def phase(self) -> str:
        """The ingress's state as ``/health`` says it, from what it knows of its replicas now (a replica a request
        found failed counts at once, not at the watcher's next poll): ready (every replica routed to), degraded (some:
        failing ones are still tried when no other is ready), loading, stalled (none ready, and every one not given
        up is stalled: see :meth:`stall_error`), failed (every replica given up) or draining. None ready while one
        not given up is loading, restarting or not answering is loading: that one may come back before any stall
        ends."""
        if self.draining:
            return "draining"
        if any(view.ready for view in self.replicas):
            return "ready" if all(view.routed for view in self.replicas) else "degraded"
        counted = [view for view in self.replicas if not view.given_up]
        if not counted:
            return "failed"
        return "stalled" if all(view.stalled for view in counted) else "loading"

    def stall_error(self) -> APIError | None:
        """The 503 a new request gets while the ingress is stalled, naming its replicas' stalls (as ``pie serve``
        refuses one while its engine is stalled); else None."""
        if self.phase != "stalled":
            return None
        stalled = [view for view in self.replicas if view.stalled]
        given_up = len(self.replicas) - len(stalled)
        words = "; ".join(f"replica {view.index}: {view.error or 'no error reported'}" for view in stalled)
        return APIError(503, f"{len(stalled)} of {len(self.replicas)} replicas stalled"
                        f"{f' ({given_up} given up)' if given_up else ''}: {words}", code="engine_stalled",
                        headers={"Retry-After": "5"})

    # -- lifecycle

    async def start(self) -> None:
        # aiohttp rather than httpx: a third of httpx's CPU time per proxied request. No cookie jar (the
        # replicas' answers go to many clients), no redirects followed, no headers the client did not send
        # that change the answer (a Content-Type, an Accept-Encoding: the bytes are passed on as they come).
        self.client = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S,
                                           socket_factory=_upstream_socket),
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S),
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("Content-Type", "Accept-Encoding"))
        # The first poll runs in the watcher: replicas still starting answer it only after ACTOR_CALL_TIMEOUT_S,
        # and until start returns the server answers nothing, not even /health.
        self._watcher = asyncio.ensure_future(self._watch())

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        if self.client is not None:
            await self.client.close()

    async def drain(self, seconds: float) -> None:
        """Refuse new requests and let those in flight run for up to ``seconds`` (DrainingServer calls it); then
        end the rest with an error, a stream's as its last event, and wait (briefly) for them to be sent."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if not self.in_flight:
            return
        self._cut.set()
        for view in self.replicas:
            view.loss.declare(SHUT_DOWN)  # what waits for an answer stops: the cut tells _until_cut why
        for streams in self._streaming:
            for upstream in list(streams):
                upstream.close()  # its stream's next read fails, and _forward tells the client why
        deadline = loop.time() + CUT_GRACE_S
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)

    async def _until_cut(self, work: Awaitable[Any], loss: Loss) -> Any:
        """``work``'s result; APIError 503 (``work`` cancelled) when a drain's time runs out first, ReplicaLost when
        the ingress gives up on the replica it waits on (``loss``)."""
        finished, result = await unless(work, loss.event.wait())
        if not finished:
            if self._cut.is_set():
                raise APIError(503, SHUT_DOWN, code="shutting_down", headers={"Retry-After": "5"})
            raise ReplicaLost(loss.why)
        return result

    # -- watching the replicas

    async def _watch(self) -> None:
        while True:
            try:
                await self.watch_once()
            except Exception as exc:  # the watcher must outlive anything one poll meets
                say(f"ingress: watching the replicas failed once: {type(exc).__name__}: {exc}")
            await asyncio.sleep(WATCH_INTERVAL_S)

    async def watch_once(self) -> None:
        await asyncio.gather(*(self._poll(view) for view in self.replicas))
        self._end_silent_streams()
        if self.phase == "ready" and not self._announced:
            self._announced = True
            nodes = len({view.node for view in self.replicas})
            say(f"ready: {len(self.replicas)} of {len(self.replicas)} replicas on {nodes} node(s): "
                + ", ".join(f"{view.index} at {view.url}" for view in self.replicas))

    async def _poll(self, view: ReplicaView) -> None:
        """Ask ``view``'s actor how its server is. A poll waits for the answer one WATCH_INTERVAL_S at most (the call
        stays pending, for the next polls): one replica's frozen actor held every poll, of every replica, for
        ACTOR_CALL_TIMEOUT_S, and what the rest of the watch does with them (streams ended, restarts) waited as long."""
        loop = asyncio.get_running_loop()
        if view.pending is None:
            view.pending = asyncio.wrap_future(view.handle.info.remote().future())
            view.asked_at = loop.time()
        left = view.asked_at + ACTOR_CALL_TIMEOUT_S - loop.time()
        try:
            info = await asyncio.wait_for(asyncio.shield(view.pending), max(min(left, WATCH_INTERVAL_S), 0))
        except TimeoutError:
            if left > WATCH_INTERVAL_S:
                return  # (not late yet)
            if view.phase != "restarting":  # (a restart the ingress asked for is expected to keep it silent)
                view.phase = "not answering"  # the call stays pending: asked again once it answers
            self._silent(view)
            return
        except Exception as exc:  # the actor died or is restarting (RayActorError and kin)
            view.pending = None
            if view.phase != "restarting":
                view.phase = "unavailable"
            view.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            self._silent(view)
            return
        view.pending = None
        view.silent_since = None
        if view.pid is not None and (info["node"], info["pid"]) != (view.node, view.pid):
            self._end_requests(view, f"its process was replaced, pid {view.pid} -> {info['pid']}")
            view.restarts += 1
            view.failures, view.failing = 0, None  # (a new process: its device, its engine are new)
            view.down_since = None
            view.given_up = False  # a process Ray started on its own (its node's, say): the ingress's bound starts over
            self.router.forget(view.index)  # a new process: its prefix cache is empty
            say(f"ingress: replica {view.index} restarted (pid {view.pid} -> {info['pid']}) at {info['url']}")
        view.url, view.pid, view.node = info["url"], info["pid"], info["node"]
        view.phase, view.error = info["phase"], info["error"]
        if view.phase in DOWN and not self.draining:
            self._restart_when_due(view)
        if view.ready and self.tokenizer is None:
            call = asyncio.wrap_future(view.handle.tokenizer_json.remote().future())
            try:
                text = await asyncio.wait_for(call, ACTOR_CALL_TIMEOUT_S)
            except Exception:  # asked again at the next poll
                return
            if text is not None:
                self.tokenizer = await run_in_threadpool(_routing_tokenizer, text)
                if info["page_size"]:
                    self.router.page_size = int(info["page_size"])

    def _silent(self, view: ReplicaView) -> None:
        """The watcher heard nothing from ``view``'s actor: once for SILENT_LIMIT_S, its requests end."""
        now = self.clock()
        if view.silent_since is None:
            view.silent_since = now
        elif now - view.silent_since >= SILENT_LIMIT_S:
            self._end_requests(view, f"its actor {view.phase} for {now - view.silent_since:.0f} s")
            view.silent_since = now  # (said once, not at every poll while its streams send their clients the error)

    def _end_requests(self, view: ReplicaView, why: str) -> None:
        """End every request in flight on ``view``'s process (as a drain ends them): a stream with an error event
        (its connection closed), one not answered yet sent to another replica."""
        in_flight = self.router.load[view.index]
        if not in_flight or self._cut.is_set():
            return
        say(f"ingress: replica {view.index}: {why}: ending its {in_flight} request(s) in flight")
        view.loss.declare(why)
        view.loss = Loss()
        for upstream in list(self._streaming[view.index]):
            upstream.close()  # its stream's next read fails, and _forward tells the client why

    def _end_silent_streams(self) -> None:
        """Close every stream that has sent nothing for STREAM_SILENCE_S (_forward tells its client why)."""
        now = self.clock()
        for streams in self._streaming:
            for upstream, waiting_since in list(streams.items()):
                if waiting_since is not None and now - waiting_since >= STREAM_SILENCE_S:
                    upstream.close()

    def _restart_when_due(self, view: ReplicaView) -> None:
        """Kill the actor of a replica whose server stopped, for Ray to start it again (``max_restarts=-1``): once
        it has been down for its delay, and unless it is given up (then its phase says so)."""
        now = self.clock()
        if view.down_since is None:
            view.down_since = now
        view.restarted_at = [at for at in view.restarted_at if now - at < RESTART_WINDOW_S]
        if not view.given_up and len(view.restarted_at) >= RESTART_LIMIT:
            view.given_up = True
            say(f"ingress: giving up replica {view.index}: its server {view.phase} again after {RESTART_LIMIT} "
                f"restarts within {RESTART_WINDOW_S:g} s; it stays down ({view.error or 'no error reported'})")
        if view.given_up:
            view.phase = "given up"
            return
        if now - view.down_since < RESTART_DELAY_S * 2 ** len(view.restarted_at):
            return
        # Its process answered a moment ago, so Ray is not restarting it on its own; if the process died since, Ray
        # was, and this kill costs one more start (counted below, bounded with the rest). The process's last
        # answers may still come before it dies: down again, they wait for the next, longer delay.
        view.restarted_at.append(now)
        view.down_since = None
        self.restarted.labels(str(view.index)).inc()
        say(f"ingress: replica {view.index}'s server {view.phase} ({view.error or 'no error reported'}); restarting "
            f"it ({len(view.restarted_at)} of at most {RESTART_LIMIT} within {RESTART_WINDOW_S:g} s)")
        try:
            ray.kill(view.handle, no_restart=False)
        except Exception as exc:  # the next polls tell: the actor gone for good, or still down (then again, later)
            say(f"ingress: restarting replica {view.index} failed: {type(exc).__name__}: {exc}")
            return
        view.phase = "restarting"

    def available(self) -> set[int]:
        """The replicas a request may go to: those routed to; every ready one when all of them are failing (one may
        answer, where refusing the request surely fails it)."""
        routed = {view.index for view in self.replicas if view.routed}
        return routed or {view.index for view in self.replicas if view.ready}

    def _route(self, tokens: list[int] | None, tried: set[int], root: bytes) -> Route | None:
        """The router's choice among the available replicas not tried yet; but a failing replica whose probe is due
        takes the request instead (whatever its prefix: the probe tells whether it answers again)."""
        now = self.clock()
        for view in self.replicas:
            if view.ready and view.failing and view.index not in tried and now - view.probed_at >= PROBE_INTERVAL_S:
                view.probed_at = now
                return self.router.choose(tokens, {view.index}, root)
        return self.router.choose(tokens, self.available() - tried, root)

    def _answered(self, index: int, status: int) -> None:
        """A completion's answer came from replica ``index`` (its head; a stream's end: see :meth:`_stream_ended`):
        a 2xx counts for it, a 5xx other than 503 (busy, draining: no fault) against it; a 4xx is the request's."""
        view = self.replicas[index]
        if 200 <= status < 300:
            view.failures = 0
            if view.failing:
                view.failing = None
                say(f"ingress: replica {index} answered again; requests are routed to it again")
        elif replica_fault(status):
            self._failed(index, f"answered {status}")

    def _stream_ended(self, index: int, error_event: bytes | None) -> None:
        """A completion's stream from replica ``index`` ended whole: with its ``error_event`` (its server failed the
        request after its first tokens, a decode step's kernel say), counted as that error's status would be (the
        status it carries; an older replica's, without one, told by its type and code), or without one, a success."""
        if error_event is None:
            self._answered(index, 200)
            return
        try:
            body = json.loads(error_event[6:])
            error = body["error"] if "error" in body else body  # a completion's; a response's is the event itself
            kind, code, message = error.get("type"), error.get("code"), error.get("message")
            status = error.get("status")
        except (ValueError, KeyError, TypeError, AttributeError):
            kind, code, message, status = "server_error", None, "an error event that is not OpenAI's", None
        if type(status) is not int:
            status = 400 if kind != "server_error" else 503 if code in NO_FAULT_CODES else 500
        if replica_fault(status):
            self._failed(index, f"its stream ended with an error ({status} {code or 'no code'}: {message})")

    def _failed(self, index: int, why: str) -> None:
        """A completion failed on replica ``index``: FAILURES_IN_A_ROW in a row take it out of routing, and out of
        the router's prefix holders (what its cache holds is unknown)."""
        view = self.replicas[index]
        view.failures += 1
        if view.failures >= FAILURES_IN_A_ROW and not view.failing:
            view.failing = f"{view.failures} completions in a row failed, the last: {why}"
            view.probed_at = self.clock()
            self.router.forget(index)
            say(f"ingress: replica {index} taken out of routing: {view.failing}; one request every "
                f"{PROBE_INTERVAL_S:g} s tries it again")

    def replica_failed(self, index: int, error: BaseException) -> None:
        """A connection to replica ``index`` failed (refused, reset, timed out, its stream broken or silent): it is
        unreachable until its actor answers again, and the failure counts against it as a failed completion does. Its
        actor answering says nothing of the path from here to its server (a firewall on its node that lets Ray's ports
        through and not its server's, a network cut between the two): without the count, every request routed to it
        waited for the connection to fail before it was sent to another replica."""
        view = self.replicas[index]
        if view.phase == "ready":
            say(f"ingress: replica {index} failed: {type(error).__name__}: {error}")
        view.phase = "unreachable"  # until its actor answers again
        self._failed(index, f"its connection failed ({type(error).__name__})")

    # -- routing

    async def prompt_tokens(self, kind: str, payload: Any) -> list[int] | None:
        """The prompt as the replica's server will tokenize it, for prefix routing; None if it cannot tell."""
        tokenizer = self.tokenizer
        if tokenizer is None or not isinstance(payload, dict):
            return None
        try:
            if kind == "responses":  # as the chat completion it amounts to
                kind, payload = "chat", {"messages": input_messages(payload)}
            if kind == "chat":
                messages = _routing_prefix([{"role": template_role(m["role"], tokenizer.chat_template),
                                             "content": _message_text(m.get("content"))} for m in payload["messages"]])
                # (null is the default, as the replica reads it)
                generation = payload.get("add_generation_prompt") is not False
                continuing = payload.get("continue_final_message") is True
                variables = payload.get("chat_template_kwargs")
                length = sum(len(m["content"]) for m in messages)
                return await _off_loop_if_long(length, lambda: tokenizer.encode_chat(
                    messages, generation, continuing, variables if isinstance(variables, dict) else None))
            prompt = payload["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]  # a batch goes where its first prompt goes
            if isinstance(prompt, str):
                text = prompt[:ROUTING_PREFIX_CHARS]
                return await _off_loop_if_long(len(text), lambda: tokenizer.encode_text(text))
            if isinstance(prompt, list) and all(type(t) is int and 0 <= t < 2**31 for t in prompt):
                return prompt  # (ids no vocabulary has are the replica's to refuse)
        except Exception:  # malformed: the replica answers it with the right error
            return None
        return None

    async def proxy(
        self, request: Request, body: bytes, tokens: list[int] | None, stream: bool, root: bytes = b"",
        completion: bool = False,
    ) -> Response:
        """Send the request to a replica, and once more to another if the first fails before answering. ``tokens``
        and ``root`` (its cache salt's) route it by its prompt's prefix. A ``completion``'s outcome tells whether its
        replica's engine works: it counts for or against the replica (a model list or a tokenization does not)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        stalled = self.stall_error()
        if stalled is not None:
            self.unanswered.inc()
            raise stalled
        assert self.client is not None
        headers = {name: value for name in FORWARDED_HEADERS if (value := request.headers.get(name)) is not None}
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        tried: set[int] = set()
        last_error = "no replica is ready"
        self.in_flight += 1
        handed_off = False
        try:
            for attempt in range(2):
                route = self._route(tokens, tried, root)
                if route is None:
                    break
                index = route.replica
                tried.add(index)
                if attempt:
                    self.retries.inc()
                self.requests.labels(str(index), route.reason).inc()
                view = self.replicas[index]
                loss = view.loss
                progress = view.progress
                try:
                    # A client that leaves while the replica works ends the request there too: this cancel closes
                    # the connection, which the replica sees. (Its answer's head comes only with its first tokens,
                    # or with the whole answer.)
                    upstream = await unless_disconnected(request, self._until_cut(self.client.request(
                        request.method, f"{view.url}{path}", data=body or None, headers=headers,
                        allow_redirects=False), loss))
                except UPSTREAM_FAILED as exc:
                    self.router.finished(index)
                    self.replica_failed(index, exc)
                    last_error = f"replica {index} could not be reached ({type(exc).__name__})"
                    continue
                except ReplicaLost as exc:
                    self.router.finished(index)
                    last_error = f"replica {index} was given up on ({exc})"
                    continue
                if upstream is None:
                    self.router.finished(index)
                    # As a stuck engine's requests end: it never answers, its clients give up. Not where it answered
                    # anything meanwhile: a working replica, only busy, whose clients tire of its queue.
                    if completion and view.progress == progress:
                        self._failed(index, "its client left before any answer, and it answered nothing meanwhile")
                    return Response(status_code=499)
                view.progress += 1
                event_stream = "event-stream" in upstream.headers.get("content-type", "")
                streamed = stream and upstream.status == 200 and event_stream
                if completion and not streamed:  # (a stream's outcome is told by its end: see _forward)
                    self._answered(index, upstream.status)
                keep = False  # the stream's generator closes upstream once it is handed over
                try:
                    if upstream.status == 503 and not attempt and self.available() - tried:
                        last_error = f"replica {index} answered 503"  # draining or full: another may take it
                        continue
                    # Any other answer is passed on, a 500 too: the replica ran the request and failed it (a kernel
                    # that fails on this input, say), and another replica, the same model on the same engine, would
                    # likely fail it as well, at twice the cost, counting against both (a request that fails
                    # everywhere would take every replica out of routing). A server that cannot serve at all says so
                    # with 503; one that fails every request is routed around (FAILURES_IN_A_ROW).
                    returned = {name: value for name in RETURNED_HEADERS if (value := upstream.headers.get(name))}
                    returned["x-pie-replica"] = str(index)
                    if not streamed:
                        content = await unless_disconnected(request, self._until_cut(upstream.read(), loss))
                        if content is None:
                            return Response(status_code=499)
                        return Response(content, status_code=upstream.status, headers=returned)
                    first = await unless_disconnected(request, self._until_cut(_until_first_token(upstream), loss))
                    if first is None:
                        return Response(status_code=499)
                    head, rest = first
                    keep = True
                except UPSTREAM_FAILED as exc:
                    self.replica_failed(index, exc)
                    last_error = f"replica {index} failed before answering ({type(exc).__name__})"
                    continue
                except ReplicaLost as exc:
                    last_error = f"replica {index} was given up on ({exc})"
                    continue
                finally:
                    if not keep:
                        upstream.close()  # a connection whose answer was read whole went back to the pool already
                        self.router.finished(index)
                handed_off = True
                release = self._release_once(index, upstream)
                return ReleasingStream(self._forward(index, upstream, loss, head, rest, release, completion),
                                       release, headers=returned)
            self.unanswered.inc()
            raise APIError(503, f"no replica could answer this request: {last_error}", code="no_replica",
                           headers={"Retry-After": "1"})
        finally:
            if not handed_off:
                self.in_flight -= 1

    def _release_once(self, index: int, upstream: aiohttp.ClientResponse) -> Callable[[], None]:
        """What ends a streamed answer's hold on its replica and the ingress, done by the first call only."""
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._streaming[index].pop(upstream, None)
                upstream.close()
                self.router.finished(index)
                self.in_flight -= 1

        return release

    async def _forward(self, index: int, upstream: aiohttp.ClientResponse, loss: Loss, head: bytes,
                       rest: AsyncIterator[bytes], release: Callable[[], None],
                       completion: bool) -> AsyncIterator[bytes]:
        """The stream's events as the replica sends them, whole events only; an error event if it breaks off. A
        ``completion``'s stream that ends whole counts for or against its replica (:meth:`_stream_ended`)."""
        pending = head
        last_event = b""
        error_event: bytes | None = None
        failure: str | None = None
        broke: BaseException | None = None
        streams = self._streaming[index]
        view = self.replicas[index]
        waiting_since = streams[upstream] = None
        if loss.event.is_set():
            upstream.close()  # (given up on, or cut by a drain, between its hand-off and now)
        try:
            try:
                while True:
                    cut = pending.rfind(b"\n\n")
                    if cut >= 0:
                        whole, pending = pending[: cut + 2], pending[cut + 2 :]
                        last_event = _last_event(whole) or last_event
                        if error_event is None and (at := _error_event_at(whole)) >= 0:
                            error_event = whole[at: whole.find(b"\n\n", at)]
                        yield whole
                    waiting_since = streams[upstream] = self.clock()
                    chunk = await anext(rest, None)
                    streams[upstream] = None
                    if chunk is None:
                        break
                    if b"data: " in chunk:
                        view.progress += 1
                    pending += chunk
                if not _ends_cleanly(last_event):
                    failure = "ended its stream without finishing it"
                elif completion:
                    self._stream_ended(index, error_event)
            except UPSTREAM_FAILED as exc:
                failure, broke = f"failed while streaming ({type(exc).__name__})", exc
            if failure is not None:
                if self._cut.is_set():  # (closed by the drain's deadline: no fault of the replica's)
                    error = APIError(503, SHUT_DOWN, code="shutting_down")
                else:
                    if loss.event.is_set():  # (closed by the watcher, which said why)
                        failure = f"was given up on ({loss.why})"
                    elif waiting_since is not None and self.clock() - waiting_since >= STREAM_SILENCE_S:
                        failure = f"sent nothing for {STREAM_SILENCE_S:g} s"
                        self.replica_failed(index, TimeoutError(failure))
                    elif broke is not None:
                        self.replica_failed(index, broke)
                    self.broken_streams.inc()
                    error = APIError(502, f"replica {index} {failure}: this output is incomplete",
                                     code="replica_failed")
                yield format_sse_event(data_str=json.dumps(error.event_body()))
                yield format_sse_event(data_str="[DONE]")  # as a replica ends a stream that failed
        finally:
            release()

    # -- metrics

    async def metrics_text(self) -> bytes:
        """The ingress's own metrics, then every ready or stalled replica's (a stalled one's server answers, and its
        metrics say how long its step has run), each sample labelled with its replica."""
        client = self.client
        assert client is not None
        headers = {} if self.settings.api_key is None else {"authorization": f"Bearer {self.settings.api_key}"}
        scraped = [view for view in self.replicas if view.ready or view.stalled]

        async def scrape(view: ReplicaView) -> str | None:
            try:
                async with client.get(f"{view.url}/metrics", headers=headers, allow_redirects=False,
                                      timeout=aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)) as answer:
                    return await answer.text() if answer.status == 200 else None
            except (aiohttp.ClientError, TimeoutError):
                return None

        texts = await asyncio.gather(*(scrape(view) for view in scraped))
        merged = merge_metrics({str(view.index): text for view, text in zip(scraped, texts) if text is not None})
        registry = CollectorRegistry()
        registry.register(_Fixed(merged))
        return generate_latest(self.registry) + generate_latest(registry)

    def health(self) -> tuple[dict[str, Any], int]:
        ready = sum(view.routed for view in self.replicas)
        phase = self.phase
        stalled = self.stall_error()
        body = {
            "status": phase,
            **({"error": stalled.message} if stalled is not None else {}),
            "replicas": {"wanted": len(self.replicas), "ready": ready},
            "detail": [self._detail(view) for view in self.replicas],
        }
        return body, 200 if phase in ("ready", "degraded") else 503

    @staticmethod
    def _detail(view: ReplicaView) -> dict[str, Any]:
        """One replica in ``/health``: its state, and while it is not routed to, why."""
        error = view.failing if view.ready else view.error
        return {"replica": view.index, "status": "failing" if view.ready and view.failing else view.phase,
                "url": view.url, "node": view.node, "restarts": view.restarts, **({"error": error} if error else {})}


def replica_fault(status: int) -> bool:
    """Whether a completion that ended with ``status`` counts against its replica: a 5xx but 503. A 503 says the
    replica cannot take it now (short of memory, draining, stalled) or at all (its device lost: its server then says
    failed, and the ingress restarts it), which its state tells the ingress without a count."""
    return status >= 500 and status != 503


def merge_metrics(by_replica: dict[str, str]) -> list[Metric]:
    """Prometheus text of several replicas as one set of families, every sample labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in by_replica.items():
        try:
            parsed = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for family in parsed:
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                merged.samples.append(Sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar))
    return list(families.values())


class _Fixed(Collector):
    def __init__(self, metrics: list[Metric]):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        return iter(self._metrics)


class _ReplicaGauges(Collector):
    def __init__(self, ingress: Ingress):
        self._ingress = ingress

    def collect(self) -> Iterator[Metric]:
        replicas = self._ingress.replicas
        yield GaugeMetricFamily("pie:replicas_wanted", "Replicas the ingress was started with.", value=len(replicas))
        yield GaugeMetricFamily("pie:replicas_ready", "Replicas whose server is ready, and not failing.",
                                value=sum(v.routed for v in replicas))
        yield GaugeMetricFamily("pie:replicas_failing", "Replicas whose server is ready but that the ingress routes "
                                "no requests to (but a probe now and then): they failed several completions in a row.",
                                value=sum(v.ready and bool(v.failing) for v in replicas))
        yield GaugeMetricFamily("pie:replicas_given_up", "Replicas the ingress restarts no more: they stopped again "
                                "after as many restarts as it makes within its window.",
                                value=sum(v.given_up for v in replicas))
        yield GaugeMetricFamily("pie:replicas_stalled", "Replicas whose engine's step has run past --stall-seconds: "
                                "the ingress routes no requests to them until it returns.",
                                value=sum(v.stalled for v in replicas))
        restarts = GaugeMetricFamily("pie:replica_restarts", "Times each replica's process was seen replaced.",
                                     labels=["replica"])
        in_flight = GaugeMetricFamily("pie:ingress_in_flight", "Requests in flight on each replica.",
                                      labels=["replica"])
        for view in replicas:
            restarts.add_metric([str(view.index)], view.restarts)
            in_flight.add_metric([str(view.index)], self._ingress.router.load[view.index])
        yield restarts
        yield in_flight


def _upstream_socket(address: tuple[Any, ...]) -> socket.socket:
    """A socket for a connection to a replica (``address`` as ``getaddrinfo`` gives it), with TCP keepalive: see
    UPSTREAM_PROBE_IDLE_S."""
    family, kind, proto = address[:3]
    sock = socket.socket(family, kind, proto)
    keep_alive(sock, UPSTREAM_PROBE_IDLE_S, UPSTREAM_PROBE_INTERVAL_S, UPSTREAM_PROBES)
    return sock


def _routing_tokenizer(text: str) -> Tokenizer:
    """The replicas' tokenizer, its user-text encoder built (it is built on first use: a first request
    would otherwise wait for it on the event loop)."""
    tokenizer = Tokenizer.from_json(text)
    tokenizer.encode_text("")
    return tokenizer


def _message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)


def _routing_prefix(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The messages as far as their first ROUTING_PREFIX_CHARS characters of text: the last one kept cut short."""
    kept, room = [], ROUTING_PREFIX_CHARS
    for message in messages:
        if room <= 0:
            break
        kept.append({**message, "content": message["content"][:room]})
        room -= len(message["content"])
    return kept


async def _off_loop_if_long(length: int, work: Any) -> list[int]:
    return await run_in_threadpool(work) if length > LONG_TEXT else work()


async def _until_first_token(upstream: aiohttp.ClientResponse) -> tuple[bytes, AsyncIterator[bytes]]:
    """Read the stream until its first event that carries output (or ends it); returns what was read, and
    the rest of the stream. Until then nothing has reached the client, so a failure can still be retried."""
    rest = upstream.content.iter_any()
    buffered = b""
    scanned = 0
    async for chunk in rest:
        buffered += chunk
        while (end := buffered.find(b"\n\n", scanned)) >= 0:
            event, scanned = buffered[scanned:end], end + 2
            if _carries_output(event):
                return buffered, rest
    return buffered, rest


def _carries_output(event: bytes) -> bool:
    """True for an SSE event with text, a finish reason, an error or the end marker (not a role chunk or ping)."""
    if not event.startswith(b"data: "):
        return False
    data = event[6:]
    if data == b"[DONE]":
        return True
    try:
        body = json.loads(data)
    except ValueError:
        return True
    if "error" in body:
        return True
    for choice in body.get("choices") or ():
        if choice.get("finish_reason") or choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def _last_event(data: bytes) -> bytes:
    events = [event for event in data.split(b"\n\n") if event and not event.startswith(b":")]
    return events[-1] if events else b""


ERROR_EVENT = b'data: {"error"'
"""How an error event begins (a chunk's data begins with its id; a text's quotes inside it are escaped)."""
RESPONSE_ERROR_EVENT = b'data: {"type": "error"'
"""How the data of a Responses stream's error event begins (its other events' data begin with their own types)."""
RESPONSE_ENDS = (b"event: response.completed\n", b"event: response.incomplete\n", b"event: response.failed\n")
"""The events a Responses stream ends with (it sends no [DONE])."""


def _error_event_at(data: bytes) -> int:
    """Where the first error event's data in ``data`` begins, a completion's or a response's; -1 where none."""
    found = [at for at in (data.find(ERROR_EVENT), data.find(RESPONSE_ERROR_EVENT)) if at >= 0]
    return min(found, default=-1)


def _ends_cleanly(event: bytes) -> bool:
    return event == b"data: [DONE]" or event.startswith(ERROR_EVENT) or event.startswith(RESPONSE_ENDS)


# -- the application -----------------------------------------------------------------


def create_ingress_app(ingress: Ingress) -> FastAPI:
    """The OpenAI-compatible API of the replicas, through the ingress."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await ingress.start()
        try:
            yield
        finally:
            await ingress.close()

    app = FastAPIWithConnections(title="Pie ingress", docs_url=None, redoc_url=None, lifespan=lifespan)
    settings = ingress.settings
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key is not None:  # here too (the replicas check it again): before a body is read and tokenized
        app.add_middleware(KeyCheck, api_key=settings.api_key, rule=key_rule(settings))
    app.add_middleware(UnexpectedErrors)
    allow_origins(app, settings)
    app.add_middleware(RequestIds)  # the replica's own id passes through; the ingress names its own answers

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return await api_error(request, http_api_error(request, error))

    @app.api_route("/health", methods=["GET", "HEAD"])  # load balancers probe with HEAD too, as pie serve takes
    async def health() -> JSONResponse:
        body, status = ingress.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await ingress.metrics_text(), media_type=CONTENT_TYPE_LATEST)

    async def generate(request: Request, kind: str) -> Response:
        body = await request.body()
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            payload = None  # the replica answers it with the right error
        tokens = await ingress.prompt_tokens(kind, payload)
        stream = isinstance(payload, dict) and bool(payload.get("stream"))
        salt = payload.get("cache_salt") if isinstance(payload, dict) else None
        root = cache_root(salt) if isinstance(salt, str) and salt else b""
        return await ingress.proxy(request, body, tokens, stream, root, completion=True)

    async def chat_completions(request: Request) -> Response:
        return await generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    async def responses(request: Request) -> Response:
        return await generate(request, "responses")

    async def forward(request: Request) -> Response:
        return await ingress.proxy(request, await request.body(), None, False)

    # Starlette's plain routes, not FastAPI's: these take the request as it is, and FastAPI's parameter
    # handling around each call was a twentieth of the ingress's time per request.
    app.router.add_route("/v1/chat/completions", chat_completions, methods=["POST"])
    app.router.add_route("/v1/completions", completions, methods=["POST"])
    app.router.add_route("/v1/responses", responses, methods=["POST"])
    for path, methods in (("/v1/models", ["GET"]), ("/v1/models/{model_id:path}", ["GET"]),
                          ("/v1/responses/{response_id}", ["GET", "DELETE"]),
                          ("/tokenize", ["POST"]), ("/detokenize", ["POST"])):
        app.router.add_route(path, forward, methods=methods)
    return app


# -- starting it all -----------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaResources:
    """What each replica's actor holds on its node (Ray pins the device: CUDA_VISIBLE_DEVICES and kin)."""

    cpus: float = 1.0
    gpus: float = 0.0
    custom: tuple[tuple[str, float], ...] = ()
    """Other Ray resources, e.g. (("TPU", 4.0),)."""
    pin_cores: bool = False
    """Hold replica i to cores i*cpus.. of its host (Ray counts CPUs but pins none): for several replicas
    on one host, so that each computes on cores of its own."""


def start_replicas(settings: ServeSettings, count: int, resources: ReplicaResources = ReplicaResources()) -> list[Any]:
    """``count`` replica actors, spread over the cluster's nodes, each restarted by Ray when it dies."""
    env = {name: value for name, value in os.environ.items() if name.startswith(ENV_PREFIX)}
    actor = ray.remote(Replica)
    return [
        actor.options(
            num_cpus=resources.cpus,
            num_gpus=resources.gpus,
            resources=dict(resources.custom) or None,
            max_restarts=-1,
            max_task_retries=0,
            scheduling_strategy="SPREAD",
            runtime_env={"env_vars": env} if env else None,
        ).remote(settings, index, int(resources.cpus) if resources.pin_cores else None)
        for index in range(count)
    ]


def replica_count(resources: ReplicaResources) -> int:
    """One replica per alive node that can hold one (the default of --replicas)."""
    wanted = {"CPU": resources.cpus, "GPU": resources.gpus, **dict(resources.custom)}
    count = 0
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        have = node.get("Resources", {})
        if all(have.get(name, 0.0) >= amount for name, amount in wanted.items() if amount):
            count += 1
    return max(count, 1)


def serve_ray(
    settings: ServeSettings,
    host: str,
    port: int,
    *,
    address: str | None,
    replicas: int | None = None,
    resources: ReplicaResources = ReplicaResources(),
    access_log: bool = False,
    min_match: float = 0.5,
    balance_slack: int = 8,
) -> int:
    """``pie serve --ray``: connect to (or start) a Ray cluster, start the replicas, serve the ingress until
    drained; then stop the replicas. ``address`` as ``ray.init`` takes it: ``auto`` (RAY_ADDRESS, or the
    cluster `ray start` made on this host), ``local`` (a new Ray instance here), or a cluster's address."""
    raise_open_file_limit()
    listening = listen(host, port)  # first: a taken port fails before a cluster is joined
    ray.init(address=address, include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING)
    handles: list[Any] = []
    try:
        count = replicas or replica_count(resources)
        bound = listening.getsockname()
        display = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        say(f"listening on http://{display}:{bound[1]}; the ingress routes to {count} replica(s) "
            "(/health answers 503 until one is ready)")
        say(f"Ray cluster: {len([n for n in ray.nodes() if n.get('Alive')])} node(s); starting {count} replica(s) "
            f"with {resources.cpus:g} CPU{f', {resources.gpus:g} GPU' if resources.gpus else ''} each")
        handles = start_replicas(settings, count, resources)
        ingress = Ingress(settings, handles, min_match=min_match, balance_slack=balance_slack)
        server = DrainingServer(uvicorn_config(create_ingress_app(ingress), host, port, settings, access_log), ingress)
        server.run(sockets=[listening])
        return server.exit_code
    finally:
        _stop_replicas(handles)
        ray.shutdown()
        listening.close()


def _stop_replicas(handles: Iterable[Any]) -> None:
    for handle in handles:
        try:
            ray.kill(handle, no_restart=True)
        except Exception:  # already gone
            pass
