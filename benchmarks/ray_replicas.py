"""`pie serve --ray` on a local two-node Ray cluster (one CPU each): 1 replica against 2, and the ingress's cost.

    python benchmarks/ray_replicas.py [--model NAME] [--concurrency 8] [--requests 32] [--output-tokens 32]
                                      [--runs 3] [--latency-pairs 200]

Two raylets on this host (``ray.cluster_utils.Cluster``, as Ray's own tests run), dashboard off,
and `pie serve --ray ADDRESS --replicas 2`: each replica holds one Ray CPU and is held to a core
of its own (``--replica-pin-cores``: Ray counts CPUs but pins none, and the CPU engine's kernels
would otherwise take every core of the host). The CPU engine, SmolLM2-135M by default.

1. Throughput, the same closed-loop load sent to one replica straight and to both through the
   ingress, alternating (ABBA) so the machine's drift falls on both: ``--concurrency`` `openai`
   clients stream ``--requests`` completions in all, distinct prompts of about 40 tokens, greedy,
   ``ignore_eos`` (every request makes exactly ``--output-tokens``). Aggregate output tokens/s over
   the load's wall time, median of ``--runs`` of each. (One replica straight carries no ingress cost:
   the ratio is conservative.)
2. The ingress's added latency, at rest: ``--latency-pairs`` pairs of the same request sent straight
   to a replica and through the ingress, in alternating order, one at a time (a completion of one
   token, whole; and streamed, to its first token). p50/p99 of each, and of the per-pair differences.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
from ray.cluster_utils import Cluster

PIE = str(Path(sys.executable).with_name("pie"))
LISTENING = re.compile(r"listening on (http://[^\s;]+)")
WORDS = ("fox river pie cache page token model batch kernel layer paged stream engine device profile graph "
         "region epilogue sampler server client request answer question").split()
NODE_MEMORY = 80 << 20


def prompt_text(index: int, words: int = 28) -> str:
    """A distinct prompt of about 40 tokens: the request's number, then words picked by it."""
    picked = [WORDS[(index * 7 + i * 3 + i * i) % len(WORDS)] for i in range(words)]
    return f"Request {index}: " + " ".join(picked) + ". Continue:"


class Ingress:
    """`pie serve --ray ADDRESS --replicas N` as a child process, its output in a file."""

    def __init__(self, address: str, replicas: int, model: str | None):
        self.log = Path(tempfile.mkstemp(prefix="pie-ray-", suffix=".log")[1])
        command = [PIE, "serve", "--host", "127.0.0.1", "--port", "0", "--ray", address, "--replicas", str(replicas),
                   "--replica-pin-cores", "--kv-tokens", "16384", "--served-model-name", "bench"]
        if model:
            command += ["--model", model]
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env={**os.environ, "PIE_ENGINES": "cpu"})
        self.url = ""
        self.replica_urls: list[str] = []
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"pie serve --ray exited with {self.process.returncode}:\n{self.log.read_text()}")
            self.url = self.url or (m.group(1) if (m := LISTENING.search(self.log.read_text())) else "")
            if self.url:
                try:
                    health = httpx.get(f"{self.url}/health", timeout=5).json()
                    if health.get("status") == "ready":
                        self.replica_urls = [d["url"] for d in health["detail"]]
                        return
                except (httpx.HTTPError, ValueError):
                    pass
            time.sleep(0.2)
        self.stop()
        raise SystemExit(f"pie serve --ray was not ready in 600 s:\n{self.log.read_text()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


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


def latency_pairs(ingress_url: str, replica_urls: list[str], pairs: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per request straight to a replica (each in turn) and through the ingress, both kinds, pairs in
    alternating order."""
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

        for measure, kind in ((whole, "whole"), (first_token, "stream")):
            for url in [*replica_urls, ingress_url] * 5:  # warm every path: connections, the engine's buckets
                measure(url)
            for pair in range(pairs):
                order = (("direct", replica_urls[pair // 2 % len(replica_urls)]), ("ingress", ingress_url))
                for name, url in order if pair % 2 == 0 else order[::-1]:
                    found[kind][name].append(measure(url))
    return found


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model name or path (default: pie's default, SmolLM2-135M)")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--latency-pairs", type=int, default=200)
    args = parser.parse_args()

    print(f"cores {len(os.sched_getaffinity(0))}; load: {args.concurrency} clients, {args.requests} streamed "
          f"completions of {args.output_tokens} tokens, median of {args.runs} runs", flush=True)
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "include_dashboard": False, "object_store_memory": NODE_MEMORY})
    rates: dict[int, list[float]] = {1: [], 2: []}
    try:
        cluster.add_node(num_cpus=1, object_store_memory=NODE_MEMORY)
        ingress = Ingress(cluster.address, 2, args.model)
        try:
            targets = {1: ingress.replica_urls[0], 2: ingress.url}
            for url in (*ingress.replica_urls, ingress.url):  # warm-up: every replica's batch buckets
                asyncio.run(run_load(url, args.concurrency, args.concurrency * 2, 8, 10_000))
            for run in range(args.runs):
                for replicas in (1, 2) if run % 2 == 0 else (2, 1):
                    rate, failures = asyncio.run(
                        run_load(targets[replicas], args.concurrency, args.requests, args.output_tokens, run * 1000))
                    rates[replicas].append(rate)
                    where = "one replica, straight" if replicas == 1 else "two replicas, through the ingress"
                    print(f"  run {run + 1}, {where}: {rate:.1f} tok/s" + (f", {failures} failed" if failures else ""),
                          flush=True)
            latency = latency_pairs(ingress.url, ingress.replica_urls, args.latency_pairs)
        finally:
            ingress.stop()
    finally:
        cluster.shutdown()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    ratio = statistics.median(b / a for a, b in zip(rates[1], rates[2]))
    print(f"\naggregate output tok/s: 1 replica {one:.1f}, 2 replicas {two:.1f} (median of the runs' ratios "
          f"{ratio:.2f}x)")
    for kind, label in (("whole", "a 1-token completion, whole"), ("stream", "streamed, to the first token")):
        direct, through = latency[kind]["direct"], latency[kind]["ingress"]
        added = [b - a for a, b in zip(direct, through)]
        print(f"{label} ({len(direct)} pairs): direct p50 {pct(direct, 0.5) * 1e3:.2f} ms p99 "
              f"{pct(direct, 0.99) * 1e3:.2f}; through the ingress p50 {pct(through, 0.5) * 1e3:.2f} ms p99 "
              f"{pct(through, 0.99) * 1e3:.2f}; added p50 {pct(added, 0.5) * 1e3:.2f} ms p99 {pct(added, 0.99) * 1e3:.2f}")


if __name__ == "__main__":
    main()
