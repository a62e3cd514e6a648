"""The host's share of a CUDA-engine decode step, measurable without a GPU: the engine on its host
emulator with every launch a no-op, so a step is the Python of the plan loop, the launchers, the
allocator and the batch uploads, and nothing else (no kernel runs, no driver call).

    python benchmarks/gpu_host_cost.py --model PATH [--steps 280] [--profile]

20 untimed steps first, then ``--steps`` timed ones (and with ``--profile`` 100 more under cProfile).

On a GPU a batch-1 decode step costs this plus the driver's launch calls (about 4.5 us each on an
H200 machine, measured with cProfile) while the GPU runs behind; see docs/perf-notes.md.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll)

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie_engine_cuda.runtime import GpuDevice


WARMUP = 20
"""Decode steps before the timed ones."""


class SkippedLaunches:
    """Makes every bound launch do nothing but count (modules still compile, so binding costs what it costs)."""

    def __init__(self) -> None:
        self.count = 0

        def bind(runtime: GpuDevice, unit: str, name: str, args: Any) -> Any:
            runtime.module(unit)
            return self.launch

        GpuDevice.bind = bind  # type: ignore[method-assign]

    def launch(self, *config: int) -> None:
        self.count += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--steps", type=int, default=280, help="decode steps timed, after 20 untimed")
    parser.add_argument("--profile", action="store_true", help="also list the top functions by own time")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    profiled = 100 if args.profile else 0
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "pie-engine-cuda" / "tests"))
    os.environ["PIE_CUDA_BACKEND"] = "emulator_api:EMULATOR"  # the tests' host emulator, imported when probed
    os.environ.setdefault("PIE_CUDA_EMULATOR_WARP", "32")
    launches = SkippedLaunches()
    device = EngineRegistry().engine("cuda").open(0)
    loaded = load_model(resolve_model(args.model))
    capacity = 8 + WARMUP + args.steps + profiled + 64  # the prompt, every step, and room to spare
    runner = ModelRunner(loaded.config, loaded.tensors(), device, max_cached_tokens=capacity)
    sequence = runner.new_sequence()
    runner.step([SequenceWork(sequence, [5] * 8)])
    def step() -> None:
        runner.step([SequenceWork(sequence, [7])])

    for _ in range(WARMUP):
        step()
    times = []
    before = launches.count
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    per_step = (launches.count - before) / len(times)
    print(f"host per batch-1 decode step, kernels not run: median {statistics.median(times) * 1e6:.0f} us "
          f"(min {min(times) * 1e6:.0f} us, {len(times)} steps), {per_step:.0f} launches a step")
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(profiled):
            step()
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(16)
        print(text.getvalue())
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
