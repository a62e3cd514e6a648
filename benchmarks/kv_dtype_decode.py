"""Decode speed of the default model over KV pages of each type (``--kv-dtype``) on the CPU engine, at a
long context, the types alternating in one process.

    python benchmarks/kv_dtype_decode.py                       # 2048 tokens of context, batch 1
    python benchmarks/kv_dtype_decode.py --context 4096 --batch 4 --rounds 10

One runner per type over the same weights, each with its sequences prefilled to ``--context`` tokens once.
A round times ``--steps`` decode steps on each runner in turn (the order rotates from round to round) and
truncates the sequences back to the context after, so every round decodes at the same length. On a noisy
machine the per-round ratio to float32 is what survives; it prints their median and range, tok/s per
type, and the load average before and after. ``pie bench --kv-dtype TYPE --prompt-tokens 2048`` measures
one type at a time.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import statistics
import time

import numpy as np

TYPES = ("float32", "float16", "bfloat16")
PREFILL_CHUNK = 512


def prefilled(runner, batch: int, context: int, rng: np.random.Generator) -> list:
    from pie.runtime.model_runner import SequenceWork

    sequences = [runner.new_sequence() for _ in range(batch)]
    for sequence in sequences:
        prompt = rng.integers(3, 40000, context).tolist()
        for start in range(0, context, PREFILL_CHUNK):
            runner.step([SequenceWork(sequence, prompt[start : start + PREFILL_CHUNK])])
    return sequences


def decode_seconds(runner, sequences: list, steps: int, context: int) -> float:
    """Seconds for ``steps`` batched decode steps from ``context`` tokens; the sequences are cut back after."""
    from pie.runtime.model_runner import SequenceWork

    logits = runner.step([SequenceWork(s, [5]) for s in sequences])  # warm: the pages' memory, the launchers
    start = time.perf_counter()
    for _ in range(steps):
        logits = runner.step([SequenceWork(s, [int(np.argmax(row))]) for s, row in zip(sequences, logits)])
    elapsed = time.perf_counter() - start
    for sequence in sequences:
        sequence.truncate(context)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="tokens in each sequence before decoding")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16, help="decode steps a round times, per type")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()

    from pie.model.loader import load_model
    from pie.model.store import resolve_model
    from pie.plugins import EngineRegistry
    from pie.runtime.model_runner import ModelRunner

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    loaded = load_model(resolve_model(None))
    tokens = args.batch * (args.context + args.steps + 32)
    runners = {
        kv: ModelRunner(loaded.config, loaded.stored_tensors(), device, max_cached_tokens=tokens, kv_dtype=kv)
        for kv in TYPES
    }
    rng = np.random.default_rng(0)
    sequences = {kv: prefilled(runner, args.batch, args.context, rng) for kv, runner in runners.items()}
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {kv: [] for kv in TYPES}
    for round_index in range(args.rounds):
        order = TYPES[round_index % len(TYPES) :] + TYPES[: round_index % len(TYPES)]
        for kv in order:
            seconds[kv].append(decode_seconds(runners[kv], sequences[kv], args.steps, args.context))
    load_after = os.getloadavg()
    rate = args.batch * args.steps
    print(
        f"decode at {args.context} tokens of context, batch {args.batch}, {args.rounds} rounds of {args.steps} steps "
        f"(load average {load_before[0]:.2f} before, {load_after[0]:.2f} after)"
    )
    for kv in TYPES:
        ratios = [base / own for base, own in zip(seconds["float32"], seconds[kv], strict=True)]
        kv_bytes = runners[kv].layout.page_bytes * -(-args.context // runners[kv].page_size) * args.batch
        print(
            f"  {kv:9} {rate / statistics.median(seconds[kv]):7.1f} tok/s  "
            f"{statistics.median(ratios):.3f}x float32's (rounds {min(ratios):.3f}-{max(ratios):.3f}); "
            f"KV read a step {kv_bytes / 1e6:.1f} MB"
        )
    for runner in runners.values():
        runner.close()


if __name__ == "__main__":
    main()
