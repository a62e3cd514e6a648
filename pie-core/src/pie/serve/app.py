"""The HTTP side: an OpenAI-compatible API over one engine, as a FastAPI application.

Every error is OpenAI's error JSON with the right status: 400 for a bad parameter
(named), 401 for a missing or wrong key, 404 for an unknown model or path, 413 for
a body over the limit, 503 with ``Retry-After`` while loading, draining, full or
stalled (an engine step past ``--stall-seconds``), 500 naming the kernel when one
fails. A request that was accepted always gets an answer: its result, or an error
(in the stream, once tokens went out).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import KEEPALIVE_COMMENT, format_sse_event
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pie import __version__ as pie_version
from pie.device_use import DeviceClaim
from pie.generation import SamplingParams
from pie.generation.constraints import (
    CompiledGrammar,
    GrammarError,
    GrammarSpec,
    GrammarUnavailable,
    GrammarVocabulary,
)
from pie.inferlet.workers import RUNS_PER_WORKER, RunLimits
from pie.model.errors import ChatTemplateError, TemplateVariableError, is_rust_panic
from pie.model.store import DEFAULT_MODEL
from pie.plugins import DeviceLost, what_raised
from pie.runtime.llm import LLM, ContextLengthExceeded
from pie.scheduler import RequestTooLarge, SchedulerConfig
from pie.serve.auth import KeyCheck, KeyRule
from pie.serve.cors import AllowedOrigins
from pie.serve.engine import (
    STALL_SECONDS,
    Delta,
    Done,
    Engine,
    Event,
    EverythingHeldBack,
    Failed,
    GenerationRequest,
    RequestHandle,
    stall_words,
)
from pie.serve.failures import engine_error, internal_error
from pie.serve.inferlets import (
    InferletService,
    InstalledInferlet,
    RunStream,
    install_inferlet_routes,
    installed_inferlets,
)
from pie.serve.metrics import ARRIVAL, Arrivals, ServerMetrics
from pie.serve.protocol import (
    APIError,
    ChatCompletionRequest,
    ChoiceState,
    CompletionRequest,
    DetokenizeRequest,
    Kind,
    SamplingFields,
    TextOffsets,
    TokenBytes,
    TokenizeRequest,
    bad_request,
    chat_logprobs,
    chunk_body,
    completion_logprobs,
    field_path,
    now,
    quoted,
    refuse_control_tokens,
    refuse_unsupported,
    requested_grammar,
    response_json,
    sampler_seed,
    shortened,
    template_messages,
    tool_calls_finish,
    usage,
)
from pie.serve.responses import install_responses_routes
from pie.serve.streams import FastAPIWithConnections, ReleasingStream, client_address
from pie.serve.tool_calls import CallReader, ToolRequest, read_calls, requested_tools
from pie.serve.ui import install_ui_routes, page_key_rule
from pie.weights import Dtype

log = logging.getLogger("pie.serve")

LONG_TEXT = 8192
"""Characters past which tokenizing moves off the event loop, to a worker thread."""
MAX_HELD_LOGPROBS = 1 << 22
"""Log-probabilities (each choice's tokens' own, and the top ones listed beside each) that one whole response may
come to hold, counted before it starts from its choices' max_tokens: each is a few hundred bytes in the server until
the response is sent. A stream holds none of them, so it has no such bound."""
LARGE_BODY = 1024
"""Entries of a whole response (its tokens, and the log-probabilities listed with each) past which its JSON is built
on a worker thread, not on the event loop."""
KEEPALIVE_S = 15.0
"""Seconds without an event after which a stream sends an SSE comment, so proxies keep it open."""
GRAMMAR_COMPILES = min(os.cpu_count() or 1, 8)
"""Output constraints compiled at once. A large schema's compile takes a core for seconds, and a thread of the pool
(40 threads) that tokenizing long prompts and building large responses share; requests past this wait their turn
(holding their places of --max-running and --max-waiting), with no thread."""


@dataclass
class ServeSettings:
    model: str | None = None
    engine: str | None = None
    served_model_name: str | None = None
    api_key: str | None = None
    open_probes: bool = True
    """/health and /metrics answer without the API key."""
    max_running: int = 64
    """Requests generating at once; more wait."""
    max_waiting: int = 256
    """Requests waiting for a place; more are answered 503."""
    max_body_bytes: int = 8 * 2**20
    kv_tokens: int | None = None
    """KV pool size in tokens (None: a share of the device's memory)."""
    kv_memory_share: float = 0.25
    kv_dtype: str = "float32"
    """The KV pages' element type (``--kv-dtype``)."""
    dtype: Dtype = "auto"
    """The type the model's matrices load in (``--dtype``)."""
    host_kv_tokens: int = 0
    """Host memory, in KV tokens, that preempted requests' pages are copied to (0: they recompute them)."""
    prefix_caching: bool = True
    drain_seconds: float = 30.0
    stall_seconds: float = STALL_SECONDS
    """How long one engine step may run before the server counts as stalled (see :attr:`ServerState.phase`)."""
    inferlets: Path | None = None
    """The operator's inferlets (files or packages), served at /v1/inferlets."""
    allow_uploads: bool = False
    """Run inferlet source that clients send (always sandboxed)."""
    inferlet_workers: int = 2
    """Worker processes kept started for inferlet runs."""
    runs_per_worker: int = RUNS_PER_WORKER
    """Runs of one installed inferlet a worker serves, one after another (1: a new process for every run)."""
    max_inferlet_runs: int = 16
    run_limits: RunLimits = RunLimits()
    sandbox_layers: frozenset[str] | None = None
    """The sandbox layers every inferlet worker must apply (see :mod:`pie.inferlet.sandbox`); None: no sandbox."""
    inferlet_memory_bytes: int = 2 << 30
    """Address space one inferlet worker may map."""
    ui: bool = True
    """The web page at / (see :mod:`pie.serve.ui`); /v1/pie/status and /v1/pie/plan answer either way."""
    allowed_origins: tuple[str, ...] = ()
    """Web pages of other origins whose scripts may call the API from a browser (CORS); ``*``: any (only with an API
    key: without one, any page a browser on this machine opens could use the server)."""

    @property
    def runs_inferlets(self) -> bool:
        return self.inferlets is not None or self.allow_uploads


class ServerState:
    """What the routes share: the model and engine once loaded, the phase, the requests in flight."""

    def __init__(self, settings: ServeSettings, llm: LLM | None = None):
        self.settings = settings
        self.metrics = ServerMetrics()
        self.llm: LLM | None = None
        self.engine: Engine | None = None
        self._phase = "loading"
        self.load_error: str | None = None
        """Why the server cannot serve, in phase "failed": the model did not load, or its device was lost."""
        self.device_lost = False
        """The engine's device is gone for good (see :meth:`lose_device`)."""
        self.in_flight = 0
        """Engine requests (one per prompt of a completions batch) and inferlet runs answering now, and the places
        of requests whose output constraint is being compiled: the drain waits for them."""
        self.sending = 0
        """Of those, engine requests whose generation is over, their output still being sent to a client behind."""
        self.active: set[RequestGroup | RunStream] = set()
        self.runs: dict[str, RunStream] = {}
        self.inferlet_names: list[str] = []
        self.served_model_name = settings.served_model_name or settings.model or DEFAULT_MODEL
        self.compiles = asyncio.Semaphore(GRAMMAR_COMPILES)
        """Turns to compile an output constraint (see GRAMMAR_COMPILES)."""
        self._preloaded = llm
        self.started = now()
        """When the server started (Unix seconds): its model card's ``created``."""
        self.fingerprint = ""
        """The answers' ``system_fingerprint`` (see :func:`system_fingerprint`), once the model is loaded."""
        self.device_claim: DeviceClaim | None = None
        """`pie serve`'s claim on its device, which `pie tune` looks for (see :mod:`pie.device_use`)."""

    @property
    def phase(self) -> str:
        """loading, ready, stalled (ready, but the engine's current step has run past --stall-seconds: /health answers
        503 and new requests are refused until it returns), draining or failed. The Ray ingress routes only to a
        replica whose server is ready."""
        if self._phase == "ready" and self.engine is not None and self.engine.stalled_for() is not None:
            return "stalled"
        return self._phase

    @phase.setter
    def phase(self, phase: str) -> None:
        self._phase = phase

    def stall_error(self) -> APIError | None:
        """The 503 that a new request gets while the engine is stalled (see :meth:`Engine.stalled_for`); else None."""
        seconds = self.engine.stalled_for() if self.engine is not None else None
        if seconds is None:
            return None
        return APIError(503, f"{stall_words(seconds, self.settings.stall_seconds)}; new requests are refused until "
                        "it returns", code="engine_stalled", headers={"Retry-After": "5"})

    def phase_error(self, phase: str) -> str | None:
        """Why the server in ``phase`` (read once by the caller) does not serve: a stall's words, or why it cannot
        serve at all (phase failed); None when it serves."""
        stalled = self.stall_error() if phase == "stalled" else None
        return stalled.message if stalled is not None else self.load_error

    @property
    def working(self) -> int:
        """What admission counts against --max-running and --max-waiting: the requests in flight whose work is not
        over. A client slow to read what was generated for it holds no place that generation could use."""
        return self.in_flight - self.sending

    def attach(self, llm: LLM, loop: asyncio.AbstractEventLoop) -> None:
        """Serve ``llm``: start its engine thread, delivering to ``loop``."""
        settings = self.settings
        config = SchedulerConfig(prefix_caching=settings.prefix_caching)
        workers = settings.inferlet_workers if settings.runs_inferlets else 0
        host_pages = -(-settings.host_kv_tokens // llm.runner.layout.page_size)
        engine = Engine(llm, max_running=settings.max_running, host_pages=host_pages, config=config,
                        inferlet_workers=workers, sandbox=self._sandbox(), runs_per_worker=settings.runs_per_worker,
                        on_device_lost=self.lose_device, stall_seconds=settings.stall_seconds)
        engine.start(loop)
        self.fingerprint = system_fingerprint(llm, settings.model or DEFAULT_MODEL)
        self.llm, self.engine = llm, engine
        self.metrics.engine = engine
        self.phase = "ready"

    def _sandbox(self) -> dict[str, Any] | None:
        """The workers' sandbox (see ``WorkerPool``): the installed inferlets readable. Uploaded source reaches its
        worker in the run's message and lives in that worker's own folder: no run can read another's."""
        settings = self.settings
        if settings.sandbox_layers is None:
            return None
        readable = [str(settings.inferlets)] if settings.inferlets is not None else []
        return {
            "memory_bytes": settings.inferlet_memory_bytes,
            "cpu_seconds": max(int(settings.run_limits.wall_seconds) + 1, 1),
            "read_only": readable,
            "required": sorted(settings.sandbox_layers),
        }

    async def start(self) -> None:
        """Attach the preloaded model, if one was given (``pie serve`` loads its own in the background)."""
        if self._preloaded is not None:
            self.attach(self._preloaded, asyncio.get_running_loop())
            self._preloaded = None

    def ready(self) -> tuple[LLM, Engine]:
        if self.phase == "draining":
            raise APIError(503, "the server is shutting down", code="shutting_down", headers={"Retry-After": "5"})
        if self.device_lost:
            raise self._device_lost_error()
        if self.llm is None or self.engine is None:
            message = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise APIError(503, message, headers={"Retry-After": "5"})
        stalled = self.stall_error()
        if stalled is not None:
            raise stalled
        return self.llm, self.engine

    def lose_device(self, error: BaseException) -> APIError:
        """A request failed because the engine's device is gone for good (``error`` is or wraps a DeviceLost): stop
        serving, since every pass would fail from now on. The phase becomes "failed", as when the model does not load:
        /health answers 503 with the reason, and the Ray ingress restarts the replica. Returns the 503 that this
        request and every later one gets."""
        if not self.device_lost:
            self.device_lost = True
            self.load_error = f"the device was lost: {what_raised(error) if isinstance(error, DeviceLost) else error}"
            if self._phase == "ready":  # or stalled: /health says failed, as it ought to
                self._phase = "failed"
            log.error("pie serve: %s; every request is refused (503) until the server is restarted", self.load_error)
        return self._device_lost_error()

    def _device_lost_error(self) -> APIError:
        return APIError(503, f"the server cannot serve: {self.load_error}", code="device_lost")

    async def drain(self, seconds: float) -> None:
        """Refuse new requests, let those in flight finish for up to ``seconds``, then end the rest with an error. A
        drain while one is under way (a second signal's, of 0 s) stops the server before the first one's end."""
        stopped = self.phase == "draining"
        self.phase = "draining"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        why = ("the server was stopped before this request finished" if stopped
               else f"the server shut down before this request finished (drain of {seconds:g} s)")
        for group in list(self.active):  # another replica, or this one restarted, may take it
            group.abort(APIError(503, why, code="shutting_down", headers={"Retry-After": "5"}))
        deadline = loop.time() + 2.0
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()
        if self.device_claim is not None:
            self.device_claim.release()


Batch = tuple[int, list[Event]]
"""One hand-off for one request of a group: its slot in the group (the prompt's index) and its events."""


class RequestGroup:
    """The engine requests of one HTTP request (a completions batch has one per prompt), read as one stream."""

    def __init__(self, state: ServerState, engine: Engine, requests: list[GenerationRequest], prompt_param: str,
                 arrival: float, grammar_param: str | None = None):
        """``arrival``: when its HTTP request arrived, by ``state.metrics.clock``."""
        self.state = state
        self.engine = engine
        self.requests = requests
        self.prompt_param = prompt_param
        """The field the prompts came from ("messages" or "prompt"), for errors."""
        self.grammar_param = grammar_param
        """The field that gave the output constraint (``guided_regex``...), for errors."""
        self.queue: asyncio.Queue[Batch] = asyncio.Queue()
        self.handles: list[RequestHandle] = []
        self.open = len(requests)
        self.arrival = arrival
        self.first_token: float | None = None
        """When the group's first generated token came (an end-of-sequence token, never shown, too)."""
        self.last_output: float | None = None
        """When the group's last output came: its last token, or the end of a request that generates none (an
        echoed prompt, max_tokens 0). Set once its prompts are in."""
        self.choice_tokens: collections.Counter[tuple[int, int]] = collections.Counter()
        """Tokens of each choice, by (prompt slot, choice index): the choices of a group advance side by side."""
        self.prompt_tokens = sum(len(request.prompt_ids) for request in requests)
        self.generated: set[int] = set()
        """The slots whose request the engine has ended (counted in ``state.sending`` until the group closes)."""
        self.failed = False
        """Ended by an error (a request's failure, or the server's :meth:`abort`), not by its client leaving: what
        its other requests' work was stopped for is counted as that error, not as a cancel."""
        for slot, request in enumerate(requests):
            self.handles.append(engine.submit(request, lambda events, slot=slot: self._deliver(slot, events)))
        state.in_flight += len(requests)
        state.active.add(self)

    def _deliver(self, slot: int, events: list[Event]) -> None:
        """Take one hand-off from the engine; a request's end is counted now, not once its client has read it."""
        self.queue.put_nowait((slot, events))
        if slot not in self.generated and any(isinstance(event, (Done, Failed)) for event in events):
            self.generated.add(slot)
            self.state.sending += 1

    async def next_batch(self) -> Batch | None:
        """The next hand-off, (prompt slot, events), or None once every request has ended."""
        if not self.open:
            return None
        slot, events = await self.queue.get()
        metrics = self.state.metrics
        for event in events:
            if isinstance(event, Delta) and not event.echoed:
                stamp = metrics.clock()
                if self.last_output is None:  # the prompts are in: counted now, as the tokens are, live
                    metrics.prompt_tokens.inc(self.prompt_tokens)
                self.last_output = stamp
                if event.generated:
                    if self.first_token is None:
                        self.first_token = stamp
                    self.choice_tokens[slot, event.index] += event.generated
                    metrics.generation_tokens.inc(event.generated)
            elif isinstance(event, (Done, Failed)):
                self.open -= 1
                self.failed |= isinstance(event, Failed)
        return slot, [self._as_refusal(slot, event) for event in events]

    def _as_refusal(self, slot: int, event: Event) -> Event:
        """A request that the whole KV pool could never hold, failed by the scheduler (which knows only its pages), as
        the context overflow it is; a constraint the grammar engine gave up on while following it (past one of its
        limits) as a 400 naming the constraint's field, as one it cannot compile is; min_tokens holding back every token
        a choice could take as a 400 naming it; any other failure as
        :func:`~pie.serve.failures.engine_error` answers it (a lost device: the 503 that ends serving). Every failure
        leaves as an APIError."""
        if not isinstance(event, Failed):
            return event
        if isinstance(event.error, GrammarError):
            return Failed(bad_request(self.grammar_param, f"{self.grammar_param}: {event.error}"))
        if isinstance(event.error, EverythingHeldBack):
            return Failed(bad_request("min_tokens", str(event.error)))
        if isinstance(event.error, RequestTooLarge):
            assert self.state.llm is not None
            request = self.requests[slot]
            return Failed(_context_length_exceeded(self.state.llm, len(request.prompt_ids), request.max_tokens,
                                                   self.prompt_param, "max_tokens", str(event.error)))
        return Failed(engine_error(event.error, self.state.lose_device))

    def abort(self, error: APIError) -> None:
        """End every unfinished request with ``error`` (the drain deadline)."""
        self.failed = True
        for slot, handle in enumerate(self.handles):
            if not handle.cancelled:
                self.engine.cancel(handle)
                self.queue.put_nowait((slot, [Failed(error)]))

    def close(self) -> None:
        """Cancel what is unfinished (a client gone) and count the request out; safe to call twice."""
        if self not in self.state.active:
            return
        for handle in self.handles:
            self.engine.cancel(handle)
        if len(self.generated) < len(self.handles) and not self.failed:
            self.state.metrics.cancelled.inc()
        self.state.active.discard(self)
        self.state.in_flight -= len(self.handles)
        self.state.sending -= len(self.generated)
        metrics = self.state.metrics
        if self.last_output is not None:
            metrics.e2e_latency.observe(self.last_output - self.arrival)
        if self.first_token is not None and self.last_output is not None:
            metrics.time_to_first_token.observe(self.first_token - self.arrival)
            longest = max(self.choice_tokens.values())  # its last token is the group's last
            if longest > 1:
                metrics.time_per_output_token.observe((self.last_output - self.first_token) / (longest - 1))


# -- the application -----------------------------------------------------------


def create_app(state: ServerState) -> FastAPI:
    app = FastAPIWithConnections(title="Pie", docs_url=None, redoc_url=None, lifespan=_lifespan(state))
    app.state.pie = state
    settings = state.settings
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes,
                       refused=lambda: state.metrics.errors.labels("413").inc())
    if settings.api_key is not None:  # outside BodyLimit: a request without the key has its body never read
        app.add_middleware(KeyCheck, api_key=settings.api_key, rule=key_rule(settings),
                           refused=lambda: state.metrics.errors.labels("401").inc())
    _install_error_handlers(app, state)
    allow_origins(app, settings, refused=lambda: state.metrics.errors.labels("400").inc())
    app.add_middleware(RequestIds)  # the 401s, 413s and 500s of the middlewares within are named too
    app.add_middleware(Arrivals, metrics=state.metrics)  # outermost: a request's latencies start as it arrives
    if settings.runs_inferlets:
        service = _inferlet_service(settings)
        state.inferlet_names = sorted(service.installed)
        install_inferlet_routes(app, state, service)
    install_ui_routes(app, state)

    @app.get("/health")
    @app.head("/health", include_in_schema=False)  # load balancers probe with HEAD too
    async def health() -> JSONResponse:
        phase = state.phase
        error = state.phase_error(phase)
        body: dict[str, Any] = {"status": phase, **({"error": error} if error else {})}
        return JSONResponse(body, status_code=200 if phase == "ready" else 503)

    @app.get("/metrics")
    @app.head("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(state.metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        _check_model(state, model_id)
        return _model_card(state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        llm, engine = state.ready()
        _check_model(state, body.model)
        refuse_unsupported(body)
        if not llm.tokenizer.chat_template:
            raise bad_request("messages", "this model has no chat template; use /v1/completions")
        messages, tools = _chat_prompt(llm, body)
        max_tokens = body.max_completion_tokens or body.max_tokens
        try:
            ids = await _encoded(
                llm, [m["content"] for m in messages],
                lambda: llm.tokenizer.encode_chat(messages, body.add_generation_prompt, body.continue_final_message,
                                                  body.chat_template_kwargs, tools.tools if tools else None),
                prompt_param="messages", max_tokens=max_tokens, off_loop=tools is not None,
            )
        except ChatTemplateError as exc:
            raise _template_refusal(exc) from None
        top = (body.top_logprobs or 0) if body.logprobs else None
        calls = tools.grammar() if tools else None
        asked = (calls, "tools") if calls is not None else requested_grammar(body)
        grammar, grammar_param = await _compiled_grammar(state, llm, asked, places=1)
        max_tokens_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        generation = _generation_request(llm, body, ids, max_tokens, top, "messages", grammar,
                                         max_tokens_param=max_tokens_param)
        reads_calls = tools if tools is not None and tools.reads_calls else None
        return await _respond(state, engine, request, "chat", body, [generation], grammar_param, reads_calls)

    install_responses_routes(app, chat_completions)  # /v1/responses: a chat completion, as OpenAI's Responses API

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        llm, engine = state.ready()
        _check_model(state, body.model)
        refuse_unsupported(body)
        sent = _prompts_as_sent(body.prompt)
        _refuse_never_held(state, len(sent))  # before it is tokenized: 400,000 short prompts took seconds
        prompts = await _prompt_ids(llm, sent, body.max_tokens)
        top = body.logprobs
        grammar, grammar_param = await _compiled_grammar(state, llm, requested_grammar(body), places=len(prompts))
        echoes = _prompt_texts(llm, sent, prompts) if body.echo else [None] * len(prompts)
        generations = [
            _generation_request(llm, body, ids, body.max_tokens, top, "prompt", grammar, COMPLETION_MAX_TOKENS,
                                echo=echo)
            for ids, echo in zip(prompts, echoes, strict=True)
        ]
        return await _respond(state, engine, request, "completion", body, generations, grammar_param)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        llm, _ = state.ready()
        _check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            given = "both" if body.prompt is not None else "neither"
            raise bad_request("prompt", f"give prompt or messages (this request gives {given})")
        if body.tools is not None and body.messages is None:
            raise bad_request("tools", "tools are shown by the chat template: give messages, not a prompt")
        if body.messages is not None:
            messages, tools = _chat_prompt(llm, body)
            try:
                ids = await _encoded(llm, [m["content"] for m in messages], lambda: llm.tokenizer.encode_chat(
                    messages, body.add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                    tools.tools if tools else None), off_loop=tools is not None)
            except ChatTemplateError as exc:
                raise _template_refusal(exc) from None
        else:
            prompt = body.prompt
            assert prompt is not None
            ids = await _encoded(llm, [prompt], lambda: llm.tokenizer.encode_text(prompt, body.add_special_tokens))
        return {"count": len(ids), "max_model_len": llm.max_sequence_tokens, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        llm, _ = state.ready()
        _check_model(state, body.model)
        _check_token_ids(llm, body.tokens, "tokens")
        return {"prompt": llm.tokenizer.decode(body.tokens)}

    return app


PROBES = ("/health", "/metrics")


def key_rule(settings: ServeSettings) -> Callable[[str], KeyRule]:
    """How each path takes the API key: the probes, the API schema and the page as ``--protect-probes`` says (and the
    page also by HTTP Basic), the rest (the API) always."""
    probe: KeyRule = "open" if settings.open_probes else "bearer"

    def rule(path: str) -> KeyRule:
        if path in PROBES or path == "/openapi.json":  # the schema lists the routes the options enabled (uploads)
            return probe
        return page_key_rule(path, settings.open_probes) or "bearer"

    return rule


def _inferlet_service(settings: ServeSettings) -> InferletService:
    installed: dict[str, InstalledInferlet] = {}
    if settings.inferlets is not None:
        installed, skipped = installed_inferlets(settings.inferlets)
        for line in skipped:
            log.warning("inferlet left out: %s", line)
    return InferletService(installed, settings.run_limits, settings.max_inferlet_runs, settings.allow_uploads)


def _lifespan(state: ServerState) -> Callable[[FastAPI], Any]:
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.start()
        try:
            yield
        finally:
            state.close()

    return lifespan


def _model_card(state: ServerState) -> dict[str, Any]:
    card: dict[str, Any] = {"id": state.served_model_name, "object": "model", "created": state.started,
                            "owned_by": "pie"}
    if state.llm is not None:
        card["max_model_len"] = state.llm.max_sequence_tokens
    return card


def system_fingerprint(llm: LLM, source: str) -> str:
    """OpenAI's ``system_fingerprint``: a digest of what, besides a request and its seed, decides the numbers this
    server computes: Pie's version, the engine's, the device and its driver, the model's source and configuration,
    the kernel variant of every region (the device profile's choices) and the KV cache's type. Answers that differ
    for the same request and seed under different fingerprints may differ because the backend did."""
    device = llm.device
    info = device.info
    memory = llm.memory
    facts = (pie_version, device.engine.distribution, device.engine.version, info.key, info.name, info.driver, source,
             repr(llm.runner.config), llm.runner.plan.describe(), memory.kv_dtype if memory is not None else "")
    return "fp_" + hashlib.sha256("\n".join(facts).encode()).hexdigest()[:12]


def _chat_prompt(
    llm: LLM, body: ChatCompletionRequest | TokenizeRequest
) -> tuple[list[dict[str, Any]], ToolRequest | None]:
    """A conversation's messages and tools as its chat template is shown them, checked (see
    :func:`~pie.serve.protocol.template_messages` and :func:`~pie.serve.tool_calls.requested_tools`)."""
    assert body.messages is not None
    tokenizer = llm.tokenizer
    tools = requested_tools(body, tokenizer.chat_template)
    if tools is not None:
        refuse_control_tokens(tools.tools, "tools", tokenizer.control_token_in)
    return template_messages(body.messages, tokenizer.chat_template, tokenizer.control_token_in), tools


def _template_refusal(error: ChatTemplateError) -> APIError:
    """The 400 for a conversation the chat template refused, naming ``chat_template_kwargs`` where a variable of
    the request's was what it refused."""
    return bad_request("chat_template_kwargs" if isinstance(error, TemplateVariableError) else "messages", str(error))


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.served_model_name:
        raise APIError(
            404,
            f"the model {quoted(name)} does not exist; this server serves {state.served_model_name!r}",
            param="model",
            code="model_not_found",
        )


Encoded = TypeVar("Encoded", list[int], list[list[int]])


async def _encoded(
    llm: LLM,
    texts: list[str],
    encode: Callable[[], Encoded],
    prompt_param: str | None = None,
    max_tokens: int | None = None,
    each_a_prompt: bool = False,
    off_loop: bool = False,
) -> Encoded:
    """What ``encode()`` gives for ``texts``: the ids of one prompt (its messages' texts), or with ``each_a_prompt``
    those of each text (a completions batch). Long texts, together, are encoded on a worker thread (the tokenizer
    lets the event loop run meanwhile), and those of a prompt (``prompt_param`` names it; ``max_tokens``: the
    completion's tokens asked for) are first refused, untokenized, where they cannot fit; /tokenize counts the
    tokens of any text. ``off_loop``: on the worker thread however short the texts, for a prompt holding more than
    they say (a chat's tools, which may run to megabytes, rendered by the chat template)."""
    if not off_loop and sum(map(len, texts)) <= LONG_TEXT:
        return encode()

    def checked() -> Encoded:
        if prompt_param is not None:
            for prompt in [[text] for text in texts] if each_a_prompt else [texts]:
                _refuse_past_room(llm, prompt, prompt_param, max_tokens)
        return encode()

    return await run_in_threadpool(checked)


def _refuse_past_room(llm: LLM, texts: list[str], prompt_param: str, max_tokens: int | None) -> None:
    """A 400 naming ``prompt_param`` for text of more tokens than a sequence may hold, found without tokenizing it:
    ``n`` bytes of text are at least ``n / max_text_bytes_per_token`` tokens."""
    per_token = llm.tokenizer.max_text_bytes_per_token
    if per_token is None:
        return
    size = sum(len(text.encode("utf-8")) for text in texts)
    fewest = -(-size // per_token)
    if fewest >= llm.max_sequence_tokens:
        raise _context_length_exceeded(
            llm, fewest, max_tokens or LEAST_COMPLETION, prompt_param, prompt_param,
            f"the prompt (at least {fewest} tokens: {size} bytes of text, and a token of this model stands for at "
            f"most {per_token}) fills {_room(llm)} tokens", counted_from_below=True)


LEAST_COMPLETION = 1
"""The completion's tokens a refusal counts for a request that gives no max_tokens: a choice takes at least one."""


def _context_length_exceeded(
    llm: LLM,
    prompt_tokens: int,
    completion_tokens: int,
    prompt_param: str,
    param: str,
    account: str,
    *,
    counted_from_below: bool = False,
) -> APIError:
    """A 400 for a request past what a sequence may hold, with OpenAI's code ``context_length_exceeded`` and its
    sentence (vLLM's too), which clients match to raise their context-overflow errors (LangChain on the code,
    LiteLLM on the sentence), then ``account``, Pie's own. The maximum it states is what a sequence may hold here,
    /v1/models' ``max_model_len``: the model's context, or the KV cache where it holds less. ``prompt_param``
    names where the prompt came from ("messages" or "prompt"), ``param`` the field to change; with
    ``counted_from_below`` the prompt was not tokenized, and its tokens are a lower bound."""
    bound = "at least " if counted_from_below else ""
    sentence = (f"This model's maximum context length is {llm.max_sequence_tokens} tokens. However, you requested "
                f"{bound}{prompt_tokens + completion_tokens} tokens ({bound}{prompt_tokens} in the {prompt_param}, "
                f"{completion_tokens} in the completion).")
    return APIError(400, f"{sentence} {account[:1].upper()}{account[1:]}", param=param,
                    code="context_length_exceeded")


def _room(llm: LLM) -> str:
    """What bounds a sequence, in words: the model's context or, where it holds less, the KV cache."""
    room = llm.max_sequence_tokens
    return f"the model's context of {room}" if room == llm.context_length else f"the KV cache's {room}"


def _prompts_as_sent(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str] | list[list[int]]:
    """A completions request's prompts as sent, one item a prompt: texts, or lists of token ids (a flat list of ids
    is one prompt). The one place that tells the prompt's forms apart."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt", "the prompt is empty")
    if all(isinstance(item, int) for item in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    if all(isinstance(item, list) for item in prompt):
        return [list(item) for item in prompt]  # type: ignore[arg-type]
    if all(isinstance(item, str) for item in prompt):
        return list(prompt)  # type: ignore[arg-type]
    raise bad_request("prompt", "a prompt is a string, a list of strings, a list of token ids or a list of those")


async def _prompt_ids(llm: LLM, sent: list[str] | list[list[int]], max_tokens: int | None) -> list[list[int]]:
    """Each prompt (as :func:`_prompts_as_sent` gives them) as token ids (text is encoded as text: BOS, no control
    tokens); ``max_tokens`` is the request's, for the refusal of a prompt that cannot fit."""
    if all(isinstance(item, str) for item in sent):
        texts: list[str] = list(sent)  # type: ignore[arg-type]
        prompts = await _encoded(llm, texts, lambda: [llm.tokenizer.encode_text(text) for text in texts],
                                 prompt_param="prompt", max_tokens=max_tokens, each_a_prompt=True)
    else:
        prompts = sent  # type: ignore[assignment]
    for ids in prompts:
        if not ids:
            raise bad_request("prompt", "a prompt is empty")
        _check_token_ids(llm, ids, "prompt")
    return prompts


def _check_token_ids(llm: LLM, ids: list[int], param: str) -> None:
    vocab = llm.runner.config.vocab_size
    bad = next((token for token in ids if not 0 <= token < vocab), None)
    if bad is not None:
        raise bad_request(param, f"token id {bad} is outside the vocabulary (0 to {vocab - 1})")


async def _compiled_grammar(
    state: ServerState, llm: LLM, asked: tuple[GrammarSpec, str] | None, places: int
) -> tuple[CompiledGrammar | None, str | None]:
    """The request's output constraint (``asked``: it and the field that gave it, see
    :func:`~pie.serve.protocol.requested_grammar`) compiled, off the event loop (a large schema takes seconds, and
    the vocabulary is read once, on the first such request), and that field; a 400 naming that field when it is bad;
    ``(None, None)`` without one.

    A server with no room for the request's ``places`` (its engine requests) refuses it before it compiles anything;
    while it waits for its turn to compile (``state.compiles``) and compiles, it holds those places."""
    if asked is None:
        return None, None
    spec, param = asked

    def compile_grammar() -> CompiledGrammar:
        return GrammarVocabulary.for_tokenizer(llm.tokenizer, llm.runner.config.vocab_size).compile(spec)

    _refuse_past_capacity(state, places)
    state.in_flight += places
    try:
        async with state.compiles:
            return await run_in_threadpool(compile_grammar), param
    except (GrammarError, GrammarUnavailable) as exc:
        raise bad_request(param, f"{param}: {exc}") from None
    finally:
        state.in_flight -= places


def _member_tag(part: object) -> bool:
    """Whether a validation error's location part names a member of a union (``str``, ``list[int]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list", "none") or "[" in part)


COMPLETION_MAX_TOKENS = 16
"""A text completion's ``max_tokens`` when the request gives none: OpenAI's default for ``/v1/completions`` (a chat
completion's is the rest of the context, as OpenAI's)."""


TOKEN_ID_KEY = re.compile(r"0|[1-9][0-9]{0,18}")
"""A key of ``logit_bias``: a token id as JSON writes a number, in decimal."""


def _generation_request(
    llm: LLM,
    body: SamplingFields,
    ids: list[int],
    max_tokens: int | None,
    top_logprobs: int | None,
    prompt_param: str,
    grammar: CompiledGrammar | None = None,
    default_max_tokens: int | None = None,
    max_tokens_param: str = "max_tokens",
    echo: str | None = None,
) -> GenerationRequest:
    """Without ``max_tokens`` a choice may fill the rest of what a sequence may hold (the context, or the KV cache
    where it is smaller), or ``default_max_tokens`` of it. ``max_tokens_param`` is the field that gave it; ``echo``
    the prompt's text, where each choice shows it first."""
    if max_tokens is None:
        room = llm.max_sequence_tokens
        max_tokens = room - len(ids)
        if max_tokens < 1:
            raise _context_length_exceeded(llm, len(ids), LEAST_COMPLETION, prompt_param, prompt_param,
                                           f"the prompt ({len(ids)} tokens) fills {_room(llm)} tokens")
        if default_max_tokens is not None:
            max_tokens = min(max_tokens, default_max_tokens)
    try:
        llm.check_fits(len(ids), max_tokens)
    except ContextLengthExceeded as exc:
        raise _context_length_exceeded(llm, len(ids), max_tokens, prompt_param,
                                       max_tokens_param if len(ids) < exc.limit else prompt_param, str(exc)) from None
    if body.min_tokens > max_tokens:
        raise bad_request("min_tokens", f"min_tokens ({body.min_tokens}) is more than the {max_tokens} tokens the "
                                        f"choice may have ({max_tokens_param} or what the context leaves)")
    vocab = llm.runner.config.vocab_size
    bias: list[tuple[int, float]] = []
    for key, value in (body.logit_bias or {}).items():
        if not TOKEN_ID_KEY.fullmatch(key):  # int() would also read " 5", "+5", "1_0" and other digits than ASCII's
            raise bad_request("logit_bias", f"logit_bias keys are token ids written in decimal (\"1234\"), not "
                                            f"{quoted(key)}")
        token = int(key)
        if not 0 <= token < vocab or not -100 <= value <= 100:
            raise bad_request("logit_bias", f"logit_bias {shortened(key)}: {value} needs a token id below {vocab} and a bias in [-100, 100]")
        bias.append((token, float(value)))
    extra_stops = body.stop_token_ids or []
    _check_token_ids(llm, extra_stops, "stop_token_ids")
    try:
        sampling = SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_k=max(body.top_k or 0, 0),
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=sampler_seed(body.seed),
        )
    except ValueError as exc:  # its message starts with the field's name
        raise bad_request(str(exc).split(" ", 1)[0], str(exc)) from None
    return GenerationRequest(
        prompt_ids=tuple(ids),
        max_tokens=max_tokens,
        sampling=sampling,
        n=body.n,
        stop=body.stop_strings(),
        stop_token_ids=frozenset(() if body.ignore_eos else llm.tokenizer.eos_token_ids) | frozenset(extra_stops),
        top_logprobs=top_logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_tokens=body.min_tokens,
        logit_bias=tuple(bias),
        grammar=grammar,
        cache_salt=body.cache_salt,
        echo=echo,
    )


def _prompt_texts(llm: LLM, sent: list[str] | list[list[int]], ids: list[list[int]]) -> list[str | None]:
    """Each prompt's text as ``echo`` shows it: as the client sent it, or decoded where it sent token ids."""
    return [item if isinstance(item, str) else llm.tokenizer.decode(prompt_ids)
            for item, prompt_ids in zip(sent, ids, strict=True)]


def _refuse_past_capacity(state: ServerState, places: int) -> None:
    """A 503 when the requests running or waiting leave no room for ``places`` more engine requests (a 400 when
    the server never holds that many)."""
    _refuse_never_held(state, places)
    settings = state.settings
    capacity = settings.max_running + settings.max_waiting
    if state.working + places > capacity:
        raise APIError(
            503,
            f"the server is at capacity ({state.working} requests running or waiting, {settings.max_waiting} may "
            "wait); retry later",
            code="overloaded",
            headers={"Retry-After": "1"},
        )


def _refuse_never_held(state: ServerState, places: int) -> None:
    """A 400 for a batch of more prompts (``places``) than the server ever holds: never admitted, however idle the
    server, so not a reason to retry."""
    settings = state.settings
    capacity = settings.max_running + settings.max_waiting
    if places > capacity:
        raise bad_request("prompt", f"a batch of {places} prompts is more than the server holds at once "
                                    f"({capacity}: --max-running and --max-waiting together)")


async def _respond(
    state: ServerState,
    engine: Engine,
    request: Request,
    kind: Kind,
    body: SamplingFields,
    generations: list[GenerationRequest],
    grammar_param: str | None = None,
    tools: ToolRequest | None = None,
) -> Response:
    """Generate and answer; ``grammar_param`` is the field that gave the output constraint, if one did; ``tools``
    the request's, where tool calls are read out of the choices."""
    _refuse_past_capacity(state, len(generations))
    if not body.stream:
        _check_held_logprobs(kind, generations)
    group = RequestGroup(state, engine, generations, "messages" if kind == "chat" else "prompt",
                         request.scope[ARRIVAL], grammar_param)
    request_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{secrets.token_hex(16)}"
    try:
        response = await _answer(state, group, request, kind, body, request_id, tools)
    except APIError as error:  # met once the generation had its id: the error is named by it too
        error.headers.setdefault(REQUEST_ID_HEADER, request_id)
        raise
    response.headers.setdefault(REQUEST_ID_HEADER, request_id)
    return response


async def _answer(
    state: ServerState, group: RequestGroup, request: Request, kind: Kind, body: SamplingFields, request_id: str,
    tools: ToolRequest | None,
) -> Response:
    """The response to the generation of ``group``: whole, or a stream once its first events are in."""
    choices_per_prompt = body.n
    top_logprobs = group.requests[0].top_logprobs
    token_bytes = _token_bytes(state)
    try:
        first = await _until_first_events(group, request)
    except BaseException:
        group.close()
        raise
    if first is None:  # the client left
        group.close()
        return Response(status_code=499)
    if not body.stream:
        return await _whole_response(state, group, request, first, kind, request_id, choices_per_prompt,
                                     token_bytes, top_logprobs, tools)
    options = body.stream_options
    usage_last = options is not None and options.usage_last
    usage_per_chunk = options is not None and options.continuous_usage_stats
    stream = _stream(state, group, first, kind, request_id, choices_per_prompt, token_bytes, usage_last,
                     usage_per_chunk, tools)
    return ReleasingStream(stream, group.close, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _check_held_logprobs(kind: Kind, generations: list[GenerationRequest]) -> None:
    """Refuse a whole response that could hold more than MAX_HELD_LOGPROBS log-probabilities."""
    top = generations[0].top_logprobs
    if top is None:
        return
    tokens = sum(generation.n * (generation.max_tokens + (len(generation.prompt_ids) if generation.echo is not None else 0))
                 for generation in generations)
    held = tokens * (top + 1)
    if held > MAX_HELD_LOGPROBS:
        param = "top_logprobs" if kind == "chat" else "logprobs"
        raise bad_request(param, f"this response could hold {held} log-probabilities ({tokens} tokens: each choice's "
                                 f"max_tokens, and its prompt where echoed; {top + 1} log-probabilities per token), "
                                 "more than the "
                                 f"{MAX_HELD_LOGPROBS} one response may hold; stream it (stream: true), or ask for "
                                 "fewer tokens, choices or top log-probabilities")


async def _until_first_events(group: RequestGroup, request: Request) -> Batch | None:
    """The group's first hand-off, or None when the client disconnects first. A failure before any token
    is raised (answered with its status, not a 200 stream)."""
    first = await unless_disconnected(request, group.next_batch())
    if first is None:
        return None
    for event in first[1]:
        if isinstance(event, Failed):
            raise event.error  # an APIError (see RequestGroup._as_refusal)
    return first


async def unless(work: Awaitable[Any], stop: Awaitable[Any]) -> tuple[bool, Any]:
    """``(True, work's result)``; ``(False, None)``, ``work`` cancelled, when ``stop`` ends first. Cancelled
    itself, it cancels ``work`` too."""
    work_task = asyncio.ensure_future(work)
    stop_task = asyncio.ensure_future(stop)
    try:
        done, _ = await asyncio.wait({work_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work_task.cancel()
        raise
    finally:
        stop_task.cancel()
    if work_task not in done:
        work_task.cancel()
        return False, None
    return True, work_task.result()


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result, or None (``work`` cancelled) when the client disconnects first."""
    _, result = await unless(work, _disconnected(request))
    return result


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _token_bytes(state: ServerState) -> TokenBytes:
    assert state.llm is not None
    return state.llm.tokenizer.token_bytes


class _Tally:
    """What a request's events add up to: each choice's output, and the usage."""

    def __init__(self, per_prompt: int):
        self.per_prompt = per_prompt
        self.choices: dict[int, ChoiceState] = {}
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def take(self, slot: int, events: list[Event]) -> dict[int, list[Delta]]:
        """Count one hand-off; returns its deltas by choice index. A failure is raised as its APIError."""
        deltas: dict[int, list[Delta]] = {}
        for event in events:
            if isinstance(event, Delta):
                index = slot * self.per_prompt + event.index
                self.choices.setdefault(index, ChoiceState(index)).add(event)
                deltas.setdefault(index, []).append(event)
            elif isinstance(event, Done):
                self.prompt_tokens += event.prompt_tokens
                self.completion_tokens += event.completion_tokens
                self.cached_tokens += event.cached_tokens
            elif isinstance(event, Failed):
                raise event.error  # an APIError (see RequestGroup._as_refusal)
        return deltas

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def count_finished(self, metrics: ServerMetrics) -> None:
        for choice in self.choices.values():
            metrics.finished_choices.labels(choice.finish_reason or "none").inc()


async def _whole_response(
    state: ServerState,
    group: RequestGroup,
    request: Request,
    first: Batch,
    kind: Kind,
    request_id: str,
    per_prompt: int,
    token_bytes: TokenBytes,
    top_logprobs: int | None,
    tools: ToolRequest | None,
) -> Response:
    tally = _Tally(per_prompt)

    async def collect() -> bool:
        tally.take(*first)
        while (batch := await group.next_batch()) is not None:
            tally.take(*batch)
        return True

    try:
        if await unless_disconnected(request, collect()) is None:
            return Response(status_code=499)
    except Exception:
        group.failed = True  # answered as an error (a fault of ours: a 500), not counted as a cancel
        raise
    finally:
        group.close()
    tally.count_finished(state.metrics)
    ordered = [tally.choices.get(i, ChoiceState(i)) for i in range(len(group.handles) * per_prompt)]
    listed = sum(len(choice.logprobs) for choice in ordered)  # (an echoed prompt's included)
    entries = tally.completion_tokens if top_logprobs is None else listed * (top_logprobs + 2)
    assert state.llm is not None
    calls_of = None if tools is None else lambda text: _calls_of(tools, text)
    build = functools.partial(response_json, kind, request_id, state.served_model_name, state.fingerprint, ordered,
                              tally.usage(), token_bytes, state.llm.tokenizer.control_ids, top_logprobs is not None,
                              calls_of)
    return Response(await run_in_threadpool(build) if entries > LARGE_BODY else build(), media_type="application/json")


def _calls_of(tools: ToolRequest, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    content, calls = read_calls(tools.reader(), text)
    return content, [call.as_json() for call in calls]


async def _stream(
    state: ServerState,
    group: RequestGroup,
    first: Batch,
    kind: Kind,
    request_id: str,
    per_prompt: int,
    token_bytes: TokenBytes,
    usage_last: bool,
    usage_per_chunk: bool,
    tools: ToolRequest | None,
) -> AsyncIterator[bytes]:
    """The SSE events of a stream; ``usage_last``: a last chunk holds the request's usage; ``usage_per_chunk``: every
    chunk holds its choice's usage so far (see :class:`~pie.serve.protocol.StreamOptions`). Where ``tools`` are read,
    a choice's text that may be a tool call is held until the call is whole, and sent as one ``delta.tool_calls``
    entry (see :class:`~pie.serve.tool_calls.CallReader`)."""
    created = now()
    model, fingerprint = state.served_model_name, state.fingerprint
    tally = _Tally(per_prompt)
    text_offsets: dict[int, TextOffsets] = {}
    readers: dict[int, CallReader] = {}
    assert state.llm is not None
    control_ids = state.llm.tokenizer.control_ids

    def chunks(choice_entries: list[dict[str, Any]]) -> list[bytes]:
        """One chunk per choice, as OpenAI and vLLM send them (clients read ``chunk.choices[0]``)."""
        events = []
        for entry in choice_entries:
            body = chunk_body(kind, request_id, created, model, fingerprint, [entry])
            if usage_per_chunk:
                body["usage"] = choice_usage(entry["index"])
            events.append(format_sse_event(data_str=json.dumps(body)))
        return events

    def choice_usage(index: int) -> dict[str, int]:
        prompt = len(group.requests[index // per_prompt].prompt_ids)
        made = tally.choices[index].tokens if index in tally.choices else 0
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def entries(slot: int, events: list[Event]) -> list[dict[str, Any]]:
        """One hand-off as chunk entries: a choice's deltas merged into one (a client that lags gets fewer)."""
        out = []
        for index, deltas in tally.take(slot, events).items():
            text = "".join(d.text for d in deltas)
            logprob_entries = [entry for d in deltas for entry in d.logprobs]
            reason = deltas[-1].finish_reason
            if not text and reason is None and not logprob_entries:
                continue
            if kind == "chat":
                delta: dict[str, Any] = {}
                if tools is not None:
                    if index not in readers:
                        readers[index] = tools.reader()
                    reader = readers[index]
                    text, calls = reader.push(text)
                    if reason is not None:
                        rest, more = reader.flush()
                        text, calls = text + rest, calls + more
                        reason = tool_calls_finish(reason) if reader.calls else reason
                    if calls:
                        first_index = reader.calls - len(calls)
                        delta["tool_calls"] = [{"index": first_index + number, **call.as_json()}
                                               for number, call in enumerate(calls)]
                    if not text and not calls and reason is None and not logprob_entries:
                        continue
                if text:
                    delta = {"content": text, **delta}
                logprobs = chat_logprobs(logprob_entries, token_bytes) if logprob_entries else None
                out.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
            else:
                offsets = text_offsets.setdefault(index, TextOffsets(control_ids))
                logprobs = completion_logprobs(logprob_entries, token_bytes, offsets) if logprob_entries else None
                out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
        return out

    try:
        if kind == "chat":
            for event in chunks([
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(len(group.handles) * per_prompt)
            ]):
                yield event
        try:
            for event in chunks(entries(*first)):
                yield event
            while group.open:
                try:
                    batch = await asyncio.wait_for(group.next_batch(), KEEPALIVE_S)
                except TimeoutError:
                    yield KEEPALIVE_COMMENT
                    continue
                if batch is None:
                    break
                for event in chunks(entries(*batch)):
                    yield event
        except Exception as exc:  # a failure, or a fault of ours: either way the stream ends with an error event
            if isinstance(exc, APIError):
                error = exc
            else:
                log.exception("internal error in the stream of %s", request_id)
                error = internal_error(exc)
                group.failed = True  # counted as this error, not as a cancel
            state.metrics.errors.labels(str(error.status)).inc()
            yield format_sse_event(data_str=json.dumps(error.event_body()))
            yield format_sse_event(data_str="[DONE]")  # as vLLM ends one: a reader that waits for it sees the end
            return
        tally.count_finished(state.metrics)
        if usage_last:
            body = chunk_body(kind, request_id, created, model, fingerprint, [])
            body["usage"] = tally.usage()
            yield format_sse_event(data_str=json.dumps(body))
        yield format_sse_event(data_str="[DONE]")
    finally:
        group.close()


# -- errors and limits ---------------------------------------------------------


def http_api_error(request: Request, error: StarletteHTTPException) -> APIError:
    """Starlette's own refusal (no such path, a method the path does not take, a body FastAPI could not read) in
    OpenAI's error shape."""
    if isinstance(error.__cause__, RecursionError):  # FastAPI's "There was an error parsing the body", which says why
        return bad_request(None, "the body is not valid JSON here: it is nested too deeply")
    if isinstance(error.__cause__, ValueError) and "integer string conversion" in str(error.__cause__):
        return bad_request(None, f"the body is not valid JSON here: a number in it has more than "
                                 f"{sys.get_int_max_str_digits()} digits")
    if isinstance(error.__cause__, UnicodeDecodeError):
        bad = error.__cause__
        return bad_request(None, f"the body is not valid JSON: JSON is UTF-8 text, and byte {bad.start} of the body "
                                 f"(0x{bad.object[bad.start]:02x}) is not UTF-8 (another encoding, such as Latin-1?)")
    detail = error.detail if isinstance(error.detail, str) else "error"
    if error.status_code == 404:
        detail = f"no such path: {request.method} {request.url.path}"
    allowed = (error.headers or {}).get("Allow")
    if error.status_code == 405 and allowed:  # a browser's GET of /v1/chat/completions, say
        detail = f"{request.method} {request.url.path}: this path takes {allowed.replace(', ', ' or ')}"
    return APIError(error.status_code, detail, headers=dict(error.headers) if error.headers else None)


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    def answer(error: APIError) -> JSONResponse:
        state.metrics.errors.labels(str(error.status)).inc()
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return answer(error)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        # A check of ours (a value error) says more than the union members it made fail ("not a valid string").
        first = next((p for p in problems if p.get("type") == "value_error"), problems[0] if problems else {})
        kind = first.get("type")
        if kind == "json_invalid":  # the decoder's own words and where it stopped, not FastAPI's "JSON decode error"
            at = first.get("loc", ())[-1:]
            where = f" at character {at[0]}" if at and isinstance(at[0], int) else ""
            why = first.get("ctx", {}).get("error") or first.get("msg", "")
            return answer(bad_request(None, f"the body is not valid JSON: {why}{where}"))
        # A union's members are named in the location ("stop", "list[str]", 0): the field is what the client wrote.
        param = field_path(part for part in first.get("loc", ()) if part != "body" and not _member_tag(part))
        if param is None and kind == "missing":
            return answer(bad_request(None, "the request has no JSON body"))
        if param is None and kind in ("model_attributes_type", "model_type"):
            return answer(_not_an_object(request, first.get("input")))
        if kind == "extra_forbidden":
            message = "not a field this server knows (a misspelling, or an option it does not have)"
        elif kind == "value_error":
            message = str(first["ctx"]["error"]) if "error" in first.get("ctx", {}) else first.get("msg", "")
        elif any(_member_tag(part) for part in first.get("loc", ())):
            message = "not of a type this field takes"  # every member of the union refused it
        else:
            message = first.get("msg", "invalid request")
        return answer(bad_request(param, f"{param}: {message}" if param else message))

    def left(scope: Scope) -> None:
        state.metrics.cancelled.inc()
        log.debug("the connection of the client%s closed before the body of its request %s %s was read (it left, "
                  "or sent it too slowly)", client_address(scope), scope["method"], scope["path"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> Response:
        if isinstance(error.__cause__, ClientDisconnect):  # FastAPI's "There was an error parsing the body"
            left(request.scope)
            return Response(status_code=499)  # no one to send it to
        return answer(http_api_error(request, error))

    app.add_middleware(UnexpectedErrors, answered=lambda: state.metrics.errors.labels("500").inc(), left=left)


JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean",
              type(None): "null"}


def _not_an_object(request: Request, body: Any) -> APIError:
    """A 400 for a body that is no JSON object: ``body`` is its bytes where it was not read as JSON (sent without
    the JSON Content-Type, as ``curl -d`` sends it), else the JSON value it is."""
    if not isinstance(body, bytes):
        return bad_request(None, f"the body must be a JSON object, not {JSON_KINDS.get(type(body), 'another value')}")
    sent = request.headers.get("content-type")
    said = f"this request's Content-Type is {quoted(sent)}" if sent else "this request has no Content-Type"
    return bad_request(None, f"the body must be a JSON object, sent with Content-Type: application/json ({said})")


class UnexpectedErrors:
    """A fault of the server's own, met while answering a request, as a 500 with OpenAI's error JSON, logged once.

    (Starlette's handler for ``Exception`` answers and then raises the exception again, for the server to log:
    a second traceback, and uvicorn drops the keep-alive connection the client would send its next request on.)
    ``answered`` (when given) is called for each 500 sent, ``left`` with the scope of each request whose client left
    while its body was read."""

    def __init__(self, app: ASGIApp, answered: Callable[[], None] | None = None,
                 left: Callable[[Scope], None] | None = None):
        self.app = app
        self.answered = answered
        self.left = left

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = gone = False

        async def watched(message: Message) -> None:
            nonlocal started, gone
            started = started or message["type"] == "http.response.start"
            try:
                await send(message)
            except Exception:
                gone = True  # the server could not write to the client: it has left
                raise

        try:
            await self.app(scope, receive, watched)
        except ClientDisconnect:  # the client left while its request was read: no one to answer, nothing of ours failed
            if self.left is not None:
                self.left(scope)
            return
        except BaseException as error:
            if not (isinstance(error, Exception) or is_rust_panic(error)):  # a cancellation, the process's exit
                raise
            if gone:
                return  # likewise, met while answering
            log.exception("internal error on %s %r", scope["method"], scope["path"])  # %r: a newline stays in its line
            if started:  # too late for a status: the response ends short, and the client sees it cut
                return
            failure = internal_error(error)
            if self.answered is not None:
                self.answered()
            await JSONResponse(failure.body(), status_code=failure.status)(scope, receive, send)


def allow_origins(app: FastAPI, settings: ServeSettings, refused: Callable[[], None] | None = None) -> None:
    """Let the scripts of the pages of ``settings.allowed_origins`` call the API (CORS), where it names any: outside the
    key check, whose 401 a browser's preflight (which carries no key) would get. ``refused`` is called for each
    preflight refused (a 400 in OpenAI's error JSON)."""
    if settings.allowed_origins:
        # Any header: OpenAI's JS client sends its own (x-stainless-os, ...) on every request. The origins are named
        # and no cookie is sent, and the key is checked as ever.
        app.add_middleware(AllowedOrigins, refused=refused, allow_origins=list(settings.allowed_origins),
                           allow_methods=["GET", "POST", "DELETE"], allow_headers=["*"],
                           expose_headers=[REQUEST_ID_HEADER], max_age=600)


REQUEST_ID_HEADER = "x-request-id"
CLIENT_REQUEST_ID = re.compile(rb"[\x20-\x7e]{1,128}")
"""The X-Request-Id of a client's that is sent back: 1 to 128 printable ASCII characters."""


class RequestIds:
    """Every response carries ``x-request-id``, as OpenAI's do (openai-python shows it as ``_request_id``, and on an
    error as ``request_id``): the client's own X-Request-Id where it sent one (:data:`CLIENT_REQUEST_ID`; another
    is ignored, as are two), else the one the response holds (a generation's completion id), else a new one. A
    plain ASGI middleware: Starlette's BaseHTTPMiddleware would keep a stream whose client left from being
    cancelled."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = REQUEST_ID_HEADER.encode()
        sent = [value for key, value in scope["headers"] if key == name]
        given = sent[0] if len(sent) == 1 and CLIENT_REQUEST_ID.fullmatch(sent[0]) else None

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                own = next((value for key, value in headers if key.lower() == name), None)
                request_id = given or own or f"req_{secrets.token_hex(16)}".encode()
                headers = [(key, value) for key, value in headers if key.lower() != name] + [(name, request_id)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)


class BodyLimit:
    """413 for a body over the limit, by its Content-Length or, when chunked, as it arrives, and the connection
    closed (the server would read the rest of the body, however long, to reach the next request); ``refused``
    (when given) is called for each one refused."""

    def __init__(self, app: ASGIApp, limit: int, refused: Callable[[], None] | None = None):
        self.app = app
        self.limit = limit
        self.refused = refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                too_large = int(declared) > self.limit
            except ValueError:
                too_large = False
            if too_large:
                await self._refuse(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        received = 0
        buffered: list[Message] = []
        while True:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            received += len(message.get("body", b""))
            if received > self.limit:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body"):
                break

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is over the limit of {self.limit} bytes", code="request_too_large")
        if self.refused is not None:
            self.refused()
        await JSONResponse(error.body(), status_code=413, headers={"Connection": "close"})(scope, receive, send)
