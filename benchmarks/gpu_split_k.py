"""The CUDA engine's tensor-core GEMM split along k, against the same kernel unsplit, on SmolLM2's
projection shapes at decode-batch and short-prompt row counts. Needs an NVIDIA GPU (sm_80+).

    python benchmarks/gpu_split_k.py [--rows 17,32,64,128,256] [--launches 60] [--runs 5]

Each cell is the median over runs of ``launches`` back-to-back launches and one synchronize (as a
forward pass queues them), per launch. The number of blocks per tile along k follows
``launch.gemm_splits`` for a device of the given multiprocessors: the device's own count with 1, 2 and 4
blocks per multiprocessor as the target, and "unsplit" with one block per tile.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll)

import argparse
import statistics
import sys
import time
from dataclasses import replace

import numpy as np
from pie.contract import KernelRequest
from pie.plugins import EngineRegistry, EngineSelectionError
from pie_engine_cuda import launch as configs
from pie_engine_cuda.launchers import KERNELS
from pie_engine_cuda.plugin import engine

HIDDEN, INTER, QKV = 576, 1536, 960
SHAPES = {  # kernel, (n, k)
    "qkv": ("rms_norm_linear", (QKV, HIDDEN)),
    "o": ("linear_add", (HIDDEN, HIDDEN)),
    "gate_up": ("rms_norm_gate_up_silu", (2 * INTER, HIDDEN)),
    "down": ("linear_add", (HIDDEN, INTER)),
}


def inputs(kernel: str, rows: int, n: int, k: int, rng: np.random.Generator) -> list[np.ndarray | None]:
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
    norm = np.ones(k, np.float32)
    if kernel == "rms_norm_linear":
        return [x, norm, w, None]
    if kernel == "linear_add":
        return [x, w, rng.standard_normal((rows, n), dtype=np.float32)]
    return [x, norm, w]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="17,32,64,128,256")
    parser.add_argument("--launches", type=int, default=60)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    try:
        device = EngineRegistry().engine("cuda").open(0)
    except EngineSelectionError as error:
        print(error, file=sys.stderr)
        return 2
    rt = engine.backend(device.info)
    facts = rt.facts
    targets = {"unsplit": 0, "1/SM": facts.multiprocessors // 2, "2/SM": facts.multiprocessors,
               "4/SM": 2 * facts.multiprocessors}
    print(f"device: {device.info.name}, {facts.multiprocessors} multiprocessors; us per launch (splits)")
    print(f"{'shape':8s} {'rows':>4s} " + " ".join(f"{name:>14s}" for name in targets) + "   best/unsplit")
    rng = np.random.default_rng(0)
    for label, (kernel, (n, k)) in SHAPES.items():
        options = {} if kernel == "linear_add" else {"eps": 1e-5}
        for rows in (int(r) for r in args.rows.split(",")):
            uploaded = [None if a is None else device.upload(a) for a in inputs(kernel, rows, n, k, rng)]
            cells = {}
            paired = kernel == "rms_norm_gate_up_silu"
            config = configs.gemm(n // 2 if paired else n, rows, paired, True)
            for name, multiprocessors in targets.items():
                rt.facts = replace(facts, multiprocessors=multiprocessors)
                launch = KERNELS[kernel][1](rt, KernelRequest(kernel, "tc", tuple(sorted(options.items()))))
                splits = configs.gemm_splits(config.grid_x * config.grid_y, k, multiprocessors)
                launch(*uploaded)
                device.synchronize()
                times = []
                for _ in range(args.runs):
                    start = time.perf_counter()
                    for _ in range(args.launches):
                        launch(*uploaded)
                    device.synchronize()
                    times.append((time.perf_counter() - start) / args.launches * 1e6)
                cells[name] = (statistics.median(times), splits)
            rt.facts = facts
            best = min(t for t, _ in cells.values())
            print(f"{label:8s} {rows:4d} " + " ".join(f"{t:8.1f} ({s:3d})" for t, s in cells.values())
                  + f"   {cells['unsplit'][0] / best:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
