"""Tokens/s of the Vulkan and WebGPU engines (on lavapipe here), and their matmul variant sweep.

    python benchmarks/lavapipe_engines.py                 # SmolLM2-135M, batch 1 and 8, sweep
    python benchmarks/lavapipe_engines.py --engines vulkan --steps 4 --no-sweep

Decode tokens/s: after a short prompt per sequence, ``--steps`` batched decode
steps are timed (one warm-up step first); batch 8 means eight sequences per
step. The sweep times every ``linear`` variant on the model's projection shapes
at 1, 8 and 64 tokens and prints the fastest and the slowest. On a shared
machine the figures move a lot from run to run: compare within one run.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import time

import numpy as np
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork

PROMPT = "The capital of France is"


def decode_rate(device: Device, model, tensors, batch: int, steps: int) -> float:
    runner = ModelRunner(model.config, tensors, device, page_size=16, max_cached_tokens=64 * batch + 256)
    try:
        prompt = model.tokenizer.encode(PROMPT)
        sequences = [runner.new_sequence() for _ in range(batch)]
        logits = runner.step([SequenceWork(s, prompt) for s in sequences])
        tokens = [int(np.argmax(row)) for row in logits]
        logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            tokens = [int(np.argmax(row)) for row in logits]
            logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])
        return batch * steps / (time.perf_counter() - start)
    finally:
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
    variants = [v for v in device.kernels()["linear"] if v != "auto"]
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
    args = parser.parse_args()

    registry = EngineRegistry()
    model = load_model(resolve_model(args.model))
    tensors = list(model.tensors())
    config = model.config
    print(f"model {model.source}: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}")
    for name in args.engines.split(","):
        device = registry.engine(name).open(0)
        rates = [
            f"batch {b}: {decode_rate(device, model, tensors, int(b), args.steps):6.2f} tok/s"
            for b in args.batches.split(",")
        ]
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
