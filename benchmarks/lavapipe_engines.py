"""Tokens/s of the Vulkan and WebGPU engines (on lavapipe here), and their matmul variant sweep.

    python benchmarks/lavapipe_engines.py                 # SmolLM2-135M, batch 1 and 8, sweep
    python benchmarks/lavapipe_engines.py --engines vulkan --steps 4 --no-sweep
    python benchmarks/lavapipe_engines.py --types F32,F16,Q8_0,Q4_1 --engines vulkan,wgpu --no-sweep
    python benchmarks/lavapipe_engines.py --kv-dtypes float32,float16,bfloat16 --context 1024 --engines vulkan,wgpu

Decode tokens/s: after a short prompt per sequence, ``--steps`` batched decode
steps are timed (one warm-up step first); batch 8 means eight sequences per
step. The sweep times every ``linear`` variant on the model's projection shapes
at 1, 8 and 64 tokens and prints the fastest and the slowest. On a shared
machine the figures move a lot from run to run: compare within one run.

With ``--types``, each engine instead decodes one file per weight type, its weights kept in their
stored type where the engine's kernels read it (``docs/weight-types.md``): the shipped Q4_1 file
itself, the others written from it by llama.cpp's quantizer (``--quantizer``, the ``llama-quantize``
binary). Each round times every type back to back, in reverse order every other round; a row gives
the median tok/s and the median over rounds of its ratio to F32 in the same round.

With ``--kv-dtypes``, each engine instead keeps one model per KV page type, fills one sequence's pages
with ``--context`` tokens of random keys and values (a prefill that long takes minutes on lavapipe, and
a decode step's time does not depend on what the pages hold), and times ``--steps`` decode steps per
round on each type back to back (reversed every other round; the context grows by ``--steps`` a round),
and the model's attention kernel alone over those pages. A row gives the median time (wall, or the
process's CPU time, lavapipe's threads included) and the median over rounds of its ratio to float32 KV
in the same round.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import numpy as np
from pie.contract import PageLayout
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import Device, EngineRegistry
from pie.profiles import variant_chooser
from pie.runtime import model_runner
from pie.runtime.model_runner import ModelRunner, SequenceWork

PROMPT = "The capital of France is"


def new_runner(device: Device, model, tensors, batch: int) -> ModelRunner:
    """With the variants the profiles choose, as ``LLM`` runs a model."""
    chooser, _ = variant_chooser(device)
    return ModelRunner(
        model.config, tensors, device, page_size=16, max_cached_tokens=64 * batch + 256, choose_variant=chooser
    )


def decode_rate(runner: ModelRunner, prompt: list[int], batch: int, steps: int) -> float:
    sequences = [runner.new_sequence() for _ in range(batch)]
    try:
        logits = runner.step([SequenceWork(s, prompt) for s in sequences])
        tokens = [int(np.argmax(row)) for row in logits]
        logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            tokens = [int(np.argmax(row)) for row in logits]
            logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])
        return batch * steps / (time.perf_counter() - start)
    finally:
        for sequence in sequences:
            sequence.free()


def write_types(types: list[str], quantizer: str, directory: Path) -> dict[str, Path]:
    """One file per weight type: the shipped Q4_1 model itself, the others written from it by llama-quantize."""
    source = resolve_model(None)
    files = {}
    for weight_type in types:
        if weight_type == "Q4_1":
            files[weight_type] = source
            continue
        target = directory / f"model-{weight_type.lower()}.gguf"
        run = subprocess.run([quantizer, "--allow-requantize", str(source), str(target), weight_type],
                             capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"{quantizer} could not write a {weight_type} copy of {source}:\n{run.stderr[-2000:]}")
        files[weight_type] = target
    return files


def compare_types(registry: EngineRegistry, engines: list[str], files: dict[str, Path], batches: list[int],
                  steps: int, rounds: int) -> None:
    """Every type on every engine, alternating within each round (see the module's docstring)."""
    models = {weight_type: load_model(path) for weight_type, path in files.items()}
    types = list(files)
    for name in engines:
        device = registry.engine(name).open(0)
        runners = {t: new_runner(device, m, list(m.stored_tensors()), max(batches)) for t, m in models.items()}
        for weight_type, runner in runners.items():
            kept = sorted({c.uploaded for c in runner.weight_choices.values()})
            print(f"{name} {weight_type}: {files[weight_type].name}, weights uploaded as {', '.join(kept)}", flush=True)
        prompt = models[types[0]].tokenizer.encode(PROMPT)
        for batch in batches:
            rates: dict[str, list[float]] = {t: [] for t in types}
            for round_ in range(rounds):
                for weight_type in types if round_ % 2 == 0 else types[::-1]:
                    rates[weight_type].append(decode_rate(runners[weight_type], prompt, batch, steps))
            for weight_type in types:
                line = f"{name:<7} batch {batch}  {weight_type:<5} {statistics.median(rates[weight_type]):7.2f} tok/s"
                if "F32" in rates:
                    ratios = [r / f for r, f in zip(rates[weight_type], rates["F32"], strict=True)]
                    shown = ", ".join(f"{r:.2f}" for r in ratios)
                    line += f"   {statistics.median(ratios):5.2f}x F32 (rounds: {shown})"
                print(line, flush=True)
        for runner in runners.values():
            runner.close()


@contextlib.contextmanager
def kv_pages_of(dtype: str) -> Iterator[None]:
    """Runners built inside keep their KV pages in ``dtype``, whether or not ModelRunner takes ``kv_dtype`` yet."""

    def layout(*fields: int, **named: object) -> PageLayout:
        return PageLayout(*fields[:5], **{**named, "dtype": dtype})  # type: ignore[arg-type]

    with mock.patch.object(model_runner, "PageLayout", layout):
        yield


def attention_time(
    device: Device, runner: ModelRunner, pages: np.ndarray, context: int, reps: int
) -> tuple[float, float]:
    """Wall and CPU seconds per launch of the model's decode attention (layer 0, one query token) over ``pages``."""
    config = runner.config
    attend = device.compile("attention", None, layer=0, num_heads=config.num_heads, scale=config.head_dim**-0.5)
    q = device.upload(np.random.default_rng(1).standard_normal((1, config.num_heads * config.head_dim), np.float32))
    last = context - (len(pages) - 1) * runner.page_size
    tables = [device.upload(np.asarray(t, np.int32)) for t in ([0, 1], pages, [0, len(pages)], [last])]
    device.download(attend(q, runner.pages.handle, *tables))
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(reps):
        out = attend(q, runner.pages.handle, *tables)
    device.download(out)
    return (time.perf_counter() - start) / reps, (time.process_time() - cpu) / reps


def compare_kv_dtypes(registry: EngineRegistry, engines: list[str], model, dtypes: list[str], context: int,
                      steps: int, rounds: int) -> None:
    """Decode step time, and the attention kernel's alone, at a long context per KV page type, alternating
    within each round. Wall time, and the CPU time of the process (lavapipe's threads included), which a
    busy machine disturbs less."""
    tensors = list(model.stored_tensors())
    cached = context + (rounds + 1) * steps + 16
    rng = np.random.default_rng(0)
    for name in engines:
        device = registry.engine(name).open(0)
        runners, sequences, tokens = {}, {}, {}
        for dtype in dtypes:
            with kv_pages_of(dtype):
                runner = runners[dtype] = ModelRunner(model.config, tensors, device, page_size=16,
                                                      max_cached_tokens=cached,
                                                      choose_variant=variant_chooser(device)[0])
            sequence = sequences[dtype] = runner.new_sequence()
            sequence.append(context, runner.pages.copy)
            pages = np.asarray(sequence.pages, np.int32)
            pool_type = device.read_pages(runner.pages.handle, pages[:1]).dtype
            shape = (runner.layout.num_layers, len(pages), *runner.layout.shape[2:])
            device.write_pages(runner.pages.handle, pages, rng.standard_normal(shape, np.float32).astype(pool_type))
            tokens[dtype] = int(np.argmax(runner.step([SequenceWork(sequence, [1])])[0]))  # warm-up
        measures = ("decode step", "decode step CPU", "attention", "attention CPU")
        times: dict[str, dict[str, list[float]]] = {m: {d: [] for d in dtypes} for m in measures}
        for round_ in range(rounds):
            for dtype in dtypes if round_ % 2 == 0 else dtypes[::-1]:
                runner, sequence = runners[dtype], sequences[dtype]
                pages = np.asarray(sequence.pages[: -(-context // runner.page_size)], np.int32)
                wall, cpu = attention_time(device, runner, pages, context, 4 * steps)
                times["attention"][dtype].append(wall)
                times["attention CPU"][dtype].append(cpu)
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    tokens[dtype] = int(np.argmax(runner.step([SequenceWork(sequence, [tokens[dtype]])])[0]))
                times["decode step"][dtype].append((time.perf_counter() - start) / steps)
                times["decode step CPU"][dtype].append((time.process_time() - cpu) / steps)
        for measure, by_dtype in times.items():
            for dtype, measured in by_dtype.items():
                median = statistics.median(measured) * 1e3
                line = f"{name:<7} context {context}  {measure:<15}  KV {dtype:<8} {median:8.2f} ms"
                if "float32" in by_dtype:
                    ratios = [t / f for t, f in zip(measured, by_dtype["float32"], strict=True)]
                    shown = ", ".join(f"{r:.3f}" for r in ratios)
                    line += f"   {statistics.median(ratios):.3f}x float32 (rounds: {shown})"
                print(line, flush=True)
        for runner in runners.values():
            runner.close()


def time_launch(device: Device, kernel: str, variant: str, arrays: list[np.ndarray], reps: int) -> float:
    launch = device.compile(kernel, variant)
    tensors = [device.upload(a) for a in arrays]
    device.download(launch(*tensors))
    start = time.perf_counter()
    for _ in range(reps):
        out = launch(*tensors)
    device.download(out)
    return (time.perf_counter() - start) / reps


def sweep(device: Device, shapes: list[tuple[int, int, int]]) -> None:
    rng = np.random.default_rng(0)
    variants = list(device.kernels()["linear"])
    for tokens, n, k in shapes:
        x = rng.standard_normal((tokens, k), dtype=np.float32)
        w = rng.standard_normal((n, k), dtype=np.float32)
        reps = max(1, min(10, int(2e7 // (n * k * max(tokens // 8, 1)))))
        times = {v: time_launch(device, "linear", v, [x, w], reps) for v in variants}
        fast, slow = min(times, key=times.get), max(times, key=times.get)  # type: ignore[arg-type]
        print(
            f"  T={tokens:<3} N={n:<6} K={k:<5} fastest {fast:<8} {times[fast] * 1e3:8.2f} ms"
            f"   slowest {slow:<8} {times[slow] * 1e3:8.2f} ms   ({times[slow] / times[fast]:.1f}x)",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--engines", default="vulkan,wgpu,cpu")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--types", default="", help="weight types to compare, e.g. F32,F16,Q8_0,Q4_1")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the --types and --kv-dtypes comparisons")
    parser.add_argument("--kv-dtypes", default="", help="KV page types to compare, e.g. float32,float16,bfloat16")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before the --kv-dtypes decode steps")
    parser.add_argument("--quantizer", default=os.environ.get("LLAMA_QUANTIZE") or shutil.which("llama-quantize"),
                        help="llama.cpp's llama-quantize binary (default: $LLAMA_QUANTIZE, else on PATH)")
    args = parser.parse_args()

    registry = EngineRegistry()
    batches = [int(b) for b in args.batches.split(",")]
    if args.kv_dtypes:
        print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        model = load_model(resolve_model(args.model))
        compare_kv_dtypes(registry, args.engines.split(","), model, args.kv_dtypes.split(","), args.context,
                          args.steps, args.rounds)
        print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        return
    if args.types:
        types = args.types.split(",")
        if any(t != "Q4_1" for t in types) and not args.quantizer:
            raise SystemExit("--types needs llama.cpp's llama-quantize: pass --quantizer or set LLAMA_QUANTIZE")
        print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        with tempfile.TemporaryDirectory() as scratch:
            files = write_types(types, args.quantizer, Path(scratch))
            compare_types(registry, args.engines.split(","), files, batches, args.steps, args.rounds)
        print(f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        return
    model = load_model(resolve_model(args.model))
    tensors = list(model.tensors())
    config = model.config
    print(f"model {model.source}: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}")
    for name in args.engines.split(","):
        device = registry.engine(name).open(0)
        runner = new_runner(device, model, tensors, max(batches))
        prompt = model.tokenizer.encode(PROMPT)
        rates = [f"batch {b}: {decode_rate(runner, prompt, b, args.steps):6.2f} tok/s" for b in batches]
        runner.close()
        print(f"{name:<7} {device.info.name:<36} " + "   ".join(rates), flush=True)
    if args.no_sweep:
        return
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = [
        (q + 2 * kv, config.hidden_size),
        (2 * config.intermediate_size, config.hidden_size),
        (config.hidden_size, config.intermediate_size),
    ]
    # The LM head only ever sees the sampled rows (one per sequence).
    shapes = [(t, n, k) for t in (1, 8, 64) for n, k in layer] + [
        (t, config.vocab_size, config.hidden_size) for t in (1, 8)
    ]
    for name in args.engines.split(","):
        if name == "cpu":
            continue
        device = registry.engine(name).open(0)
        print(f"linear variant sweep on {name} ({device.info.name}):")
        sweep(device, shapes)


if __name__ == "__main__":
    main()
