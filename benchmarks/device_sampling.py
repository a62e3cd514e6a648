"""Sampling on the device against the host: bytes downloaded per token and decode tokens/s.

    python benchmarks/device_sampling.py [--engine cpu] [--batches 1,8] [--steps 32] [--rounds 3]

SmolLM2-135M fp32 on the engine given (the CPU engine by default), driven by the batch scheduler one
step at a time: every sequence decodes ``--steps`` tokens after a 16-token prompt. Each round runs the
host path (every logit downloaded, ``Sampler.sample`` over the row) and the device path (the passes
ask for ``top`` = ``Sampler.top_tokens_needed``: the argmax when greedy, the engine's ``top_k`` for
top-k sampling) alternately, greedy and top-k (temperature 0.8, top_k 40, seeded). It prints the bytes
the device downloaded per generated token, decode tok/s (median over the rounds) and the device/host
ratio, and whether both paths drew the same tokens. Then the readout alone, which decode's noise hides
on a CPU: microseconds a step to go from device logits ``[batch, vocab]`` to tokens, host against device
(median of ``--readouts`` alternating pairs).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import statistics
import time

import numpy as np
from pie.generation import Sampler, SamplingParams, TopTokens
from pie.runtime.llm import LLM
from pie.runtime.model_runner import ModelRunner
from pie.scheduler.core import BatchScheduler, PassResult, SchedulerConfig

PROMPT_TOKENS = 16
SAMPLINGS = {"greedy": SamplingParams(), "top_k 40": SamplingParams(temperature=0.8, top_k=40, seed=7)}


class DownloadCounter:
    """Counts the bytes a device's downloads return (wraps the facade's per-call download)."""

    def __init__(self, runner: ModelRunner):
        self.bytes = 0
        device = runner.device
        inner = device._download

        def counted(tensor: object) -> np.ndarray:
            array = inner(tensor)
            self.bytes += array.nbytes
            return array

        device._download = counted


def decode(
    runner: ModelRunner, counter: DownloadCounter, batch: int, steps: int, sampling: SamplingParams, on_device: bool
) -> tuple[float, float, list[list[int]]]:
    """Decode tok/s, bytes downloaded per token while decoding, and the tokens drawn."""
    core = BatchScheduler(runner, None, SchedulerConfig(max_batch_sequences=max(256, batch)))
    samplers = [Sampler(sampling) for _ in range(batch)]
    top = samplers[0].top_tokens_needed(runner.config.vocab_size) if on_device else 0
    rng = np.random.default_rng(0)
    sequences = [core.new_sequence() for _ in range(batch)]
    results: list[PassResult] = [None] * batch
    drawn: list[list[int]] = [[] for _ in range(batch)]

    def submit(index: int, tokens: list[int]) -> None:
        def done(result: PassResult, error: BaseException | None) -> None:
            if error is not None:
                raise error
            results[index] = result

        core.submit(sequences[index], tokens, done, top=top)

    def draw() -> None:
        for index, sampler in enumerate(samplers):
            result = results[index]
            assert result is not None
            drawn[index].append(sampler.sample(result))

    for index in range(batch):
        submit(index, rng.integers(100, runner.config.vocab_size, PROMPT_TOKENS).tolist())
    while core.has_work():
        core.step()
    draw()
    before = counter.bytes
    start = time.perf_counter()
    for _ in range(steps):
        for index in range(batch):
            submit(index, [drawn[index][-1]])
        core.step()
        draw()
    elapsed = time.perf_counter() - start
    for seq in sequences:
        core.drop(seq)
    return batch * steps / elapsed, (counter.bytes - before) / (batch * steps), drawn


def readout_us(runner: ModelRunner, batch: int, sampling: SamplingParams, pairs: int) -> tuple[float, float]:
    """Median microseconds from device logits to a batch's tokens: every logit downloaded and sampled on
    the host, against ``Device.top_tokens`` and sampling over those."""
    device, vocab = runner.device, runner.config.vocab_size
    logits = device.upload(np.random.default_rng(1).standard_normal((batch, vocab)).astype(np.float32) * 4)
    samplers = [Sampler(sampling) for _ in range(batch)]
    top = samplers[0].top_tokens_needed(vocab)
    k = 1 << (top - 1).bit_length()

    def on_host() -> None:
        rows = device.download(logits)
        for index, sampler in enumerate(samplers):
            sampler.sample(rows[index])

    def on_device() -> None:
        found = TopTokens(*device.top_tokens(logits, k))
        for index, sampler in enumerate(samplers):
            sampler.sample(found[index])

    times: dict[bool, list[float]] = {False: [], True: []}
    for pair in range(pairs):
        for where, run in ((False, on_host), (True, on_device))[:: 1 if pair % 2 == 0 else -1]:
            start = time.perf_counter()
            run()
            times[where].append(time.perf_counter() - start)
    return statistics.median(times[False]) * 1e6, statistics.median(times[True]) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="cpu")
    parser.add_argument("--batches", default="1,8", help="comma-separated sequence counts")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--readouts", type=int, default=200, help="alternating pairs timing the readout alone")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM.load(None, args.engine, max_cached_tokens=max(batches) * (PROMPT_TOKENS + args.steps + 16))
    runner = llm.runner
    counter = DownloadCounter(runner)
    vocab = runner.config.vocab_size
    print(f"SmolLM2-135M fp32 on {runner.device.info.key}, vocab {vocab}, {PROMPT_TOKENS}-token prompts,")
    print(f"{args.steps} decode steps, {args.rounds} rounds alternating host/device (ABBA); load {os.getloadavg()[0]:.2f}")
    for name, sampling in SAMPLINGS.items():
        for batch in batches:
            for on_device in (False, True):
                decode(runner, counter, batch, 2, sampling, on_device)  # first-use compiles and caches
            rates: dict[bool, list[float]] = {False: [], True: []}
            per_token: dict[bool, float] = {}
            tokens: dict[bool, list[list[int]]] = {}
            for round_ in range(args.rounds):
                for on_device in (False, True) if round_ % 2 == 0 else (True, False):  # ABBA: no side always second
                    rate, downloaded, drawn = decode(runner, counter, batch, args.steps, sampling, on_device)
                    tokens[on_device] = drawn
                    rates[on_device].append(rate)
                    per_token[on_device] = downloaded
            host, device = statistics.median(rates[False]), statistics.median(rates[True])
            print(
                f"{name:>9}, batch {batch}: downloaded per token {per_token[False]:,.0f} B host -> "
                f"{per_token[True]:,.0f} B device; decode {host:.1f} -> {device:.1f} tok/s "
                f"(device/host {device / host:.3f}); same tokens: {'yes' if tokens[False] == tokens[True] else 'NO'}"
            )
    for name, sampling in SAMPLINGS.items():
        for batch in batches:
            host, device = readout_us(runner, batch, sampling, args.readouts)
            print(f"{name:>9}, batch {batch}: readout {host:,.0f} us host -> {device:,.0f} us device a step")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
