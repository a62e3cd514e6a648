"""Where a step's time goes on an engine: wall time per prefill and decode step, the host's
Python (cProfile, top functions by own time) and, under Nsight Compute, each kernel's GPU time.

    python benchmarks/gpu_profile.py --model PATH [--engine cuda] [--batches 1,32]
    ncu --profile-from-start off --clock-control none --cache-control none \\
        --metrics gpu__time_duration.sum --csv --log-file kernels.csv \\
        python benchmarks/gpu_profile.py --model PATH --kernels decode --batches 32
    python benchmarks/gpu_profile.py --summarize kernels.csv

``--kernels prefill|decode`` opens the profiler (cuProfilerStart) around one warm prefill or two
warm decode steps of the first batch size only, so Nsight Compute times just those kernels.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import cProfile
import csv
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import numpy as np
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import EngineRegistry, EngineSelectionError
from pie.runtime.model_runner import ModelRunner, SequenceWork


@contextmanager
def gpu_profiler(enabled: bool):
    """cuProfilerStart/Stop around the block (Nsight Compute records only inside)."""
    if not enabled:
        yield
        return
    from cuda.bindings import driver

    driver.cuProfilerStart()
    try:
        yield
    finally:
        driver.cuProfilerStop()


def top_functions(profile: cProfile.Profile, count: int) -> str:
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(count)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start:])


def run_batch(runner: ModelRunner, batch: int, args: argparse.Namespace, rng: np.random.Generator,
              kernels: str | None) -> None:
    vocab = runner.config.vocab_size

    def prefill(sequences: list) -> np.ndarray:
        prompts = [[int(t) for t in rng.integers(3, vocab, args.prompt_len)] for _ in sequences]
        return runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts)])

    def decode(sequences: list, logits: np.ndarray) -> np.ndarray:
        tokens = np.argmax(logits, axis=-1)
        return runner.step([SequenceWork(s, [int(t)]) for s, t in zip(sequences, tokens)])

    for attempt in ("warm-up", "timed"):
        sequences = [runner.new_sequence() for _ in range(batch)]
        try:
            start = time.perf_counter()
            with gpu_profiler(kernels == "prefill" and attempt == "timed"):
                logits = prefill(sequences)
            prefill_ms = 1e3 * (time.perf_counter() - start)
            times = []
            for step in range(args.steps):
                start = time.perf_counter()
                with gpu_profiler(kernels == "decode" and attempt == "timed" and step < 2):
                    logits = decode(sequences, logits)
                times.append(1e3 * (time.perf_counter() - start))
            if attempt == "warm-up" or kernels:
                continue
            decode_ms = statistics.median(times)
            print(f"\n== batch {batch}: prefill of {args.prompt_len} tokens each {prefill_ms:.2f} ms, "
                  f"decode step {decode_ms:.3f} ms median of {args.steps} ({batch / decode_ms * 1e3:.0f} tok/s)")
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.steps):
                logits = decode(sequences, logits)
            profile.disable()
            print(f"-- decode under cProfile, {args.steps} steps, top functions by own time")
            print(top_functions(profile, args.top))
        finally:
            for sequence in sequences:
                sequence.free()


def summarize(path: Path) -> int:
    """Per-kernel GPU time from an Nsight Compute CSV (gpu__time_duration.sum)."""
    lines = path.read_text().splitlines()
    header = next((i for i, line in enumerate(lines) if line.startswith('"ID"')), None)
    if header is None:
        print(f"{path}: no Nsight Compute CSV table in it", file=sys.stderr)
        return 1
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    shapes: dict[str, set] = defaultdict(set)
    for row in csv.DictReader(lines[header:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = row["Kernel Name"].split("(")[0]
        scale = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}.get(row.get("Metric Unit", "nsecond"), 1e-3)
        total[name] += float(row["Metric Value"].replace(",", "")) * scale
        calls[name] += 1
        shapes[name].add(f"{row.get('Grid Size', '')}x{row.get('Block Size', '')}")
    whole = sum(total.values())
    print(f"{path.name}: {sum(calls.values())} kernels, {whole:.1f} us of GPU time")
    print(f"{'kernel':<28} {'calls':>6} {'us':>10} {'share':>6}  grids x blocks")
    for name in sorted(total, key=total.get, reverse=True):
        print(f"{name:<28} {calls[name]:>6} {total[name]:>10.1f} {total[name] / whole:>6.1%}  "
              f"{' '.join(sorted(shapes[name])[:3])}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engine", default="cuda")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--top", type=int, default=22, help="functions listed per profile")
    parser.add_argument("--kernels", choices=("prefill", "decode"),
                        help="open the GPU profiler around this phase of the first batch size (under ncu)")
    parser.add_argument("--summarize", type=Path, help="print per-kernel times from an Nsight Compute CSV and exit")
    args = parser.parse_args()
    if args.summarize:
        return summarize(args.summarize)
    batches = [int(b) for b in args.batches.split(",")]
    if args.kernels:
        batches = batches[:1]
    try:
        device = EngineRegistry().engine(args.engine).open(0)
    except EngineSelectionError as error:
        print(error, file=sys.stderr)
        return 2
    print(f"device: {device.info.key} {device.info.name}")
    loaded = load_model(resolve_model(args.model))
    runner = ModelRunner(loaded.config, loaded.tensors(), device,
                         max_cached_tokens=2 * max(batches) * (args.prompt_len + 2 * args.steps + 16))
    rng = np.random.default_rng(0)
    try:
        for batch in batches:
            run_batch(runner, batch, args, rng, args.kernels)
    finally:
        runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
