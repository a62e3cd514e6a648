"""`pie serve` when requests compete: a short request behind a long prompt, and many requests on a small KV cache.

    python benchmarks/serve_fairness.py [--rounds 3] [--llama-server PATH]

SmolLM2-135M on the CPU engine (the embedded Q4_1 GGUF), greedy:

- **Behind a long prompt**: a completion of a distinct ~4,000-token prompt (2 tokens out), and 0.5 s later a
  short one (4 tokens out, streamed). Printed: the short request's time to its first token and when the long one
  finished, the median of ``--rounds``. With ``--llama-server`` (built as benchmarks/README.md says) the same pair
  runs against llama.cpp's server on the same file, interleaved with pie's, and pie's ratio is printed.
- **Under KV pressure**: 12 requests at once (4 of them with n=2; 120-210 tokens out each) on ``--kv-tokens 512``,
  then the same requests one by one on an idle server of the default size. Printed: wall time, preemptions
  and tokens forwarded (``/metrics``) against the tokens the requests needed, and whether every text equals the
  idle server's.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
from serve_load import Server, start_llama, start_pie

TOPICS = ("the ocean", "medieval castles", "quantum computing", "the French revolution", "honeybees", "volcanoes",
          "jazz music", "the moon landing", "ancient Egypt", "machine learning", "coffee farming", "glaciers")


def behind_a_long_prompt(url: str, model: str, round_: int) -> tuple[float, float]:
    """(the short request's time to first token, the long one's time to finish), seconds from its own start."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    long_prompt = " ".join(f"w{round_}x{i}" for i in range(700))  # about 4,090 tokens, distinct each round
    finished: list[float] = []
    start = time.perf_counter()

    def long_request() -> None:
        client.completions.create(model=model, prompt=long_prompt, max_tokens=2, temperature=0)
        finished.append(time.perf_counter() - start)

    thread = threading.Thread(target=long_request)
    thread.start()
    time.sleep(0.5)
    sent = time.perf_counter()
    first = None
    for _ in client.completions.create(model=model, prompt=f"Hello {round_}, how", max_tokens=4, temperature=0,
                                       stream=True):
        first = time.perf_counter() - sent if first is None else first
    thread.join()
    assert first is not None
    return first, finished[0]


def pressure_requests() -> list[dict[str, object]]:
    return [{"prompt": f"Write a long, detailed essay about {topic}. " * (1 + i % 4) + f"Essay {i}:",
             "max_tokens": 120 + 30 * (i % 4), "n": 1 + (i % 3 == 1)} for i, topic in enumerate(TOPICS)]


async def texts(url: str, model: str, together: bool) -> tuple[list[list[str]], int, float]:
    """Each request's choices' texts, the tokens the requests needed (prompt and output), and the wall time."""
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=900)

    async def one(request: dict[str, object]) -> tuple[list[str], int]:
        reply = await client.completions.create(model=model, temperature=0, **request)  # type: ignore[call-overload]
        return [c.text for c in sorted(reply.choices, key=lambda c: c.index)], reply.usage.total_tokens

    start = time.perf_counter()
    try:
        if together:
            results = await asyncio.gather(*(one(r) for r in pressure_requests()))
        else:
            results = [await one(r) for r in pressure_requests()]
    finally:
        await client.close()
    return [t for t, _ in results], sum(n for _, n in results), time.perf_counter() - start


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found[1]) if found else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-server", default=None, help="llama.cpp's server binary, for the peer's figures")
    args = parser.parse_args()

    servers: list[tuple[str, Server, str]] = [("pie", *start_pie(None))]
    if args.llama_server:
        from pie.model.store import resolve_model

        servers.append(("llama.cpp", *start_llama(args.llama_server, Path(resolve_model(None)))))
    try:
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in servers}
        for round_ in range(args.rounds):
            for name, _, url in servers:  # interleaved, so a slow spell of the machine falls on both
                figures[name].append(behind_a_long_prompt(url, "smollm2", round_))
        print("Behind a long prompt (~4,090 tokens), median of", args.rounds)
        print("| server | short request's TTFT (s) | long request done (s) |\n|---|---|---|")
        for name, pairs in figures.items():
            print(f"| {name} | {statistics.median(p[0] for p in pairs):.2f} | {statistics.median(p[1] for p in pairs):.2f} |")
        if len(figures) == 2:
            pie, peer = (statistics.median(p[0] for p in pairs) for pairs in figures.values())
            print(f"pie's short TTFT / llama.cpp's: {pie / peer:.2f}x")
    finally:
        for _, server, _ in servers:
            server.stop()

    idle, idle_url = start_pie(None)
    try:
        alone, needed, alone_s = asyncio.run(texts(idle_url, "smollm2", together=False))
    finally:
        idle.stop()
    tight, tight_url = start_pie(None, "--kv-tokens", "512")
    try:
        together, _, together_s = asyncio.run(texts(tight_url, "smollm2", together=True))
        preemptions = metric(tight_url, "pie:preemptions_total")
        forwarded = metric(tight_url, "pie:batch_tokens_total")
    finally:
        tight.stop()
    print("\nUnder KV pressure: 12 requests (16 choices) at once on --kv-tokens 512")
    print(f"wall {together_s:.1f} s (one by one on an idle server: {alone_s:.1f} s); {preemptions:.0f} preemptions; "
          f"{forwarded:.0f} tokens forwarded for {needed} needed ({forwarded / needed:.2f}x); "
          f"texts equal to the idle server's: {sum(a == b for a, b in zip(alone, together))} of {len(alone)}")


if __name__ == "__main__":
    main()
