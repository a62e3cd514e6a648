"""`pie serve` under streaming load from the official `openai` client, next to llama.cpp's own server.

    python benchmarks/serve_load.py [--concurrency 1,8,32,64] [--output-tokens 32,128] [--runs 3]
                                    [--llama-server PATH] [--llama-quantize PATH]

SmolLM2-135M on the CPU engine (the embedded Q4_1 GGUF, its weights kept in Q4_1). Each
load is closed-loop: N clients each send streaming completions one after another, 2N
requests in all (at least 8), every prompt about 40 tokens and distinct (so no prefix is
shared), greedy, `ignore_eos` so every request makes exactly the tokens asked for. Per load:
aggregate output tokens/s (all tokens over the load's wall time), time to first token p50/p99,
time per output token after the first (per request) p50/p99, the gaps between streamed chunks
p50/p99, how long /health took meanwhile (one probe every 50 ms) p50/p99, and failures. Each figure is
the median over `--runs` runs.

With llama.cpp's server (`--llama-server`, or LLAMA_SERVER; built from the llama.cpp inside the
`llama-cpp-python` sdist, see benchmarks/README.md) the same loads run against it in the same
run, interleaved with pie's, on the Q4_1 file itself (the weights pie runs) and on an F32 GGUF of
them written by its `llama-quantize` (`-np 32 -t 2 -c 8192`); pie's ratio is printed against each.

Then: one client's inter-token p50 against `pie bench`'s decode step (`--runs` pairs of a one-client load
and a bench right after it), and a 200-token system
prompt shared by every request, pie with the prefix cache against pie without it (TTFT p50).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

PIE = str(Path(sys.executable).with_name("pie"))
WORDS = ("fox river pie cache page token model batch kernel layer paged stream engine device profile graph "
         "region epilogue sampler server client request answer question").split()


def prompt_text(index: int, words: int = 28) -> str:
    """A distinct prompt of about 40 tokens: the request's number, then words picked by it."""
    picked = [WORDS[(index * 7 + i * 3 + i * i) % len(WORDS)] for i in range(words)]
    return f"Request {index}: " + " ".join(picked) + ". Continue:"


SYSTEM_PROMPT = ("You are a helpful, precise assistant for a team that builds an LLM serving runtime. "
                 "Answer in plain words, keep answers short, say when you are unsure, and never invent figures. ") * 4


@dataclass
class Outcome:
    ttft: float
    tpot: float | None
    gaps: list[float]
    tokens: int


@dataclass
class Load:
    outcomes: list[Outcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    wall: float = 0.0
    health: list[float] = field(default_factory=list)
    """Seconds each /health request took while the load ran (one every 50 ms)."""

    def summary(self) -> dict[str, float]:
        def pct(values: list[float], q: float) -> float:
            if not values:
                return float("nan")
            ordered = sorted(values)
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

        ttft = [o.ttft for o in self.outcomes]
        tpot = [o.tpot for o in self.outcomes if o.tpot is not None]
        gaps = [g for o in self.outcomes for g in o.gaps]
        return {
            "tok_s": sum(o.tokens for o in self.outcomes) / self.wall if self.wall else 0.0,
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99),
            "tpot_p50": pct(tpot, 0.5), "tpot_p99": pct(tpot, 0.99),
            "itl_p50": pct(gaps, 0.5), "itl_p99": pct(gaps, 0.99),
            "health_p50": pct(self.health, 0.5), "health_p99": pct(self.health, 0.99),
            "failures": float(len(self.failures)),
        }


