"""`pie bench`: prefill and decode speed next to this machine's memory-bandwidth roofline."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from pie.blas import blas_kernels
from pie.plugins import Device
from pie.runtime.llm import LLM


def measure_bandwidth(device: Device | None = None, megabytes: int = 768, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s reachable by a decode step: the faster of the engine's own
    measurement (``pie_memory_bandwidth``) and, for host memory, the best of several fp32 GEMVs
    (BLAS, all its threads) over a matrix far larger than the caches. A single-threaded sum reads
    more slowly here, so it would understate the roofline; so did BLAS alone once the CPU engine's
    native kernels streamed weights faster than it."""
    engine = device.memory_bandwidth() if device is not None else None
    if engine is not None and device is not None and device.info.kind != "cpu":
        return engine
    columns = 4096
    matrix = np.ones((megabytes * 2**20 // 4 // columns, columns), dtype=np.float32)
    vector = np.ones(columns, dtype=np.float32)
    matrix @ vector
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matrix @ vector
        best = min(best, time.perf_counter() - start)
    return max(matrix.nbytes / best, engine or 0.0)


def decode_bytes_per_token(llm: LLM, context: int) -> int:
    """Bytes one decode step must read: every weight matrix once (the embedding only as LM head) plus the KV cache."""
    config = llm.runner.config
    h, d = config.hidden_size, config.head_dim
    per_layer = (
        2 * h
        + (config.num_heads + 2 * config.num_kv_heads) * d * h
        + config.num_heads * d * h
        + 3 * config.intermediate_size * h
    )
    weights = config.num_layers * per_layer + h + config.vocab_size * h
    kv = config.num_layers * 2 * config.num_kv_heads * d * context
    return 4 * (weights + kv)


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Seconds from the prompt to its last token's logits, in the chunks `pie run` and the scheduler use."""
    sequence = llm.runner.new_sequence()
    try:
        start = time.perf_counter()
        llm.prefill(sequence, prompt)
        return time.perf_counter() - start
    finally:
        sequence.free()


def decode_seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Seconds for ``tokens`` greedy decode steps after the prompt (the prefill is not timed)."""
    stream = llm.generate_tokens(prompt, max_tokens=tokens + 1, stop_token_ids=())
    next(stream)  # the first token comes from the prefill
    start = time.perf_counter()
    produced = sum(1 for _ in stream)
    elapsed = time.perf_counter() - start
    if produced != tokens:
        raise RuntimeError(f"decode produced {produced} tokens, expected {tokens}")
    return elapsed


def run_bench(
    model: str | None, engine: str | None, prompt_tokens: int, decode_tokens: int, runs: int, concurrency: int
) -> dict[str, Any]:
    if prompt_tokens < 1 or decode_tokens < 1 or runs < 1 or concurrency < 1:
        raise ValueError("prompt tokens, decode tokens, runs and concurrency must all be at least 1")
    llm = LLM.load(model, engine, max_cached_tokens=max(2048, concurrency * (prompt_tokens + decode_tokens + 16)))
    rng = np.random.default_rng(0)
    vocab = llm.runner.config.vocab_size
    prompt = [int(t) for t in rng.integers(100, vocab, prompt_tokens)]
    device = llm.device.info
    report: dict[str, Any] = {
        "engine": device.engine,
        "device": device.name,
        "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens,
        "runs": runs,
        "concurrency": concurrency,
    }
    if concurrency > 1:
        from pie.scheduler.bench import concurrent_bench

        report.update(concurrent_bench(llm, concurrency, prompt_tokens, decode_tokens))
        return report
    decode_seconds(llm, prompt[:8], 4)  # warm-up: first-use compiles and allocations
    prefill = statistics.median(prefill_seconds(llm, prompt) for _ in range(runs))
    # Each decode run is measured against the faster of the bandwidth reads right before and right after
    # it: the machine's memory speed can move by tens of percent within seconds, a share taken against a
    # bandwidth measured in another spell says more about the spell than about the decode, and a run
    # that straddles a change of spell is held to the faster one (paired with the read after it alone,
    # such runs read 107% and 117%).
    bytes_per_token = decode_bytes_per_token(llm, prompt_tokens + decode_tokens // 2)
    rates, bandwidths, shares = [], [], []
    reads = [measure_bandwidth(llm.device)]
    for _ in range(runs):
        rates.append(decode_tokens / decode_seconds(llm, prompt, decode_tokens))
        reads.append(measure_bandwidth(llm.device))
        bandwidths.append(max(reads[-2], reads[-1]))
        shares.append(rates[-1] * bytes_per_token / bandwidths[-1])
    decode_rate, bandwidth = statistics.median(rates), statistics.median(bandwidths)
    roofline = bandwidth / bytes_per_token
    report.update(
        prefill_tokens_per_s=prompt_tokens / prefill,
        decode_tokens_per_s=decode_rate,
        bandwidth_gb_per_s=bandwidth / 1e9,
        decode_roofline_tokens_per_s=roofline,
        roofline_fraction=statistics.median(shares),
    )
    report["text"] = (
        f"engine {device.engine} on {device.name}, median of {runs} runs\n"
        f"numpy BLAS: {blas_kernels()}\n"
        f"prefill  {prompt_tokens} tokens: {report['prefill_tokens_per_s']:8.1f} tok/s\n"
        f"decode   {decode_tokens} tokens: {decode_rate:8.1f} tok/s\n"
        f"memory bandwidth (read): {bandwidth / 1e9:.1f} GB/s -> decode roofline {roofline:.1f} tok/s; "
        f"reached {100 * report['roofline_fraction']:.0f}% (median of the runs, each against the faster "
        f"bandwidth read around it)"
    )
    return report
