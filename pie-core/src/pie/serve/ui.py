"""`pie serve`'s own web page, and the two JSON endpoints it reads.

- ``GET /`` (and ``/ui/app.js``, ``/ui/style.css``): one page, plain HTML, CSS and
  JavaScript shipped in this package's ``static/`` folder. A chat playground over the
  server's own ``/v1/chat/completions`` and a live view of the runtime. Off with
  ``pie serve --no-ui``.
- ``GET /v1/pie/status``: the runtime's numbers now (:class:`Status`). They are read
  from the server's Prometheus registry, so they are the numbers ``/metrics`` shows at
  the same moment; the page asks for them every second and derives rates itself.
- ``GET /v1/pie/plan``: what the model runs on (:class:`PlanReport`): the engine and
  why it was chosen, the device, the profile in force, and the Poem plan as
  ``pie plan`` prints it. Answered 503 until the model has loaded.

All of these follow the rule of ``/health`` and ``/metrics``: open unless the server
has an API key and ``--protect-probes``. Then they take the key as ``Authorization:
Bearer KEY`` or, because a browser cannot send a header when it opens a page, as the
password of HTTP Basic authentication (any user name): the page and its files answer
401 with a Basic challenge, so the browser asks. The chat itself always needs the key
when the server has one; the page asks for it when the server answers 401 and keeps it
in the tab's session storage.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import Response
from pydantic import BaseModel, Field

from pie.serve.auth import KeyRule
from pie.serve.protocol import APIError

if TYPE_CHECKING:
    from pie.serve.app import ServerState

STATIC_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
"""The page's files (``static/`` in this package) and their media types."""

PAGE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
}
"""Sent with every file of the page: nothing but the server's own files and API runs in it."""



# -- what /v1/pie/status answers -------------------------------------------------


class RequestCounts(BaseModel):
    running: int = Field(description="Requests with sequences in the scheduler (pie:requests_running).")
    waiting: int = Field(description="Requests admitted and waiting for a place (pie:requests_waiting).")
    inferlet_runs: int = Field(description="Inferlet runs in progress (pie:inferlet_runs).")


class KVPages(BaseModel):
    total: int = Field(description="Pages in the device pool (pie:kv_pages_capacity).")
    used: int = Field(description="Pages held by sequences (pie:kv_pages_used).")
    cached: int = Field(description="Prefix-cache pages no sequence holds, evicted first (pie:kv_pages_cached).")
    free: int = Field(description="Pages neither used nor cached: total - used - cached.")
    page_tokens: int = Field(description="Tokens one page holds.")
    host_total: int = Field(description="Pages in the host pool, where preempted sequences' pages wait "
                            "(pie:kv_host_pages_capacity); 0 without one.")
    host_used: int = Field(description="Host-pool pages in use (pie:kv_host_pages_used).")


class PrefixCache(BaseModel):
    enabled: bool
    queried_tokens: int = Field(description="Prompt tokens looked up (pie:prefix_cache_queries_total).")
    hit_tokens: int = Field(description="Of those, tokens whose KV came from the cache (pie:prefix_cache_hits_total).")
    hit_rate: float | None = Field(description="hit_tokens / queried_tokens; null before the first lookup.")


class SchedulerCounts(BaseModel):
    steps: int = Field(description="Batched forward passes (pie:scheduler_steps_total).")
    batch_tokens: int = Field(description="Tokens in all forward passes (pie:batch_tokens_total).")
    preemptions: int = Field(description="Sequences preempted for lack of KV pages (pie:preemptions_total).")


class TokenCounts(BaseModel):
    prompt: int = Field(description="Prompt tokens of requests, and inferlet runs' tokens other than their decode "
                        "steps' (pie:prompt_tokens_total).")
    generation: int = Field(description="Tokens generated for requests and by inferlet runs, one per decode step "
                            "(pie:generation_tokens_total).")


class Status(BaseModel):
    """The runtime's numbers now. Totals are counters since the server started: a client derives rates from
    two answers and their ``time``. The runtime's parts are null until the model has loaded."""

    phase: str = Field(description="'loading', 'ready', 'stalled' (an engine step has run past --stall-seconds: new "
                       "requests are refused until it returns), 'draining' (refusing new requests) or 'failed' (the "
                       "model did not load, or its device was lost).")
    error: str | None = Field(None, description="Why the server does not serve, in phases 'stalled' and 'failed'.")
    model: str = Field(description="The model's name in the API.")
    time: float = Field(description="The server's clock (Unix seconds) when the numbers were read.")
    requests: RequestCounts | None
    kv_pages: KVPages | None
    prefix_cache: PrefixCache | None
    scheduler: SchedulerCounts | None
    tokens: TokenCounts
    errors: int = Field(description="Requests answered with an error, every status (pie:request_errors_total).")


class DeviceReport(BaseModel):
    key: str = Field(description="engine:index, as --engine and PIE_ENGINES name it.")
    name: str
    vendor: str
    architecture: str
    kind: str
    memory_bytes: int
    driver: str


