"""Inferlets in worker processes against the same inferlets in-process, over one scheduler, same run.

    python benchmarks/served_inferlets.py [--runs 3] [--concurrency 8] [--no-sandbox]

SmolLM2-135M on the CPU engine. Three figures:

1. throughput of the examples (best_of_n, beam_search, constrained_choice) at `--concurrency` concurrent
   runs: tokens forwarded per second, in-process (`InferletHost.run_many`) and served (each run in a
   sandboxed worker from `pie.inferlet.workers.WorkerPool`, as `pie serve` runs an installed inferlet:
   warm workers that served the inferlet's last runs, the default; and a new worker for every run,
   `pie serve --runs-per-worker 1`), alternating, the median of `--runs`; goal: served within 10%;
2. worker start latency from the pool: from asking the pool for a worker to the inferlet's first
   message reaching the host (p50 and p90 of 20 runs, the pool kept full between them); goal: p50 <= 50 ms;
   and what starting each replacement cost the pool: from its fork request to the fork server until the
   worker, locked down, said ready (p50 and p90 of every worker started in the whole benchmark);
3. the per-token cost of the process boundary: one context stepping greedy tokens alone, served minus
   in-process, per token (the slope between 8 and 72 tokens, so a run's fixed costs drop out).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from pie.inferlet import InferletHost, load_inferlet
from pie.inferlet.sandbox import LAYERS
from pie.inferlet.workers import RunLimits, WorkerPool, serve_run
from pie.runtime.llm import LLM

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
WORKLOADS = {
    "best_of_n": ["Once upon a time", "--n", "4", "--max-tokens", "32", "--temperature", "0.8"],
    "beam_search": ["The answer is", "--beams", "4", "--max-tokens", "16"],
    "constrained_choice": ["Is the sky blue? Answer:", "--option", " yes", "--option", " no", "--option", " maybe"],
}
STEPPER = '''"""Steps one context, a token a pass."""


async def main(ctx, args):
    context = ctx.context("The quick brown fox")
    for _ in range(int(args[0])):
        await context.step()
    return len(context.tokens)
'''
FIRST_WORD = '''"""Says it started, and ends."""


async def main(ctx, args):
    ctx.emit("started")
'''


def sandbox(folders: list[Path], enabled: bool) -> dict | None:
    if not enabled:
        return None
    return {"memory_bytes": 2 << 30, "cpu_seconds": 600, "read_only": [str(f) for f in folders],
            "required": list(LAYERS)}


async def filled(pool: WorkerPool, timeout_s: float = 120.0) -> None:
    """Wait until every worker of the pool is started and ready (a run then measures no start)."""
    deadline = time.monotonic() + timeout_s
    while pool.ready_count < pool.size:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the pool has {pool.ready_count} of {pool.size} workers ready: {pool.failures[-1:]}")
        await asyncio.sleep(0.05)


async def in_process(host: InferletHost, name: str, args: list[str], count: int) -> float:
    main = load_inferlet(EXAMPLES / f"{name}.py")
    before = host.scheduler.core.stats.forwarded_tokens
    start = time.perf_counter()
    results = await host.run_many([(name, main, args) for _ in range(count)])
    seconds = time.perf_counter() - start
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return (host.scheduler.core.stats.forwarded_tokens - before) / seconds


async def served(host: InferletHost, pool: WorkerPool, path: Path, args: list[str], count: int) -> float:
    scheduler = host.scheduler
    limits = RunLimits(token_budget=10**7, wall_seconds=600)
    before = scheduler.core.stats.forwarded_tokens
    start = time.perf_counter()

    async def one() -> None:
        worker = await pool.take(str(path))
        outcome = await serve_run(scheduler, worker, path.stem, path, args, limits, lambda value: None)
        await pool.give_back(worker)
        assert outcome.ok, outcome.error

    await asyncio.gather(*(one() for _ in range(count)))
    return (scheduler.core.stats.forwarded_tokens - before) / (time.perf_counter() - start)


async def start_latency(host: InferletHost, pool: WorkerPool, path: Path, samples: int) -> list[float]:
    times = []
    for _ in range(samples):
        await filled(pool)  # take from a full pool each time
        asked = time.perf_counter()
        first: list[float] = []
        worker = await pool.take()
        outcome = await serve_run(host.scheduler, worker, "first", path, [], RunLimits(),
                                  lambda value, first=first: first.append(time.perf_counter()))
        assert outcome.ok and first, outcome.error
        times.append(first[0] - asked)
    return times


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--no-sandbox", action="store_true")
    options = parser.parse_args()
    llm = LLM.load(None, "cpu", max_cached_tokens=32768)
    host = InferletHost.from_llm(llm, timeout_s=None)
    scratch = Path(tempfile.mkdtemp(prefix="served-inferlets-"))
    (scratch / "stepper.py").write_text(STEPPER)
    (scratch / "first.py").write_text(FIRST_WORD)
    vocab = llm.runner.config.vocab_size
    policy = sandbox([EXAMPLES, scratch], not options.no_sandbox)
    pools = {"warm": WorkerPool(llm.tokenizer.to_json(), vocab, options.concurrency, policy),
             "fresh": WorkerPool(llm.tokenizer.to_json(), vocab, options.concurrency, policy, runs_per_worker=1)}
    for each in pools.values():
        each.start()
    pool = pools["fresh"]
    print(f"SmolLM2-135M, CPU engine; {options.concurrency} concurrent runs; sandbox "
          f"{'off' if options.no_sandbox else 'on'}; median of {options.runs} runs (tokens forwarded per second)")
    print("| inferlet | in-process | served, warm workers | ratio | served, a new worker a run | ratio |")
    print("|---|---|---|---|---|---|")
    for name, args in WORKLOADS.items():
        rates: dict[str, list[float]] = {"in": [], "warm": [], "fresh": []}
        for run in range(options.runs + 1):  # the first round fills the warm pool and is not counted
            order = ("in", "warm", "fresh") if run % 2 == 0 else ("fresh", "warm", "in")
            for who in order:
                for each in pools.values():
                    await filled(each)
                if who == "in":
                    rate = await in_process(host, name, args, options.concurrency)
                else:
                    rate = await served(host, pools[who], EXAMPLES / f"{name}.py", args, options.concurrency)
                if run:
                    rates[who].append(rate)
        a, warm, fresh = (statistics.median(rates[who]) for who in ("in", "warm", "fresh"))
        print(f"| {name} | {a:.1f} | {warm:.1f} | {warm / a:.3f} | {fresh:.1f} | {fresh / a:.3f} |")
    latencies = sorted(await start_latency(host, pool, scratch / "first.py", 20))
    print(f"worker start from the pool to the inferlet's first message: p50 {statistics.median(latencies) * 1e3:.1f} ms, "
          f"p90 {latencies[int(0.9 * len(latencies))] * 1e3:.1f} ms")
    forks = sorted(pool.start_seconds)
    print(f"a replacement worker, from the fork request to ready (sandbox included): p50 "
          f"{statistics.median(forks) * 1e3:.1f} ms, p90 {forks[int(0.9 * len(forks))] * 1e3:.1f} ms ({len(forks)} starts)")
    stepper = load_inferlet(scratch / "stepper.py")

    async def stepping(steps: int) -> tuple[float, float]:
        """Seconds for one context to step ``steps`` tokens, in-process and served (median of the runs)."""
        local, remote = [], []
        for _ in range(options.runs):
            start = time.perf_counter()
            result = await host.run(stepper, [str(steps)])
            assert result.ok, result.error
            local.append(time.perf_counter() - start)
            await filled(pool)
            worker = await pool.take()
            start = time.perf_counter()
            outcome = await serve_run(host.scheduler, worker, "stepper", scratch / "stepper.py", [str(steps)],
                                      RunLimits(), lambda value: None)
            assert outcome.ok, outcome.error
            remote.append(time.perf_counter() - start)
        return statistics.median(local), statistics.median(remote)

    short, long = 8, 72  # the slope between two lengths leaves out what a run costs once (start, import)
    (local_short, remote_short), (local_long, remote_long) = await stepping(short), await stepping(long)
    local_token = (local_long - local_short) / (long - short)
    remote_token = (remote_long - remote_short) / (long - short)
    print(f"one context stepping alone: in-process {local_token * 1e3:.2f} ms a token, served {remote_token * 1e3:.2f} "
          f"ms: the process boundary costs {(remote_token - local_token) * 1e3:.2f} ms a token")
    for each in pools.values():
        await each.close()


if __name__ == "__main__":
    asyncio.run(main())
