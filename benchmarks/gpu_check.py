"""SmolLM2 on the CUDA engine: greedy tokens against the CPU engine, then prefill and decode
tokens per second at batch 1 and 32. Run by gpu_check.sh on a machine with an NVIDIA GPU.

    python benchmarks/gpu_check.py                 # float32 weights, tokens must equal the CPU's
    PIE_CUDA_WEIGHT_DTYPE=bfloat16 python benchmarks/gpu_check.py --agreement-only

Timings include the host work of each step (batch description upload, logits download), as a
user of the runtime sees them. Exit status 1 when the float32 tokens differ.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import sys
import time

import numpy as np
from pie.model.loader import LoadedModel, load_model
from pie.model.store import resolve_model
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork

PROMPT = "The capital of France is"


def greedy(loaded: LoadedModel, device: Device, prompt: list[int], count: int) -> tuple[list[int], list[float]]:
    """Greedy tokens, and at each step the gap between the two best logits (small: a near tie)."""
    runner = ModelRunner(loaded.config, loaded.tensors(), device, max_cached_tokens=len(prompt) + count + 16)
    try:
        sequence = runner.new_sequence()
        logits = runner.step([SequenceWork(sequence, prompt)])[0]
        tokens: list[int] = []
        margins: list[float] = []
        for _ in range(count):
            top2 = np.sort(logits)[-2:]
            margins.append(float(top2[1] - top2[0]))
            tokens.append(int(np.argmax(logits)))
            logits = runner.step([SequenceWork(sequence, [tokens[-1]])])[0]
        return tokens, margins
    finally:
        runner.close()


def throughput(runner: ModelRunner, batch: int, prompt_len: int, steps: int, rng: np.random.Generator) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) for `batch` sequences of `prompt_len` prompt tokens."""
    vocab = runner.config.vocab_size
    sequences = [runner.new_sequence() for _ in range(batch)]
    try:
        prompts = [[int(t) for t in rng.integers(3, vocab, prompt_len)] for _ in range(batch)]
        start = time.perf_counter()
        logits = runner.step([SequenceWork(s, p) for s, p in zip(sequences, prompts)])
        prefill = batch * prompt_len / (time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(steps):
            tokens = np.argmax(logits, axis=-1)
            logits = runner.step([SequenceWork(s, [int(t)]) for s, t in zip(sequences, tokens)])
        decode = batch * steps / (time.perf_counter() - start)
        return prefill, decode
    finally:
        for sequence in sequences:
            sequence.free()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared with the CPU engine")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per sequence when timing")
    parser.add_argument("--steps", type=int, default=64, help="decode steps timed")
    parser.add_argument("--batches", default="1,32", help="batch sizes timed")
    parser.add_argument("--agreement-only", action="store_true", help="report token agreement, do not fail on it")
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    options = parser.parse_args()
    batches = [int(b) for b in options.batches.split(",")]
    weights = os.environ.get("PIE_CUDA_WEIGHT_DTYPE", "float32")

    registry = EngineRegistry()
    status = registry.status("cuda")
    if status.status != "ok":
        print(f"the CUDA engine cannot run here: {status.status}: {status.reason}", file=sys.stderr)
        return 2
    cuda, cpu = registry.engine("cuda").open(0), registry.engine("cpu").open(0)
    extra = dict(cuda.info.extra)
    print(f"device: {cuda.info.key} {cuda.info.name} ({cuda.info.architecture}, {cuda.info.driver}, "
          f"compiled for {extra.get('compile_target')}, {extra.get('compiler', '')}), weights {weights}")

    loaded = load_model(resolve_model(options.model))
    prompt = loaded.tokenizer.encode(PROMPT)
    start = time.perf_counter()
    on_gpu, _ = greedy(loaded, cuda, prompt, options.tokens)
    print(f"first model load and greedy run on the GPU (kernel compile included): {time.perf_counter() - start:.1f} s")
    on_cpu, margins = greedy(loaded, cpu, prompt, options.tokens)
    same = sum(a == b for a, b in zip(on_gpu, on_cpu))
    first_difference = next((i for i, (a, b) in enumerate(zip(on_gpu, on_cpu)) if a != b), None)
    print(f"greedy tokens, {PROMPT!r} + {options.tokens}: {same}/{options.tokens} equal to the CPU engine"
          + ("" if first_difference is None else f" (first difference at token {first_difference}, where the CPU's "
                                                   f"two best logits are {margins[first_difference]:.2e} apart)"))
    print(f"  gpu: {loaded.tokenizer.decode(on_gpu)!r}")
    if first_difference is not None:
        print(f"  cpu: {loaded.tokenizer.decode(on_cpu)!r}")

    rng = np.random.default_rng(0)
    capacity = max(batches) * (options.prompt_len + options.steps + 16)
    runner = ModelRunner(loaded.config, loaded.tensors(), cuda, max_cached_tokens=capacity)
    try:
        throughput(runner, 1, 8, 2, rng)  # warm-up: first launches, plan uploads
        rows = [(batch, *throughput(runner, batch, options.prompt_len, options.steps, rng)) for batch in batches]
    finally:
        runner.close()
    print(f"\n{os.path.basename(loaded.source)} on {cuda.info.name}, weights {weights}, prompt {options.prompt_len} tokens, "
          f"{options.steps} decode steps")
    print(f"{'batch':>6} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for batch, prefill, decode in rows:
        print(f"{batch:>6} {prefill:>14.0f} {decode:>13.1f}")
    return 0 if first_difference is None or options.agreement_only else 1


if __name__ == "__main__":
    sys.exit(main())
