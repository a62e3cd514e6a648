"""The CPU engine's native kernels next to the numpy/BLAS ones, and decode forward passes by batch size.

    python benchmarks/native_kernels.py             # kernels: native vs BLAS/numpy, same process
    python benchmarks/native_kernels.py --forward [--model F32.gguf]   # forward pass ms at batch 1, 2, 4, 8, 32
    python benchmarks/native_kernels.py --blocks    # all layers as one launch, each as one, regions; same process
    python benchmarks/native_kernels.py --types     # one token through a hot weight of each stored type, one thread
    OPENBLAS_CORETYPE=Haswell python benchmarks/native_kernels.py --march haswell   # as on an AVX2 CPU

The kernel comparison streams SmolLM2-135M's weight shapes from memory (the whole set once per pass,
laid out a layer per huge-page block as the engine uploads them), so the figures are those of a decode
step, not of a cache-resident matrix. ``--forward`` uses only the runtime's public pieces, so it also
runs against an older checkout (``git worktree add /tmp/old REV``, then
``PYTHONPATH=/tmp/old/pie-core/src:/tmp/old/pie-engine-cpu/src python benchmarks/native_kernels.py --forward``).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import time

import numpy as np

LAYERS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 30, 576, 1536, 9, 3, 64, 49152


def _median_seconds(run, repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def weight_set_pass(repeats: int) -> None:
    from pie_engine_cpu import kernels, native
    from pie_engine_cpu.memory import pack

    rng = np.random.default_rng(0)
    shapes = [(HEADS * HEAD_DIM + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
    weights = [w for _ in range(LAYERS) for w in pack([rng.standard_normal(s, dtype=np.float32) * 0.05 for s in shapes])]
    weights += pack([rng.standard_normal((VOCAB, HIDDEN), dtype=np.float32) * 0.05])
    inputs = {cols: rng.standard_normal((1, cols), dtype=np.float32) for cols in (HIDDEN, INTER)}
    launchers = {"BLAS": kernels.linear, "native": native.make_linear(kernels.linear)}
    nbytes = sum(w.nbytes for w in weights)
    results: dict[str, list[float]] = {name: [] for name in launchers}
    for _ in range(3):  # interleaved rounds: the machine's drift hits both alike
        for name, launch in launchers.items():
            results[name].append(_median_seconds(lambda launch=launch: [launch(inputs[w.shape[1]], w) for w in weights], repeats))
    print(f"one token through every projection of SmolLM2-135M ({nbytes / 1e6:.0f} MB of weights):")
    for name, times in results.items():
        seconds = statistics.median(times)
        print(f"  {name:7s} {seconds * 1e3:7.2f} ms  {nbytes / seconds / 1e9:5.1f} GB/s")
    print(f"  native / BLAS speed: {statistics.median(results['BLAS']) / statistics.median(results['native']):.2f}x")


def gate_up_by_rows(repeats: int) -> None:
    from pie_engine_cpu import kernels, native
    from pie_engine_cpu.memory import pack

    rng = np.random.default_rng(1)
    weights = [pack([rng.standard_normal((2 * INTER, HIDDEN), dtype=np.float32) * 0.05])[0] for _ in range(20)]
    norm = np.ones(HIDDEN, np.float32)
    blas = kernels.make_rms_norm_gate_up_silu(1e-5)
    launchers = {"BLAS": blas, "native": native.make_rms_norm_gate_up_silu(blas, 1e-5)}
    print("RMSNorm + gate/up projection + SiLU, 3072x576, us per launch (weights from memory):")
    for rows in (1, 2, 4, 8, 16):
        x = rng.standard_normal((rows, HIDDEN), dtype=np.float32)
        cells = []
        for name, launch in launchers.items():
            seconds = _median_seconds(lambda launch=launch, x=x: [launch(x, norm, w) for w in weights], repeats)
            cells.append(f"{name} {seconds / len(weights) * 1e6:7.1f}")
        print(f"  {rows:2d} rows: " + "   ".join(cells))


def decode_attention(repeats: int) -> None:
    from pie_engine_cpu import kernels, native

    rng = np.random.default_rng(2)
    page_size = 16
    print("decode attention, one sequence, 9 query / 3 KV heads of 64, us per layer:")
    for keys in (100, 1000):
        pages = -(-keys // page_size)
        pool = rng.standard_normal((2, pages + 1, 2, page_size, KV_HEADS, HEAD_DIM), dtype=np.float32)
        q = rng.standard_normal((1, HEADS * HEAD_DIM), dtype=np.float32)
        batch = (
            np.array([0, 1], np.int32),
            np.arange(pages, dtype=np.int32),
            np.array([0, pages], np.int32),
            np.array([keys - (pages - 1) * page_size], np.int32),
        )
        cells = []
        for name, attend in (("numpy", kernels.make_attention(1, HEADS, 0.125)), ("native", native.make_attention(1, HEADS, 0.125))):
            seconds = _median_seconds(
                lambda attend=attend, q=q, pool=pool, batch=batch: [attend(q, pool, *batch) for _ in range(100)], repeats
            )
            cells.append(f"{name} {seconds / 100 * 1e6:6.1f}")
        print(f"  {keys:5d} keys: " + "   ".join(cells))


def forward_by_batch(steps: int, model: str | None) -> None:
    from pie.runtime.llm import LLM
    from pie.runtime.model_runner import SequenceWork

    rng = np.random.default_rng(0)
    for batch in (1, 2, 4, 8, 32):
        llm = LLM.load(model, "cpu", max_cached_tokens=batch * 96 + 64)
        runner = llm.runner
        sequences = [runner.new_sequence() for _ in range(batch)]
        for sequence in sequences:
            runner.step([SequenceWork(sequence, rng.integers(100, 40000, 32).tolist())])
        times = []
        for _ in range(steps):
            work = runner.prepare([SequenceWork(s, [int(rng.integers(100, 40000))]) for s in sequences])
            start = time.perf_counter()
            runner.forward(work)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        print(f"batch {batch:2d}: forward {seconds * 1e3:7.2f} ms -> {batch / seconds:6.1f} tok/s")
        del llm, runner


def forward_blocks_vs_regions(steps: int, rounds: int = 6) -> None:
    """All decoder layers as one launch (``pie_compile_stack``) and each layer as one launch
    (``pie_compile_block``) against the regions' kernels, three runners of one process measured in
    alternation."""
    from pie.model.loader import load_model
    from pie.model.store import resolve_model
    from pie.plugins import EngineRegistry
    from pie.profiles.lookup import variant_chooser
    from pie.runtime.model_runner import ModelRunner, SequenceWork

    loaded = load_model(resolve_model(None))
    rng = np.random.default_rng(0)
    for batch in (1, 2, 4, 8, 16):
        runners = {}
        for name in ("regions", "blocks", "stack"):
            device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
            if name != "stack":
                device.compile_stack = lambda stack, blocks: None  # this device only
            if name == "regions":
                device.compile_block = lambda block: None
            chooser, _ = variant_chooser(device)
            runner = ModelRunner(
                loaded.config, loaded.tensors(), device, max_cached_tokens=batch * 400 + 64, choose_variant=chooser
            )
            sequences = [runner.new_sequence() for _ in range(batch)]
            for sequence in sequences:
                runner.step([SequenceWork(sequence, rng.integers(100, 40000, 32).tolist())])
            runners[name] = (runner, sequences)
        times: dict[str, list[float]] = {name: [] for name in runners}
        for _ in range(rounds):
            for name, (runner, sequences) in runners.items():
                for _ in range(steps):
                    work = runner.prepare([SequenceWork(s, [int(rng.integers(100, 40000))]) for s in sequences])
                    start = time.perf_counter()
                    runner.forward(work)
                    times[name].append(time.perf_counter() - start)
        regions, blocks, stack = (statistics.median(times[name]) for name in ("regions", "blocks", "stack"))
        print(
            f"batch {batch:2d}: regions {regions * 1e3:7.2f} ms, blocks {blocks * 1e3:7.2f} ms "
            f"({regions / blocks:.3f}x), stack {stack * 1e3:7.2f} ms ({blocks / stack:.3f}x the blocks)"
        )


def stored_types(calls: int) -> None:
    """GB/s of weight read by one token through a hot 1536x768 weight of each stored type (cache-resident, one
    thread, the best of ``calls`` calls): the kernels' arithmetic cost, which decodes on quantized weights are
    bound by, measured apart from the machine's memory (robust on a loaded machine, unlike a decode step)."""
    import ctypes

    from pie.testing.kquants import K_TYPES, quantize_k
    from pie.weights import quantize
    from pie.enginekit.host import usable_cpus
    from pie_engine_cpu import kernels, native

    ctypes.CDLL(str(native.load().path)).pie_set_threads(1)  # the loaded library's pool, lowered to one thread
    linear = native.make_linear(kernels.linear)
    rng = np.random.default_rng(0)
    dense = (0.05 * rng.standard_normal((1536, 768))).astype(np.float32)
    x = rng.standard_normal((1, 768)).astype(np.float32)
    print(f"one token through a hot 1536x768 weight, one thread, best of {calls} calls "
          f"(activations: {native.activations()}):")
    for weight_type in ("f32", *native.WEIGHT_TYPES):
        weight = quantize_k(dense, weight_type) if weight_type in K_TYPES else quantize(dense, weight_type)
        best = float("inf")
        for _ in range(calls):
            start = time.perf_counter()
            linear(x, weight)
            best = min(best, time.perf_counter() - start)
        print(f"  {weight_type:5s} {best * 1e6:7.1f} us  {weight.nbytes / best / 1e9:5.1f} GB/s")
    ctypes.CDLL(str(native.load().path)).pie_set_threads(usable_cpus())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--forward", action="store_true", help="forward pass ms by batch size instead")
    parser.add_argument(
        "--blocks", action="store_true", help="forward pass with all layers as one launch, each layer as one, and its regions, by batch"
    )
    parser.add_argument("--types", action="store_true", help="each stored weight type's GEMV, hot, one thread, instead")
    parser.add_argument("--model", help="with --forward: the model (default: the embedded Q4_1 GGUF, as stored)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--march", default="native", help="build the native kernels for this -march (haswell: AVX2, x86-64: SSE2)"
    )
    args = parser.parse_args()
    if args.march != "native":
        from pie_engine_cpu import native

        native.FLAGS = tuple(f"-march={args.march}" if f == "-march=native" else f for f in native.FLAGS)
    if args.types:
        stored_types(calls=2000)
        return
    if args.blocks:
        forward_blocks_vs_regions(steps=8)
        return
    if args.forward:
        forward_by_batch(steps=16, model=args.model)
        return
    weight_set_pass(args.repeats)
    gate_up_by_rows(args.repeats)
    decode_attention(args.repeats)


if __name__ == "__main__":
    main()
