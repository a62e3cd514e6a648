"""numpy vs the CPU engine's OpenCL JIT (PoCL) for the silu_mul epilogue, median of runs.

    python benchmarks/eta_opencl_crossover.py [--runs 15] [--cols 4096] [--max-rows 1024]

For rows = 1, 2, 4, ... it times `OpenCLEpilogues.run` (buffers over the numpy arrays,
launch, map back) against eta's numpy evaluation (`Epilogue.numpy_fn`, the engine's own
path for an epilogue) and against hand-fused in-place numpy, then prints the crossover
against each: the smallest size from which OpenCL is faster at every larger size. numpy's
elementwise loops use one core; PoCL uses all of them (`POCL_MAX_PTHREAD_COUNT` limits it).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np
from pie.eta import stdlib
from pie_engine_cpu.opencl import OpenCLEpilogues


def median_ms(fn: Callable[[], object], runs: int) -> float:
    fn()  # warm up: the first OpenCL call builds the program
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def hand_fused(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


def crossover(rows: list[int], wins: list[bool]) -> int | None:
    """The first size from which OpenCL wins at every larger size."""
    return next((r for k, r in enumerate(rows) if all(wins[k:])), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--max-rows", type=int, default=1024)
    args = parser.parse_args()

    epilogue = stdlib.get("silu_mul")
    numpy_fn = epilogue.numpy_fn()
    runner = OpenCLEpilogues()
    rng = np.random.default_rng(0)
    print(f"device: {runner.device.name}, {runner.device.platform.version}; {os.cpu_count()} cores")
    print(f"{'rows x cols':>14} {'elements':>10} {'eta numpy ms':>13} {'fused numpy ms':>15} {'OpenCL ms':>10}")
    sizes = [2**k for k in range(args.max_rows.bit_length())]
    beats_eta, beats_fused = [], []
    for rows in sizes:
        gate = rng.normal(size=(rows, args.cols)).astype(np.float32)
        up = rng.normal(size=(rows, args.cols)).astype(np.float32)
        eta_ms = median_ms(partial(numpy_fn, gate=gate, up=up), args.runs)
        fused_ms = median_ms(partial(hand_fused, gate, up), args.runs)
        opencl_ms = median_ms(partial(runner.run, epilogue, gate=gate, up=up), args.runs)
        beats_eta.append(opencl_ms < eta_ms)
        beats_fused.append(opencl_ms < fused_ms)
        shape = f"{rows} x {args.cols}"
        print(f"{shape:>14} {rows * args.cols:>10} {eta_ms:>13.3f} {fused_ms:>15.3f} {opencl_ms:>10.3f}")
    for name, wins in (("eta numpy", beats_eta), ("fused numpy", beats_fused)):
        rows = crossover(sizes, wins)
        where = f"{rows} x {args.cols} = {rows * args.cols} elements" if rows else "none up to the largest size"
        print(f"crossover vs {name}: {where}")


if __name__ == "__main__":
    main()
