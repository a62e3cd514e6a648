"""`pie serve --ray` on a local two-node Ray cluster (one CPU each): 1 replica against 2, and the ingress's cost.

    python benchmarks/ray_replicas.py [--model NAME] [--concurrency 8,32] [--requests-per-client 4]
                                      [--output-tokens 32] [--runs 3] [--latency-pairs 200]

Two raylets on this host (``ray.cluster_utils.Cluster``, as Ray's own tests run), dashboard off,
and `pie serve --ray ADDRESS --replicas 2`: each replica holds one Ray CPU and is held to a core
of its own (``--replica-pin-cores``: Ray counts CPUs but pins none, and the CPU engine's kernels
would otherwise take every core of the host). The CPU engine, SmolLM2-135M by default.

1. Throughput under the same closed-loop load, per ``--concurrency``: C `openai` clients stream
   ``--requests-per-client`` completions each, distinct prompts of about 40 tokens, greedy,
   ``ignore_eos`` (every request makes exactly ``--output-tokens``), sent to one replica straight,
   to both straight (C/2 clients each: what two replicas give without the ingress), and to both
   through the ingress; the three in rotating order, so the machine's drift falls on all. Aggregate
   output tokens/s over the load's wall time, median of ``--runs``; the ratios are medians of the
   runs' ratios. (One replica straight carries no ingress cost: the ratio is conservative.) And the
   CPU time the ingress's process spent per output token it passed on (it shares the 2 cores).
2. The ingress's added latency, at rest: ``--latency-pairs`` pairs of the same request sent straight
   to a replica and through the ingress, in alternating order, one at a time (a completion of one
   token, whole; and streamed, to its first token). p50/p99 of each, and of the per-pair differences;
   and the CPU time the ingress's process spent per request it passed on, less what it spends idle
   (its Ray threads and replica polls, measured for ``IDLE_S`` first).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from pathlib import Path

import httpx
import openai
from ray.cluster_utils import Cluster
from serve_load import PIE, Server, prompt_text

NODE_MEMORY = 80 << 20
IDLE_S = 5.0


class Ingress:
    """`pie serve --ray ADDRESS --replicas N` as a child process (serve_load's Server), once every replica is ready."""

    def __init__(self, address: str, replicas: int, model: str | None):
        command = [PIE, "serve", "--host", "127.0.0.1", "--port", "0", "--ray", address, "--replicas", str(replicas),
                   "--replica-pin-cores", "--kv-tokens", "16384", "--served-model-name", "bench"]
        if model:
            command += ["--model", model]
        self.server = Server(command, "", "pie-ray-bench", {"PIE_ENGINES": "cpu"})
        self.process = self.server.process
        self.replica_urls: list[str] = []
        try:
            self.url = self.server.wait(r"listening on (http://\S+?);")
            self.replica_urls = self._wait_ready(time.monotonic() + 600)
        except RuntimeError as exc:  # says what the server printed
            self.stop()
            raise SystemExit(str(exc)) from None

    def _wait_ready(self, deadline: float) -> list[str]:
        """The replicas' addresses once every replica is ready (not merely some: degraded answers 200 too)."""
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                health = httpx.get(f"{self.url}/health", timeout=5).json()
                if health.get("status") == "ready":
                    return [d["url"] for d in health["detail"]]
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.2)
        self.server.log.seek(0)
        raise RuntimeError(f"pie serve --ray was not ready (exit status {self.process.poll()}):\n{self.server.log.read()}")

    def cpu_seconds(self) -> float:
        """CPU time the ingress's process has used so far (user and system)."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.server.stop()


async def run_load(url: str, clients: int, requests: int, output_tokens: int, offset: int) -> tuple[float, int]:
    """Output tokens/s over the load's wall time, and how many requests failed."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    queue = list(range(offset, offset + requests))
    tokens = failures = 0

    async def worker() -> None:
        nonlocal tokens, failures
        while queue:
            index = queue.pop(0)
            try:
                stream = await client.completions.create(
                    model="bench", prompt=prompt_text(index), max_tokens=output_tokens, temperature=0, stream=True,
                    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens += chunk.usage.completion_tokens
            except openai.APIError:
                failures += 1

    start = time.perf_counter()
    try:
        await asyncio.gather(*(worker() for _ in range(clients)))
    finally:
        await client.close()
    return tokens / (time.perf_counter() - start), failures


def latency_pairs(ingress: Ingress, pairs: int) -> tuple[dict[str, dict[str, list[float]]], float]:
    """Seconds per request straight to a replica (each in turn) and through the ingress, both kinds, pairs in
    alternating order; and the ingress's CPU milliseconds per request it passed on, its idle rate subtracted."""
    ingress_url, replica_urls = ingress.url, ingress.replica_urls
    found: dict[str, dict[str, list[float]]] = {kind: {"direct": [], "ingress": []} for kind in ("whole", "stream")}
    body = {"model": "bench", "prompt": "Request 0: fox river pie. Continue:", "max_tokens": 1, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        def whole(url: str) -> float:
            start = time.perf_counter()
            reply = http.post(f"{url}/v1/completions", json=body)
            elapsed = time.perf_counter() - start
            assert reply.status_code == 200, reply.text
            return elapsed

        def first_token(url: str) -> float:
            start = time.perf_counter()
            elapsed = None
            with http.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as reply:
                assert reply.status_code == 200
                for line in reply.iter_lines():  # read to the end: the next request reuses the connection
                    if elapsed is None and line.startswith("data: {"):
                        elapsed = time.perf_counter() - start
            assert elapsed is not None
            return elapsed

        for measure in (whole, first_token):
            for url in [*replica_urls, ingress_url] * 5:  # warm every path: connections, the engine's buckets
                measure(url)
        before = ingress.cpu_seconds()
        time.sleep(IDLE_S)
        idle_rate = (ingress.cpu_seconds() - before) / IDLE_S
        before, start = ingress.cpu_seconds(), time.monotonic()
        for measure, kind in ((whole, "whole"), (first_token, "stream")):
            for pair in range(pairs):
                order = (("direct", replica_urls[pair // 2 % len(replica_urls)]), ("ingress", ingress_url))
                for name, url in order if pair % 2 == 0 else order[::-1]:
                    found[kind][name].append(measure(url))
        busy = ingress.cpu_seconds() - before - idle_rate * (time.monotonic() - start)
    return found, busy * 1e3 / (2 * pairs)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model name or path (default: pie's default, SmolLM2-135M)")
    parser.add_argument("--concurrency", default="8,32", help="client counts, comma-separated")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-pairs", type=int, default=200)
    args = parser.parse_args()

    loads = [int(c) for c in args.concurrency.split(",")]
    if min(loads) < 2:
        parser.error("--concurrency: each load needs at least 2 clients, one for each of the two replicas")
    print(f"cores {len(os.sched_getaffinity(0))}; loads of {', '.join(map(str, loads))} clients, "
          f"{args.requests_per_client} streamed completions of {args.output_tokens} tokens per client, "
          f"median of {args.runs} runs", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": NODE_MEMORY})
    series = ("one replica, straight", "two replicas, straight", "two replicas, through the ingress")
    rates: dict[int, dict[str, list[float]]] = {c: {name: [] for name in series} for c in loads}
    ingress_cpu: dict[int, list[float]] = {c: [] for c in loads}
    """CPU milliseconds the ingress spent per output token it passed on, per load."""
    try:
        cluster.add_node(num_cpus=1, object_store_memory=NODE_MEMORY)
        ingress = Ingress(cluster.address, 2, args.model)
        try:
            first, second = ingress.replica_urls

            async def load(name: str, clients: int, offset: int) -> float:
                requests = clients * args.requests_per_client
                if name == series[0]:
                    parts = [run_load(first, clients, requests, args.output_tokens, offset)]
                elif name == series[1]:  # the clients split between the two, the odd one to the first
                    shares = (clients - clients // 2, clients // 2)
                    parts = [run_load(url, share, share * args.requests_per_client, args.output_tokens,
                                      offset + i * requests)
                             for i, (url, share) in enumerate(zip((first, second), shares))]
                else:
                    parts = [run_load(ingress.url, clients, requests, args.output_tokens, offset)]
                done = await asyncio.gather(*parts)
                failures = sum(f for _, f in done)
                if failures:
                    print(f"  {failures} request(s) failed", flush=True)
                return sum(rate for rate, _ in done)

            for url in (first, second, ingress.url):  # warm-up: every replica's batch buckets
                for clients in loads:
                    asyncio.run(run_load(url, clients, clients, 8, 100_000))
            for clients in loads:
                for run in range(args.runs):
                    for name in series if run % 2 == 0 else series[::-1]:
                        before = ingress.cpu_seconds()
                        rate = asyncio.run(load(name, clients, (run + 1) * 10_000 + clients))
                        rates[clients][name].append(rate)
                        if name == series[2]:
                            tokens = clients * args.requests_per_client * args.output_tokens
                            ingress_cpu[clients].append((ingress.cpu_seconds() - before) * 1e3 / tokens)
                        print(f"  {clients} clients, run {run + 1}, {name}: {rate:.1f} tok/s", flush=True)
            latency, latency_cpu = latency_pairs(ingress, args.latency_pairs)
        finally:
            ingress.stop()
    finally:
        cluster.shutdown()
    print()
    for clients in loads:
        found = rates[clients]
        one, two, through = (found[name] for name in series)
        print(f"{clients} clients, aggregate output tok/s: one replica {statistics.median(one):.1f}, two straight "
              f"{statistics.median(two):.1f}, two through the ingress {statistics.median(through):.1f}; "
              f"through the ingress / one replica {statistics.median(b / a for a, b in zip(one, through)):.2f}x, "
              f"/ two straight {statistics.median(b / a for a, b in zip(two, through)):.2f}x; the ingress's CPU "
              f"{statistics.median(ingress_cpu[clients]):.2f} ms per output token")
    for kind, label in (("whole", "a 1-token completion, whole"), ("stream", "streamed, to the first token")):
        direct, through = latency[kind]["direct"], latency[kind]["ingress"]
        added = [b - a for a, b in zip(direct, through)]
        print(f"{label} ({len(direct)} pairs): direct p50 {pct(direct, 0.5) * 1e3:.2f} ms p99 "
              f"{pct(direct, 0.99) * 1e3:.2f}; through the ingress p50 {pct(through, 0.5) * 1e3:.2f} ms p99 "
              f"{pct(through, 0.99) * 1e3:.2f}; added p50 {pct(added, 0.5) * 1e3:.2f} ms p99 {pct(added, 0.99) * 1e3:.2f}")
    print(f"the ingress's CPU per request it passed on, at rest: {latency_cpu:.2f} ms (its idle use subtracted)")


if __name__ == "__main__":
    main()
