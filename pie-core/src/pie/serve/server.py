"""Running the application under uvicorn: listen first, load the model behind a 503 /health, drain on a signal.

The first SIGTERM or SIGINT starts a drain: new requests and /health get 503,
requests in flight run on for up to the drain time, the rest end with an error,
and the process exits 0. A second signal ends the requests in flight with an error
at once, and the process exits with 128 plus the signal's number when it cut any
(130 for SIGINT), so a supervisor sees that work was lost. A third exits without
waiting for their clients.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import uvicorn
from starlette.types import ASGIApp

from pie.device_use import DeviceClaim, device_users
from pie.runtime.llm import LLM
from pie.serve.app import ServerState, ServeSettings, create_app
from pie.serve.auth import LoopbackHosts, is_loopback
from pie.serve.connection import BoundedHttpToolsProtocol
from pie.sockets import keep_alive


def say(message: str) -> None:
    """Tell the operator, on stderr: best effort, since what calls it (a signal's drain) must go on when stderr is a
    closed pipe or a full disk."""
    try:
        print(f"pie serve: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # ValueError: stderr was closed
        pass


CLIENT_PROBE_IDLE_S, CLIENT_PROBE_INTERVAL_S, CLIENT_PROBES = 30, 10, 3
"""TCP keepalive of the server's connections (see :func:`listen`): a silent client is probed after 30 s, and one
whose host is gone is found so 60 s after it fell silent."""
ONE_DELIVERY_S = 0.05
"""A signal that comes again within this many seconds of the same one is the same request to stop: GNU ``timeout``
(and a kill of the process group) sends it to the server and to its process group, so it arrives twice at once,
and the second would cut the requests the first began to drain. A person's second Ctrl-C comes later."""


class Drainable(Protocol):
    """What DrainingServer drains: a server's state, or the Ray ingress in front of replicas."""

    settings: ServeSettings
    in_flight: int

    async def drain(self, seconds: float) -> None: ...


class DrainingServer(uvicorn.Server):
    """uvicorn whose first exit signal drains the requests in flight instead of cutting them off.

    Run it with :meth:`run`: uvicorn's own, on the event loop its config picks (``loop="auto"``: uvloop
    when it is installed, as ``http="auto"`` picks httptools). ``on_loop`` is called on that loop first.
    """

    def __init__(self, config: uvicorn.Config, state: Drainable,
                 on_loop: Callable[[asyncio.AbstractEventLoop], None] | None = None):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._on_loop = on_loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = self._quitting = False
        self._acted_on = (0, 0.0)
        """The last signal acted on, and when (``time.monotonic``)."""

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        if self._on_loop is not None:
            self._on_loop(self._loop)
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's own: it would raise the signal again after shutting down, and exit by it instead of 0.
        # Before the loop runs nothing is in flight: the server then stops as soon as it has started.
        now = time.monotonic()
        last_sig, last_at = self._acted_on
        if sig == last_sig and now - last_at < ONE_DELIVERY_S:
            return  # the same signal again at once: one request to stop, delivered twice (see ONE_DELIVERY_S)
        self._acted_on = (sig, now)
        if self._quitting or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        if self._draining:
            self._quitting = True
            say("quitting now: the requests in flight end with an error (again to quit without telling their clients)")
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._quit(sig)))
            return
        self._draining = True
        seconds = self.state.settings.drain_seconds
        say(f"draining: new requests get 503, those in flight have {seconds:g} s to finish (again to quit now)")
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain(seconds)))

    async def _drain(self, seconds: float) -> None:
        await self.state.drain(seconds)
        self.should_exit = True

    async def _quit(self, sig: int) -> None:
        if self.state.in_flight:
            self.exit_code = 128 + sig
        await self.state.drain(0)
        self.should_exit = True

    def fail(self, message: str) -> None:
        self.exit_code = 1
        self.should_exit = True
        say(message)


def uvicorn_config(app: ASGIApp, host: str, port: int, settings: ServeSettings, access_log: bool) -> uvicorn.Config:
    """uvicorn's settings for a pie server: its own messages from warnings up, and with ``access_log`` a line per
    request (uvicorn logs those at INFO, under the warning level the rest keeps); connections bounded as
    :mod:`pie.serve.connection` says. On loopback without an API key, only requests for localhost are
    answered (:class:`LoopbackHosts`): a Ray replica on a loopback address is asked for by that address."""
    if is_loopback(host) and settings.api_key is None:
        app = LoopbackHosts(app)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=access_log, lifespan="on",
                            http=BoundedHttpToolsProtocol)
    if access_log:
        logging.getLogger("uvicorn.access").setLevel(logging.INFO)
    return config


