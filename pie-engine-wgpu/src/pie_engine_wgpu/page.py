"""The browser device's page: a loopback server, the browser that loads the page, and the socket between.

One thread of its own runs an asyncio loop with a websockets server on 127.0.0.1 (an
ephemeral port) and playwright, which launches the browser (or attaches to a running one
over the DevTools protocol) and opens ``http://127.0.0.1:PORT/TOKEN/#OPTIONS``, the fragment
holding the ``requestAdapter()`` options of the chosen adapter as JSON. The server answers
only under that random token: the page (``static/host.html``, ``host.js``) and, for the page's
own origin, one WebSocket. The engine's thread hands it whole messages
(:meth:`PageSession.exchange`) and waits, bounded, for the answer.

What ends the page — the browser exiting or crashing, the page crashing, being closed or reloaded,
its WebGPU device being lost, the socket closing, an answer not coming in time — makes the session
*broken*: the waiting call and every later one raise :class:`BrowserLost` with the reason. The
browser is closed with the session, at exit, and (launched through playwright's pipe) when this
process dies, since the browser exits when its DevTools pipe closes.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import json
import secrets
import threading
import time
from collections import deque
from http import HTTPStatus
from importlib import resources
from typing import Any
from urllib.parse import quote

from pie.enginekit.shaders.chromium import launch_failure
from pie.plugins import DeviceLost

from pie_engine_wgpu.browser import TIMEOUT_ENV, BrowserTarget
from pie_engine_wgpu.protocol import FRAME_HEADER, FRAME_HEADER_BYTES, Frame

LAUNCH_ARGS = (
    "--headless=new",
    "--enable-unsafe-webgpu",  # Chromium on Linux gives no WebGPU adapter without it
    "--enable-webgpu-developer-features",  # the adapter's description and backend, to say which it is
    "--no-sandbox",  # as root (containers, CI) Chromium does not start with its sandbox
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
)
STATIC = {"": ("host.html", "text/html; charset=utf-8"), "host.js": ("host.js", "text/javascript; charset=utf-8")}
CLOSE_TIMEOUT_S = 10.0
SOCKET_CLOSE_TIMEOUT_S = 2.0
"""How long a closing connection may take to close cleanly (a stray client that keeps one open)."""
SETTLE_S = 1.0
"""When the socket closes, how long to wait for the browser to say why (a crash, a closed page) first."""
CONSOLE_LINES = 8


class BrowserLost(DeviceLost):
    """The browser device cannot be used any more; the message says what happened."""


class PageSession:
    """One browser page running a WebGPU device for this process."""

    def __init__(self, target: BrowserTarget, timeout: float):
        self.target = target
        self.timeout = timeout
        self.broken = ""
        """Why the page can no longer be used (empty while it can)."""
        self.hello: dict[str, Any] = {}
        self.submissions = 0
        """Command buffers the page has submitted, as its last answer said."""
        self.page_seconds = 0.0
        """Time the page spent handling the messages it answered (the rest of an exchange is transport)."""
        self.record_seconds = 0.0
        """Of ``page_seconds``, the time until the page had submitted (decoding and recording)."""
        self.exchange_seconds = 0.0
        """Time the engine's thread spent in :meth:`exchange` (sending, and waiting for answers)."""
        self.exchanges = 0
        self.bytes_sent = 0
        self.bytes_received = 0
        self._token = secrets.token_urlsafe(24)
        self._console: deque[str] = deque(maxlen=CONSOLE_LINES)
        self._socket: Any = None
        self._server: Any = None
        self._playwright: Any = None
        self._browser: Any = None
        self._page: Any = None
        self._waiting: tuple[int, asyncio.Future[bytes]] | None = None
        self._hello: asyncio.Future[dict[str, Any]] | None = None
        self._closed = False
        self._navigations = 0
        self._lost = asyncio.Event()
        """Set once the session is broken (by the loop's own :meth:`_lose`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="pie-wgpu-browser", daemon=True)
        self._thread.start()
        atexit.register(self.close)
        try:
            self._run(self._open(), timeout, "starting the browser")
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}/{self._token}/"

    # -- the engine's thread ------------------------------------------------------------

    def exchange(self, message: bytes, seq: int, reply: bool) -> bytes | None:
        """Send one message; with ``reply``, wait for the page's answer to it and return its payload."""
        if self.broken:
            raise BrowserLost(self.broken)
        start = time.perf_counter()
        answer = self._run(self._exchange(message, seq, reply), self.timeout, "waiting for the page")
        self.exchange_seconds += time.perf_counter() - start
        self.exchanges += 1
        self.bytes_sent += len(message)
        self.bytes_received += len(answer) if answer is not None else 0
        return answer

    def close(self) -> None:
        """Close the page (and the browser, where this session launched it) and stop the thread."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        self.broken = self.broken or "the browser device was closed"
        if self._loop.is_running():
            try:
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CLOSE_TIMEOUT_S * 2)
            except Exception:
                pass
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def run(self, coroutine: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the session's loop (tests reach the page and the browser through this)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout or self.timeout)

    @property
    def page(self) -> Any:
        return self._page

    @property
    def browser(self) -> Any:
        return self._browser

    def _run(self, coroutine: Any, timeout: float, doing: str) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            reason = f"the browser did not answer within {timeout:g} s while {doing} (set {TIMEOUT_ENV} to wait longer)"
            self._loop.call_soon_threadsafe(self._lose, reason)
            raise BrowserLost(self.broken or reason) from None

    # -- the session's loop -----------------------------------------------------------------

    async def _open(self) -> None:
        from playwright.async_api import async_playwright
        from websockets.asyncio.server import serve

        self._hello = self._loop.create_future()
        self._server = await serve(
            self._connection,
            "127.0.0.1",
            0,
            process_request=self._http,
            compression=None,  # logits and weights do not compress; deflating them would cost a step
            max_size=None,
            ping_interval=None,  # a message the page is busy with may take long; the browser's events say when it is gone
            close_timeout=SOCKET_CLOSE_TIMEOUT_S,
        )
        self._port = self._server.sockets[0].getsockname()[1]
        milliseconds = self.timeout * 1000
        self._playwright = await async_playwright().start()
        chromium = self._playwright.chromium
        try:
            if self.target.cdp_url:
                self._browser = await chromium.connect_over_cdp(self.target.cdp_url, timeout=milliseconds)
                context = self._browser.contexts[0] if self._browser.contexts else await self._browser.new_context()
            else:
                args = [*LAUNCH_ARGS, *self.target.adapter.switches]
                self._browser = await chromium.launch(
                    executable_path=self.target.executable, args=args, timeout=milliseconds
                )
                context = await self._browser.new_context()
        except Exception as exc:
            raise BrowserLost(launch_failure(exc, self.target.executable, self.target.cdp_url)) from None
        self._browser.on("disconnected", lambda _: self._lose("the browser exited (its connection to pie closed)"))
        self._page = await context.new_page()
        self._page.on("crash", lambda _: self._lose("the browser's page crashed"))
        self._page.on("close", lambda _: self._lose("the browser's page was closed"))
        self._page.on("framenavigated", self._navigated)
        self._page.on("console", lambda message: self._console.append(f"{message.type}: {message.text}"))
        # The fragment, which no server sees, carries the chosen adapter's requestAdapter() options.
        options = quote(json.dumps(dict(self.target.adapter.options)), safe="")
        await self._page.goto(f"{self.url}#{options}", timeout=milliseconds)
        self.hello = await self._hello

    async def _shutdown(self) -> None:
        steps: list[Any] = []
        if self._socket is not None:
            steps.append(self._socket.close())
        if self._browser is not None:
            # Attached to the user's own browser: close only the page this session opened.
            steps.append(self._page.close() if self.target.cdp_url and self._page is not None else self._browser.close())
        if self._playwright is not None:
            steps.append(self._playwright.stop())
        for step in steps:
            try:
                await asyncio.wait_for(step, CLOSE_TIMEOUT_S)
            except Exception:
                pass
        if self._server is not None:
            self._server.close()
            try:
                await asyncio.wait_for(self._server.wait_closed(), SOCKET_CLOSE_TIMEOUT_S)
            except Exception:
                pass
        left = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    def _http(self, connection: Any, request: Any) -> Any:
        prefix = f"/{self._token}/"
        if not request.path.startswith(prefix):
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        rest = request.path[len(prefix) :]
        if rest == "socket":
            if request.headers.get("Origin") != f"http://127.0.0.1:{self._port}" or self._socket is not None:
                return connection.respond(HTTPStatus.FORBIDDEN, "this socket belongs to the engine's own page\n")
            return None  # the WebSocket handshake goes on
        if rest not in STATIC:
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        name, content_type = STATIC[rest]
        response = connection.respond(HTTPStatus.OK, resources.files(__package__).joinpath("static", name).read_text())
        del response.headers["Content-Type"]
        response.headers["Content-Type"] = content_type
        response.headers["Cache-Control"] = "no-store"
        response.headers["Content-Security-Policy"] = (
            f"default-src 'none'; script-src 'self'; connect-src ws://127.0.0.1:{self._port}"
        )
        return response

    async def _connection(self, socket: Any) -> None:
        if self._socket is not None:
            await socket.close(1008, "this device already has its page")
            return
        self._socket = socket
        try:
            async for frame in socket:
                if isinstance(frame, str):
                    self._lose("the page sent a text frame; it speaks only binary")
                    break
                self._receive(frame)
        except Exception:
            pass
        # The socket closing is the first sign of most endings; the browser's own event names the cause.
        self._loop.call_later(SETTLE_S, self._lose, "the page's connection to pie closed")

    def _navigated(self, frame: Any) -> None:
        """The page went to a document: first the engine's own (its event may come after the page's hello), then any
        other (a reload), which leaves the document that ran the device."""
        if frame != self._page.main_frame:
            return
        self._navigations += 1
        if self._navigations > 1:
            self._lose("the browser's page was reloaded or navigated away")

    def _receive(self, frame: bytes) -> None:
        kind, seq, submissions, page_ms, record_ms = FRAME_HEADER.unpack_from(frame)
        payload = frame[FRAME_HEADER_BYTES:]
        if kind == Frame.HELLO:
            if self._hello is not None and not self._hello.done():
                self._hello.set_result(json.loads(payload))
        elif kind == Frame.REPLY:
            self.submissions = submissions
            self.page_seconds += page_ms / 1000
            self.record_seconds += record_ms / 1000
            waiting, self._waiting = self._waiting, None
            if waiting is None or waiting[0] != seq:
                self._lose(f"the page answered message {seq}, which nothing waits for")
            elif not waiting[1].done():
                waiting[1].set_result(payload)
        elif kind == Frame.ERROR:
            self._lose(f"the browser's WebGPU device reported an error: {payload.decode(errors='replace')}")
        elif kind == Frame.LOST:
            self._lose(f"the browser's WebGPU device was lost ({payload.decode(errors='replace')})")
        elif kind == Frame.FATAL:
            self._lose(f"the browser's page could not start its WebGPU device: {payload.decode(errors='replace')}")
        else:
            self._lose(f"the page sent a frame of unknown kind {kind}")

    def _lose(self, reason: str) -> None:
        """The page is gone or wrong: remember why, and fail whoever waits."""
        if not self.broken:
            self.broken = reason + self._console_tail()
        self._lost.set()
        error = BrowserLost(self.broken)
        waiting, self._waiting = self._waiting, None
        for future in (waiting[1] if waiting else None, self._hello):
            if future is not None and not future.done():
                future.set_exception(error)

    def _console_tail(self) -> str:
        lines = [line for line in self._console if not line.startswith(("log:", "debug:", "info:"))]
        return ("; the page's console said: " + " | ".join(lines[-3:])) if lines else ""

    async def _exchange(self, message: bytes, seq: int, reply: bool) -> bytes | None:
        if self.broken:
            raise BrowserLost(self.broken)
        from websockets.exceptions import ConnectionClosed

        future: asyncio.Future[bytes] | None = None
        if reply:
            future = self._loop.create_future()
            self._waiting = (seq, future)
        try:
            await self._socket.send(message)
        except ConnectionClosed:
            if future is not None:  # no answer will come, and nobody will read this future
                self._waiting = None
                future.cancel()
            await self._until_lost()
            raise BrowserLost(self.broken) from None
        return await future if future is not None else None

    async def _until_lost(self) -> None:
        """Wait, bounded, for the session to break once the socket has closed: the browser's event names why (a
        crash, a close, a reload), else the socket's own end does, SETTLE_S after it."""
        try:
            await asyncio.wait_for(self._lost.wait(), SETTLE_S * 2)
        except TimeoutError:
            self._lose("the page's connection to pie closed")