async def run_load(base_url: str, model: str, clients: int, requests: int, output_tokens: int,
                   system: str | None = None, offset: int = 0) -> Load:
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="bench", max_retries=0, timeout=600)
    load = Load()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for index in range(requests):
        queue.put_nowait(offset + index)

    async def one(index: int) -> None:
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt_text(index)}]
        start = time.perf_counter()
        stamps: list[float] = []
        tokens = 0
        stream = await client.chat.completions.create(
            model=model, messages=messages, max_tokens=output_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        if not stamps or tokens != output_tokens:
            raise RuntimeError(f"request {index}: {tokens} tokens in {len(stamps)} chunks, wanted {output_tokens}")
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        tpot = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
        load.outcomes.append(Outcome(stamps[0] - start, tpot, gaps, tokens))

    async def worker() -> None:
        while not queue.empty():
            index = queue.get_nowait()
            try:
                await one(index)
            except Exception as exc:  # a failure is counted and shown, never hidden
                load.failures.append(f"{type(exc).__name__}: {exc}")

    async def probe_health(http: httpx.AsyncClient) -> None:
        while True:
            sent = time.perf_counter()
            await http.get(f"{base_url}/health")
            load.health.append(time.perf_counter() - sent)
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=60) as http:
        prober = asyncio.ensure_future(probe_health(http))
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        load.wall = time.perf_counter() - start
        prober.cancel()
    await client.close()
    return load


class Server:
    """A server process on a free port, stopped on exit."""

    def __init__(self, command: list[str], ready_url: str, log_name: str, env: dict[str, str] | None = None):
        self.log = open(Path(tempfile.gettempdir()) / f"{log_name}.log", "w+")  # noqa: SIM115
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                        env={**os.environ, **(env or {})})
        self.ready_url = ready_url

    def wait(self, pattern: str | None = None, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log.read()}")
            self.log.seek(0)
            text = self.log.read()
            if pattern is not None:
                found = re.search(pattern, text)
                if found:
                    return found.group(1)
            else:
                try:
                    if httpx.get(self.ready_url, timeout=5).status_code == 200:
                        return ""
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready within {timeout} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        self.log.close()