def run_server(
    settings: ServeSettings,
    host: str,
    port: int,
    *,
    access_log: bool = False,
    load: Callable[[ServeSettings], LLM] | None = None,
    started: Callable[[DrainingServer, str], None] | None = None,
) -> int:
    """Serve until drained; the process exit code (0 after a drain, 1 when the model cannot load).

    ``load`` loads the model (default: :meth:`LLM.load` as the settings say), on a worker thread.
    ``started`` is called with the server and its address once it listens, before the model is loaded:
    a caller that runs this on a thread of its own (a Ray replica) learns where it is and can drain it
    with ``server.handle_exit``, as a signal would (signals reach only the main thread).
    """
    raise_open_file_limit()
    if settings.runs_inferlets:
        from pie.inferlet.sandbox import describe_layers, probe_layers

        layers = probe_layers()
        say(f"inferlet workers: {describe_layers(layers)}")
        missing = [name for name, status in layers.items() if not status.available]
        if settings.allow_uploads and missing:
            say(f"cannot take --allow-uploads: uploaded inferlets need every sandbox layer, and {', '.join(missing)} "
                "cannot apply here")
            return 1
        if settings.allow_uploads and os.geteuid() == 0:
            say("warning: uploads run as root: the kernel never holds uid 0 to RLIMIT_NPROC, so an upload can start "
                "threads until the machine's pid limit; serve uploads as another user, or in a container with a pids "
                "limit (docker run --pids-limit)")
        settings.sandbox_layers = frozenset(name for name, status in layers.items() if status.available)
    state = ServerState(settings)
    app = create_app(state)

    def begin(loop: asyncio.AbstractEventLoop) -> None:
        if started is not None:
            started(server, url)
        loading = loop.run_in_executor(None, load or _load, settings)
        loading.add_done_callback(lambda done: _attach(state, server, done, loop, url))

    server = DrainingServer(uvicorn_config(app, host, port, settings, access_log), state, begin)
    if threading.current_thread() is threading.main_thread():  # a Ray replica's thread gets no signals
        for handled in (signal.SIGINT, signal.SIGTERM):  # from now on, before uvicorn takes them over
            signal.signal(handled, server.handle_exit)
    listening = listen(host, port)
    if not is_loopback(host) and settings.api_key is None:  # said once the address is known to be ours
        say(f"warning: listening on {host} without an API key: anyone who can reach this port can use the model")
    bound = listening.getsockname()
    display = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    url = f"http://{display}:{bound[1]}"
    say(f"listening on {url}; loading the model (/health answers 503 until it is ready)")
    try:
        server.run(sockets=[listening])
    finally:
        state.close()
    return server.exit_code


def _load(settings: ServeSettings) -> LLM:
    """The model on its engine, with a KV pool of ``kv_tokens`` (default: a share of the device memory)."""
    share = settings.kv_memory_share if settings.kv_tokens is None else None
    return LLM.load(settings.model, settings.engine, max_cached_tokens=settings.kv_tokens, kv_memory_share=share,
                    kv_dtype=settings.kv_dtype, dtype=settings.dtype)


def _reason(error: BaseException) -> str:
    """What stopped the server, in words even where the exception has none (a MemoryError)."""
    if isinstance(error, MemoryError):
        detail = f": {error}" if str(error) else ""
        return f"not enough memory for the KV cache or its host pool (--kv-tokens, --host-kv-tokens){detail}"
    return str(error) or type(error).__name__


def _attach(
    state: ServerState, server: DrainingServer, done: asyncio.Future[LLM], loop: asyncio.AbstractEventLoop, url: str
) -> None:
    if state.phase == "draining":  # a signal came while the model loaded: there is nothing to serve, nor to start
        return
    error = done.exception()
    if error is None:
        llm = done.result()
        try:
            state.attach(llm, loop)
        except Exception as exc:  # the engine's own start: its host KV pool, its inferlet workers
            error = exc
    if error is not None:
        state.phase = "failed"
        state.load_error = _reason(error)
        server.fail(f"cannot serve: {state.load_error}")
        return
    info = llm.device.info
    pages = llm.runner.pages.num_pages
    capped = f", {llm.kv_cap}" if llm.kv_cap else ""
    say(
        f"ready: {state.served_model_name} on {info.key} ({info.name}: {llm.engine_reason}); "
        f"context {llm.context_length} tokens; KV cache {llm.kv_capacity_tokens} tokens "
        f"({pages} pages of {llm.runner.page_size}{capped}); "
        f"prefix cache {'on' if state.settings.prefix_caching else 'off'}"
    )
    settings = state.settings
    say(f"the API is at {url}/v1" + (f", the web page at {url}/" if settings.ui else ""))
    state.device_claim = DeviceClaim(info, "serve")
    tunes = [user for user in device_users(info) if user.role == "tune"]
    if tunes:
        verb = "is" if len(tunes) == 1 else "are"
        say(f"note: {' and '.join(map(str, tunes))} {verb} measuring on this device ({info.key}): requests are "
            "slower, and its timings noisy, until it ends")


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files to the hard one, as Go's runtime does for every server: each connection
    holds a descriptor, and under a soft limit of 1024 (a common default) 1,100 idle connections kept /health from
    being answered."""
    try:
        import resource
    except ImportError:  # Windows: no such limit
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):  # macOS refuses an unlimited one: the soft limit stays
            pass


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port``, as ``socket.create_server`` makes, but whose protocol says TCP.

    create_server's socket has protocol 0, and asyncio sets TCP_NODELAY only on connections whose
    socket says IPPROTO_TCP: without it a response's head and body go out as two segments under
    Nagle's algorithm, and every request after a connection's first waits ~40 ms for the client's
    delayed ACK (keep-alive clients, the `openai` one among them, and every chunk of a stream).

    Its connections carry TCP keepalive (they inherit it): a client whose host vanished (no FIN reaches the
    server) is a client that left within CLIENT_PROBE_IDLE_S + CLIENT_PROBES * CLIENT_PROBE_INTERVAL_S seconds of
    silence, and its request stops generating; without it a whole answer was generated for no one, and a stream
    ran on until the kernel gave up retransmitting (minutes).
    """
    family = _family(host)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        if sys.platform != "win32":
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and hasattr(socket, "IPV6_V6ONLY"):
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        keep_alive(sock, CLIENT_PROBE_IDLE_S, CLIENT_PROBE_INTERVAL_S, CLIENT_PROBES)
        sock.bind((host, port))
        sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET

