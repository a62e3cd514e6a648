"""Two builds of the CPU engine's native kernels, decode steps alternating in one process.

    python benchmarks/native_ab.py OLD.c NEW.c                      # both for this CPU (-march=native)
    python benchmarks/native_ab.py OLD.c@haswell NEW.c@haswell --batch 8
    python benchmarks/native_ab.py OLD.c NEW.c --prefill --prompt 1024   # prefill instead of decode
    python benchmarks/native_ab.py OLD.c NEW.c --model F16.gguf          # another file, its weights as stored
    git show HEAD~1:pie-engine-cpu/src/pie_engine_cpu/native.c > /tmp/old.c   # a source to compare

Each source (``@TARGET``: built with ``-march=TARGET``) gets its own runner of the model (the default one
unless ``--model``), its weights in the types its file stores them, as ``pie run`` keeps them; rounds
alternate which goes first, and each round is the median of a dozen decode steps at the given batch
(``--prefill``: one prefill of ``--prompt`` tokens per sequence of the batch, in one step).
On this noisy machine the ratio of the two, round by round, is what survives; absolute times follow
the machine's spells. Two different builds are two libraries, each with its own threads, and the one
loaded second (B) ran 0.88-0.96x as fast as the first in prefills of 128 tokens where both ran the same
code: run the comparison in both orders and take the geometric mean (with one source on both sides,
one library, the ratio was 0.99-1.0).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import numpy as np


def runner_for(source: str, loaded, device, batch: int):
    from pie.enginekit.host import usable_cpus
    from pie.runtime.model_runner import ModelRunner
    from pie_engine_cpu import native

    path, _, target = source.partition("@")
    flags = tuple(f"-march={target}" if f == "-march=native" and target else f for f in native.FLAGS)
    original, native.FLAGS = native.FLAGS, flags
    try:
        kernels = native.NativeKernels(native.build_library(Path(path).read_text()), usable_cpus())
    finally:
        native.FLAGS = original
    native.load = lambda: kernels  # the runner's kernels bind to this build as they compile
    return ModelRunner(loaded.config, loaded.stored_tensors(), device, max_cached_tokens=batch * 512 + 4096)


def median_step_ms(runner, batch: int, prompt: int, steps: int, rng: np.random.Generator) -> float:
    from pie.runtime.model_runner import SequenceWork

    sequences = [runner.new_sequence() for _ in range(batch)]
    for sequence in sequences:
        runner.step([SequenceWork(sequence, rng.integers(3, 40000, prompt).tolist())])
    logits = runner.step([SequenceWork(s, [5]) for s in sequences])
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = runner.step([SequenceWork(s, [int(np.argmax(row))]) for s, row in zip(sequences, logits)])
        times.append((time.perf_counter() - start) * 1e3)
    for sequence in sequences:
        sequence.free()
    return statistics.median(times)


def prefill_ms(runner, batch: int, prompt: int, rng: np.random.Generator) -> float:
    from pie.runtime.model_runner import SequenceWork

    sequences = [runner.new_sequence() for _ in range(batch)]
    work = [SequenceWork(s, rng.integers(3, 40000, prompt).tolist()) for s in sequences]
    start = time.perf_counter()
    runner.step(work)
    elapsed = (time.perf_counter() - start) * 1e3
    for sequence in sequences:
        sequence.free()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="native.c source, optionally @TARGET")
    parser.add_argument("b", help="native.c source, optionally @TARGET")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=128, help="tokens in each sequence before decoding")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=12, help="decode steps per round")
    parser.add_argument("--prefill", action="store_true", help="time the prefill of --prompt tokens instead")
    parser.add_argument("--model", help="a GGUF file or HF folder (default: the embedded default model)")
    args = parser.parse_args()

    from pie.model.loader import load_model
    from pie.model.store import resolve_model
    from pie.plugins import EngineRegistry

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    loaded = load_model(resolve_model(args.model))
    runners = [runner_for(source, loaded, device, args.batch) for source in (args.a, args.b)]
    rng = np.random.default_rng(0)
    if args.prefill:
        measure = partial(prefill_ms, batch=args.batch, prompt=args.prompt, rng=rng)
    else:
        measure = partial(median_step_ms, batch=args.batch, prompt=args.prompt, steps=args.steps, rng=rng)
    times: list[list[float]] = [[], []]
    for round_index in range(args.rounds):
        for side in (0, 1) if round_index % 2 == 0 else (1, 0):
            time.sleep(0.02)  # the other build's pool polls 2 ms after its last task before it sleeps
            times[side].append(measure(runners[side]))
    ratios = [a / b for a, b in zip(*times)]
    print(
        f"{'prefill' if args.prefill else 'decode'} batch {args.batch}: A {statistics.median(times[0]):.2f} ms, "
        f"B {statistics.median(times[1]):.2f} ms a step; "
        f"B is {statistics.median(ratios):.3f}x as fast (rounds {min(ratios):.3f}-{max(ratios):.3f})"
    )


if __name__ == "__main__":
    main()
