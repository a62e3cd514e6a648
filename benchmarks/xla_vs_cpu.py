"""SmolLM2-135M (the embedded Q4_1 GGUF): the XLA engine next to the CPU engine, decode tokens/s at batch 1 and 8,
each with its weights as the file stores them or dequantized to float32 on load.

    python benchmarks/xla_vs_cpu.py [--variants xla:stored,xla:f32,cpu:f32] [--prompt-tokens 32]
                                    [--decode-tokens 32] [--runs 3] [--blas-threads N]

A variant is ``engine:weights``: ``stored`` hands the engine each weight in the file's type where the
engine declares it (``pie_weight_types``), ``f32`` every weight in float32. Batch 8 is eight sequences
advanced together by `ModelRunner.step`. "first use" is the first prefill plus first decode step of a
fresh runner, which on XLA includes compiling every region program for those shape buckets; the compile
count says how many executables that took. Decode runs are preceded by an identical warm-up run over the
same context lengths, so no compile lands inside a measurement, and the variants' runs alternate round
by round, so a change in the machine's load touches all alike. For XLA the weights' resident bytes are
those of the device arrays the runner holds (a tied LM head counted once), next to the file's weight
bytes. Prints a table and JSON.

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
    from pie_engine_xla.mesh import mesh_device

    return sum(program.compiles for program in mesh_device().programs.values())


def resident_weight_bytes(runner: ModelRunner) -> int:
    """Bytes of the XLA device arrays holding the runner's weights (each tensor once)."""
    tensors = {id(t): t for t in (runner._env[runner.plan.slots[n]] for n in runner.weight_choices)}
    return sum(int(t.array.nbytes if t.array is not None else t.host.nbytes) for t in tensors.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--variants", default="xla:stored,xla:f32,cpu:f32",
                        help="engine:weights pairs, weights stored (the file's types) or f32")
    parser.add_argument("--blas-threads", type=int, default=None, help="Limit BLAS threads (default: BLAS's own).")
    args = parser.parse_args()
    variants = [tuple(v.split(":")) for v in args.variants.split(",")]
    if any(len(v) != 2 or v[1] not in ("stored", "f32") for v in variants):
        parser.error(f"--variants takes engine:stored or engine:f32 pairs, not {args.variants!r}")
    if args.blas_threads is not None:
        from threadpoolctl import threadpool_limits

        threadpool_limits(args.blas_threads, user_api="blas")

    model = load_model(resolve_model(None))
    stored = list(model.stored_tensors())
    weights = {"stored": stored, "f32": list(model.tensors())}
    file_bytes = sum(int(w.nbytes) for _, w in stored)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(100, 40000, args.prompt_tokens)] for _ in range(8)]
    registry = EngineRegistry()
    runners: dict[str, ModelRunner] = {}
    results: dict[str, dict[str, float]] = {}
    for engine, kind in variants:
        name = f"{engine}:{kind}"
        device = registry.engine(engine).open(0)
        start = time.perf_counter()
        runner = runners[name] = ModelRunner(model.config, iter(weights[kind]), device, max_cached_tokens=4096)
        load = time.perf_counter() - start
        before = compiles() if engine == "xla" else 0
        first = first_use(runner, prompts[0])
        row = results[name] = {"load_s": load, "first_use_s": first,
                               "warm_prefill_decode_s": first_use(runner, prompts[0])}
        for batch in (1, 8):
            decode_rate(runner, prompts[:batch], args.decode_tokens)  # warm-up: compiles every bucket it crosses
        if engine == "xla":
            row["compiles"] = compiles() - before
            row["resident_weight_bytes"] = resident_weight_bytes(runner)
    for batch in (1, 8):
        rates: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(args.runs):
            for name, runner in runners.items():
                rates[name].append(decode_rate(runner, prompts[:batch], args.decode_tokens))
        for name in runners:
            results[name][f"batch{batch}_tok_s"] = statistics.median(rates[name])
    for runner in runners.values():
        runner.close()
    threads = "default" if args.blas_threads is None else args.blas_threads
    print(
        f"SmolLM2-135M Q4_1 file ({file_bytes / 1e6:.1f} MB of weights), prompt {args.prompt_tokens}, "
        f"decode {args.decode_tokens}, median of {args.runs} alternating runs, BLAS threads {threads}"
    )
    print(f"{'variant':<11} {'load s':>7} {'first use s':>12} {'warm s':>7} {'b1 tok/s':>9} {'b8 tok/s':>9} "
          f"{'weights MB':>11} {'/ file':>7}")
    for name, row in results.items():
        resident = row.get("resident_weight_bytes")
        memory = f"{resident / 1e6:>11.1f} {resident / file_bytes:>7.3f}" if resident else f"{'-':>11} {'-':>7}"
        print(
            f"{name:<11} {row['load_s']:>7.2f} {row['first_use_s']:>12.2f} {row['warm_prefill_decode_s']:>7.2f} "
            f"{row['batch1_tok_s']:>9.1f} {row['batch8_tok_s']:>9.1f} {memory}"
        )
    print(json.dumps({"file_weight_bytes": file_bytes, "variants": results}, indent=2))


if __name__ == "__main__":
    main()
