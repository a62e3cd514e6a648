"""SmolLM2-135M fp32: the XLA engine next to the CPU engine, decode tokens/s at batch 1 and 8.

    python benchmarks/xla_vs_cpu.py [--prompt-tokens 32] [--decode-tokens 32] [--runs 3] [--blas-threads N]

Both engines read the same float32 weights (the embedded Q4_1 GGUF, dequantized on load).
Batch 8 is eight sequences advanced together by `ModelRunner.step`. "first use" is the
first prefill plus first decode step of a fresh runner, which on XLA includes compiling
every region program for those shape buckets; the compile count says how many
executables that took. Decode runs are preceded by an identical warm-up run over the
same context lengths, so no compile lands inside a measurement. Prints a table and JSON.

On a shared machine numpy's BLAS (the CPU engine) can collapse when its threads
oversubscribe the cores; ``--blas-threads`` pins them (threadpoolctl). XLA's CPU
backend keeps its own thread pool.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import json
import statistics
import time

import numpy as np
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork


def decode_rate(runner: ModelRunner, prompts: list[list[int]], tokens: int) -> float:
    """Prefill every prompt together, then decode ``tokens`` steps for all; returns tokens/s of the decode."""
    sequences = [runner.new_sequence() for _ in prompts]
    try:
        logits = runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts, strict=True)])
        start = time.perf_counter()
        for _ in range(tokens):
            work = [SequenceWork(s, [int(np.argmax(row))]) for s, row in zip(sequences, logits, strict=True)]
            logits = runner.step(work)
        return len(prompts) * tokens / (time.perf_counter() - start)
    finally:
        for sequence in sequences:
            sequence.free()


def first_use(runner: ModelRunner, prompt: list[int]) -> float:
    sequence = runner.new_sequence()
    start = time.perf_counter()
    logits = runner.step([SequenceWork(sequence, prompt)])
    runner.step([SequenceWork(sequence, [int(np.argmax(logits[0]))])])
    elapsed = time.perf_counter() - start
    sequence.free()
    return elapsed


def compiles() -> int:
    from pie_engine_xla.mesh import runtime

    return sum(runtime().compile_counts.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--engines", default="cpu,xla")
    parser.add_argument("--blas-threads", type=int, default=None, help="Limit BLAS threads (default: BLAS's own).")
    args = parser.parse_args()
    if args.blas_threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")

    model = load_model(resolve_model(None))
    tensors = list(model.tensors())
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 40000, args.prompt_tokens)] for _ in range(8)]
    registry = EngineRegistry()
    results: dict[str, dict[str, float]] = {}
    for engine in args.engines.split(","):
        device = registry.engine(engine).open(0)
        start = time.perf_counter()
        runner = ModelRunner(model.config, iter(tensors), device, max_cached_tokens=4096)
        load = time.perf_counter() - start
        before = compiles() if engine == "xla" else 0
        first = first_use(runner, prompts[0])
        row = {"load_s": load, "first_use_s": first, "warm_prefill_decode_s": first_use(runner, prompts[0])}
        if engine == "xla":
            row["first_use_compiles"] = compiles() - before
        for batch in (1, 8):
            decode_rate(runner, prompts[:batch], args.decode_tokens)  # warm-up: compiles every bucket it crosses
            rates = [decode_rate(runner, prompts[:batch], args.decode_tokens) for _ in range(args.runs)]
            row[f"batch{batch}_tok_s"] = statistics.median(rates)
        if engine == "xla":
            row["total_compiles"] = compiles() - before
        runner.close()
        results[engine] = row
    threads = "default" if args.blas_threads is None else args.blas_threads
    print(
        f"SmolLM2-135M fp32, prompt {args.prompt_tokens}, decode {args.decode_tokens}, median of {args.runs}, "
        f"BLAS threads {threads}"
    )
    print(f"{'engine':<6} {'load s':>7} {'first use s':>12} {'warm s':>7} {'b1 tok/s':>9} {'b8 tok/s':>9}")
    for engine, row in results.items():
        print(
            f"{engine:<6} {row['load_s']:>7.2f} {row['first_use_s']:>12.2f} {row['warm_prefill_decode_s']:>7.2f} "
            f"{row['batch1_tok_s']:>9.1f} {row['batch8_tok_s']:>9.1f}"
        )
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