def start_pie(model: str | None, *extra: str) -> tuple[Server, str]:
    command = [PIE, "serve", "--port", "0", "--served-model-name", "smollm2", "--max-running", "64",
               *(["--model", model] if model else []), *extra]
    server = Server(command, "", "pie-serve-bench", {"PIE_ENGINES": "cpu"})
    url = server.wait(r"listening on (http://\S+?);")
    server.ready_url = f"{url}/health"
    server.wait()
    return server, url


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_llama(binary: str, gguf: Path, parallel: int = 32) -> tuple[Server, str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [binary, "-m", str(gguf), "-t", "2", "-np", str(parallel), "-c", "8192", "--host", "127.0.0.1",
               "--port", str(port), "--alias", "smollm2"]
    server = Server(command, f"{url}/health", f"llama-server-{gguf.stem}")
    server.wait()
    return server, url


def f32_copy(quantize: str, source: Path, directory: Path) -> Path:
    target = directory / "smollm2-f32.gguf"
    subprocess.run([quantize, "--allow-requantize", str(source), str(target), "F32"], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return target


def median_summary(loads: list[Load]) -> dict[str, float]:
    summaries = [load.summary() for load in loads]
    return {key: statistics.median(s[key] for s in summaries) for key in summaries[0]}


def row(label: str, s: dict[str, float]) -> str:
    return (f"| {label} | {s['tok_s']:.1f} | {s['ttft_p50']:.2f} / {s['ttft_p99']:.2f} | "
            f"{s['tpot_p50'] * 1e3:.1f} / {s['tpot_p99'] * 1e3:.1f} | {s['itl_p50'] * 1e3:.1f} / {s['itl_p99'] * 1e3:.1f} "
            f"| {s['health_p50'] * 1e3:.1f} / {s['health_p99'] * 1e3:.1f} | {s['failures']:.0f} |")


def pie_bench_step_ms(model: str | None) -> float:
    command = [PIE, "bench", "--engine", "cpu", "--json", "--runs", "3", *(["--model", model] if model else [])]
    report = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    return 1e3 / report["decode_tokens_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Model for pie (default: the embedded SmolLM2 Q4_1 GGUF).")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--output-tokens", default="32,128")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    parser.add_argument("--llama-quantize", default=os.environ.get("LLAMA_QUANTIZE"))
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    outputs = [int(t) for t in args.output_tokens.split(",")]

    from pie.model.store import resolve_model

    gguf = resolve_model(args.model)
    scratch = Path(tempfile.mkdtemp(prefix="serve-load-"))
    servers: dict[str, tuple[Server, str]] = {"pie": start_pie(args.model)}
    if args.llama_server:
        quantize = args.llama_quantize or str(Path(args.llama_server).with_name("llama-quantize"))
        servers["llama-server F32"] = start_llama(args.llama_server, f32_copy(quantize, gguf, scratch))
        servers["llama-server Q4_1"] = start_llama(args.llama_server, gguf)
    else:
        print("llama-server: not given (--llama-server or LLAMA_SERVER); pie alone")
    print(f"machine: {os.cpu_count()} CPUs; model {gguf.name}; {args.runs} runs per load, median shown")
    try:
        results: dict[tuple[str, int, int], dict[str, float]] = {}
        for tokens in outputs:
            for clients in concurrency:
                requests = max(2 * clients, 8)
                loads: dict[str, list[Load]] = {name: [] for name in servers}
                for run in range(args.runs):
                    order = list(servers) if run % 2 == 0 else list(reversed(servers))
                    for name in order:
                        # Distinct prompts in every run: a repeated prompt would hit pie's prefix cache.
                        offset = (run * len(servers) + order.index(name)) * 10_000 + clients * 100
                        loads[name].append(asyncio.run(run_load(servers[name][1], "smollm2", clients, requests,
                                                                tokens, offset=offset)))
                for name, runs in loads.items():
                    results[(name, tokens, clients)] = median_summary(runs)
                    for load in runs:
                        for failure in load.failures[:3]:
                            print(f"  {name} failure: {failure}")
        print("\n| server, output tokens, clients | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
              "| chunk gap p50 / p99 (ms) | /health p50 / p99 (ms) | failures |")
        print("|---|---|---|---|---|---|---|")
        for (name, tokens, clients), summary in results.items():
            print(row(f"{name}, {tokens}, {clients}", summary))
        for tokens in outputs:
            for clients in concurrency:
                pie_rate = results[("pie", tokens, clients)]
                for peer in ("llama-server Q4_1", "llama-server F32"):
                    other = results.get((peer, tokens, clients))
                    if other:
                        print(f"{tokens} tokens, {clients} clients: pie {pie_rate['tok_s'] / other['tok_s']:.2f}x "
                              f"{peer} aggregate; TTFT p50 {pie_rate['ttft_p50']:.2f} s vs {other['ttft_p50']:.2f} s")
        for name, (server, _) in list(servers.items())[1:]:
            server.stop()
            del servers[name]
        if 1 in concurrency:
            # Each pair a one-client load and a `pie bench` right after it, so both see the machine's same spell.
            pairs = []
            for run in range(args.runs):
                load = asyncio.run(run_load(servers["pie"][1], "smollm2", 1, 8, outputs[0], offset=90_000 + run * 100))
                pairs.append((load.summary()["tpot_p50"] * 1e3, pie_bench_step_ms(args.model)))
            print(f"one client, inter-token p50 against pie bench's decode step, {args.runs} pairs (ms): "
                  + ", ".join(f"{itl:.1f}/{step:.1f}" for itl, step in pairs)
                  + f"; median ratio {statistics.median(itl / step for itl, step in pairs):.2f}x")
        shared = {}
        uncached, url = start_pie(args.model, "--no-prefix-cache")
        try:
            for name, base in (("pie", servers["pie"][1]), ("pie --no-prefix-cache", url)):
                runs = [asyncio.run(run_load(base, "smollm2", 8, 32, 32, system=SYSTEM_PROMPT, offset=50_000 + r * 100))
                        for r in range(args.runs)]
                shared[name] = median_summary(runs)
        finally:
            uncached.stop()
        print("\nshared 200-token system prompt, 8 clients, 32 requests, 32 output tokens:")
        for name, summary in shared.items():
            print(row(name, summary))
        print(f"TTFT p50 without the prefix cache / with it: "
              f"{shared['pie --no-prefix-cache']['ttft_p50'] / shared['pie']['ttft_p50']:.2f}x")
    finally:
        for server, _ in servers.values():
            server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