class PlanReport(BaseModel):
    """What the model runs on; it does not change while the server runs."""

    model: str
    engine: str
    engine_reason: str = Field(description="Why this engine runs the model.")
    device: DeviceReport
    profile: str = Field(description="Which device profile chose the kernel variants, and why.")
    context_tokens: int
    kv_tokens: int = Field(description="Tokens the KV pool holds.")
    max_running: int
    plan: str = Field(description="The Poem plan, regions and the kernel (and variant) of each, as `pie plan` prints it.")


def status(state: ServerState) -> Status:
    """The numbers of :class:`Status`, read from the server's metrics registry in one pass."""
    samples: dict[str, float] = {}
    for family in state.metrics.registry.collect():
        for sample in family.samples:  # labelled samples (errors by status) are summed
            samples[sample.name] = samples.get(sample.name, 0.0) + sample.value

    def value(name: str) -> int:
        return int(samples.get(name, 0))

    llm = state.llm
    requests = kv = prefix = scheduler = None
    if llm is not None and "pie:kv_pages_capacity" in samples:  # the engine runs
        requests = RequestCounts(running=value("pie:requests_running"), waiting=value("pie:requests_waiting"),
                                 inferlet_runs=value("pie:inferlet_runs"))
        total, used, cached = value("pie:kv_pages_capacity"), value("pie:kv_pages_used"), value("pie:kv_pages_cached")
        kv = KVPages(total=total, used=used, cached=cached, free=total - used - cached,
                     page_tokens=llm.runner.page_size, host_total=value("pie:kv_host_pages_capacity"),
                     host_used=value("pie:kv_host_pages_used"))
        queried, hits = value("pie:prefix_cache_queries_total"), value("pie:prefix_cache_hits_total")
        prefix = PrefixCache(enabled=state.settings.prefix_caching, queried_tokens=queried, hit_tokens=hits,
                             hit_rate=hits / queried if queried else None)
        scheduler = SchedulerCounts(steps=value("pie:scheduler_steps_total"), batch_tokens=value("pie:batch_tokens_total"),
                                    preemptions=value("pie:preemptions_total"))
    phase = state.phase
    return Status(
        phase=phase,
        error=state.phase_error(phase),
        model=state.served_model_name,
        time=time.time(),
        requests=requests,
        kv_pages=kv,
        prefix_cache=prefix,
        scheduler=scheduler,
        tokens=TokenCounts(prompt=value("pie:prompt_tokens_total"), generation=value("pie:generation_tokens_total")),
        errors=value("pie:request_errors_total"),
    )


def plan_report(state: ServerState) -> PlanReport:
    llm = state.llm
    if llm is None:
        message = f"the model failed to load: {state.load_error}" if state.load_error else "the model is loading"
        raise APIError(503, message, headers={"Retry-After": "5"})
    info = llm.device.info
    return PlanReport(
        model=state.served_model_name,
        engine=info.engine,
        engine_reason=llm.engine_reason,
        device=DeviceReport(key=info.key, name=info.name, vendor=info.vendor, architecture=info.architecture,
                            kind=str(info.kind), memory_bytes=info.memory_bytes, driver=info.driver),
        profile=llm.profile_reason,
        context_tokens=llm.context_length,
        kv_tokens=llm.kv_capacity_tokens,
        max_running=state.settings.max_running,
        plan=llm.runner.plan.describe(),
    )


# -- the routes ------------------------------------------------------------------


def page_key_rule(path: str, open_probes: bool) -> KeyRule | None:
    """How a path of the page or of its endpoints takes the API key (see above); None for other paths."""
    if path in ("/v1/pie/status", "/v1/pie/plan"):
        return "open" if open_probes else "basic"
    if path == "/" or path.startswith("/ui/"):
        return "open" if open_probes else "challenge"
    return None


def install_ui_routes(app: FastAPI, state: ServerState) -> None:
    """The status and plan endpoints, and the page unless ``settings.ui`` is off."""
    settings = state.settings

    @app.get("/v1/pie/status", response_model=Status)
    @app.head("/v1/pie/status", include_in_schema=False)
    async def get_status() -> Status:
        """The runtime's numbers now (the same as /metrics)."""
        return status(state)

    @app.get("/v1/pie/plan", response_model=PlanReport)
    @app.head("/v1/pie/plan", include_in_schema=False)
    async def get_plan() -> PlanReport:
        """The engine, device, profile and Poem plan the model runs with."""
        return plan_report(state)

    if not settings.ui:
        return
    files = {name: _static(name) for name in STATIC_FILES}

    def answer(name: str) -> Response:
        return Response(files[name], media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    async def page() -> Response:
        return answer("index.html")

    @app.api_route("/ui/{name}", methods=["GET", "HEAD"], include_in_schema=False)
    async def page_file(name: str) -> Response:
        if name not in files or name == "index.html":
            raise APIError(404, f"no such file of the page: {name}")
        return answer(name)


def _static(name: str) -> bytes:
    return resources.files("pie.serve").joinpath("static", name).read_bytes()
