"""The server's Prometheus metrics, all under the ``pie:`` prefix, in one registry per server.

The runtime's numbers (requests running and waiting, KV pages, the prefix cache,
preemptions, steps) are read from the engine when scraped; what only the HTTP side
sees (token totals, latencies, finished and failed requests) is counted as it happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Receive, Scope, Send

if TYPE_CHECKING:
    from pie.serve.engine import Engine

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
                   1280.0, 2560.0)
"""Up to 43 minutes: a long generation on a CPU engine runs for many minutes, and a histogram's percentiles stop at
its last bucket."""
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


ARRIVAL = "pie.arrival"
"""The scope key of when a request arrived (its head read, before its body), by its server's ``ServerMetrics.clock``:
where its time to first token and its latency start (see :class:`Arrivals`)."""


class ServerMetrics:
    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        """What latencies are measured with, in seconds."""
        self.registry = CollectorRegistry()
        self.engine: Engine | None = None
        self.prompt_tokens = Counter(
            "pie:prompt_tokens", "Prompt tokens of requests, counted when their first output comes, and the tokens "
            "of inferlet runs' passes other than decode steps, as each is done.", registry=self.registry,
        )
        self.generation_tokens = Counter(
            "pie:generation_tokens", "Tokens generated, counted as they are handed on; of an inferlet run, one per "
            "decode step (a pass of one token that continues a context).", registry=self.registry
        )
        self.finished_choices = Counter(
            "pie:finished_choices", "Choices (n per request) finished, by finish reason.", ["finish_reason"],
            registry=self.registry,
        )
        self.errors = Counter(
            "pie:request_errors", "Requests and inferlet runs answered with an error (a stream's as its last event), "
            "by HTTP status.", ["status"], registry=self.registry
        )
        self.cancelled = Counter(
            "pie:requests_cancelled", "Requests and inferlet runs whose client left before their end, and runs "
            "cancelled (DELETE /v1/runs/{id}): their work stopped there.", registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pie:time_to_first_token_seconds", "From arrival to the first token.", buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pie:time_per_output_token_seconds", "Between tokens after the first.", buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "pie:e2e_request_latency_seconds", "From arrival to the last token (to the end of the prompt's pass, for "
            "a request that generates none).", buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_RuntimeCollector(self))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class Arrivals:
    """Stamps each request's arrival in its scope (:data:`ARRIVAL`), before anything reads its body: the time a
    client waits for its first token includes the server's reading, tokenizing and compiling its request."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[ARRIVAL] = self.metrics.clock()
        await self.app(scope, receive, send)


class _RuntimeCollector(Collector):
    """The engine's numbers, read at scrape time (plain integers written by the engine thread)."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        engine = self._metrics.engine
        if engine is None:
            return
        pages = engine.core.runner.pages
        stats = engine.core.stats
        yield _gauge("pie:requests_running", "Requests with sequences in the scheduler.", engine.running_count)
        yield _gauge("pie:requests_waiting", "Requests admitted and waiting for a place.", engine.waiting_count)
        yield _gauge("pie:inferlet_runs", "Inferlet runs in progress.", engine.run_count)
        step = engine.step_seconds()
        yield _gauge("pie:engine_step_age_seconds", "How long the engine's current step (one batched forward pass) "
                     "has run; 0 between steps.", step)
        yield _gauge("pie:engine_stalled", "1 while the engine's current step has run longer than --stall-seconds (a "
                     "kernel or the device hangs: /health answers 503, new requests are refused), else 0.",
                     float(step > engine.stall_seconds))
        yield _gauge("pie:kv_pages_capacity", "KV pages in the device pool.", pages.num_pages)
        yield _gauge("pie:kv_pages_used", "KV pages held by sequences.", pages.used_count)
        yield _gauge("pie:kv_pages_cached", "Prefix-cache pages no sequence holds (free, evicted first).",
                     pages.cached_count)
        host = engine.core.host
        yield _gauge("pie:kv_host_pages_capacity", "KV pages in the host pool (--host-kv-tokens), where preempted "
                     "sequences' pages wait; 0 without one.", host.num_pages if host is not None else 0)
        yield _gauge("pie:kv_host_pages_used", "Host-pool KV pages holding preempted sequences' pages.",
                     host.used_count if host is not None else 0)
        yield _counter("pie:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                       stats.prefix_queried_tokens)
        yield _counter("pie:prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache.",
                       stats.prefix_cached_tokens)
        yield _counter("pie:preemptions", "Sequences preempted for lack of KV pages.", stats.preemptions)
        yield _counter("pie:preemption_recomputes", "Preemptions that dropped their KV pages, to recompute them.",
                       stats.recomputes)
        yield _counter("pie:kv_pages_swapped_out", "KV pages preemptions copied to the host pool.",
                       stats.pages_swapped_out)
        yield _counter("pie:kv_pages_swapped_in", "KV pages copied back from the host pool.", stats.pages_swapped_in)
        yield _counter("pie:kv_swap_failures", "Copies between the device and host KV pools that failed (each such "
                       "sequence was recomputed instead).", stats.swap_failures)
        yield _counter("pie:scheduler_steps", "Batched forward passes.", stats.steps)
        yield _counter("pie:batch_tokens", "Tokens in all forward passes.", stats.forwarded_tokens)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)
