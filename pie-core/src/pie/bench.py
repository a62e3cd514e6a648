"""`pie bench`: prefill and decode speed next to this machine's memory-bandwidth roofline."""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from pie.blas import blas_kernels
from pie.model.config import ModelConfig
from pie.plugins import Device
from pie.runtime.llm import LLM, kv_bytes_per_token
from pie.weights import Dtype, row_bytes


def measure_bandwidth(device: Device | None = None, megabytes: int = 768, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s reachable by a decode step: the faster of the engine's own
    measurement (``pie_memory_bandwidth``) and, for host memory, the best of several fp32 GEMVs
    (BLAS, all its threads) over a matrix far larger than the caches. A single-threaded sum reads
    more slowly here, so it would understate the roofline; so did BLAS alone once the CPU engine's
    native kernels streamed weights faster than it."""
    engine = device.memory_bandwidth(passes=repeats) if device is not None else None
    if engine is not None and device is not None and device.info.kind != "cpu":
        return engine
    return max(_host_gemv_pass(megabytes, repeats), engine or 0.0)


def _host_gemv_pass(megabytes: int, passes: int) -> float:
    """Bytes/s of the best of ``passes`` fp32 GEMVs over a host matrix of ``megabytes`` (made once per size)."""
    matrix, vector = _host_gemv_operands(megabytes)
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        matrix @ vector
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best


@functools.cache
def _host_gemv_operands(megabytes: int) -> tuple[np.ndarray, np.ndarray]:
    columns = 4096
    matrix = np.ones((megabytes * 2**20 // 4 // columns, columns), dtype=np.float32)
    vector = np.ones(columns, dtype=np.float32)
    matrix @ vector  # the first pass faults the pages in and starts BLAS's threads
    return matrix, vector


def read_pass(device: Device | None) -> Callable[[], float]:
    """A probe that reads the device's memory once per call and returns that pass's bytes/s: the
    bandwidth of the moment, to pair with a decode step timed right before it. The engine's own pass
    where it measures its memory, else one GEMV over a host matrix."""
    if device is not None and device.memory_bandwidth(passes=1) is not None:
        return functools.partial(device.memory_bandwidth, passes=1)  # type: ignore[return-value]  # not None now
    return functools.partial(_host_gemv_pass, 768, 1)


def paired_steps(step: Callable[[], object], steps: int, read: Callable[[], float]) -> tuple[list[float], list[float]]:
    """Runs ``step`` ``steps`` times with a read pass right after each; returns the steps' seconds and
    the passes' bytes/s. ``paired_share`` turns them into the run's share of the roofline."""
    seconds, passes = [], []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
        passes.append(read())
    return seconds, passes


def paired_share(seconds: list[float], passes: list[float], bytes_per_step: int) -> tuple[float, float]:
    """A paired run's share of the roofline, and its bandwidth: the steps' bytes over their total time,
    against the passes' bytes over theirs (each pass reads the same buffer: the harmonic mean).

    Why pairs: the memory speed of this machine moves a lot within seconds, and even within a fast
    spell single passes spread widely. Against the best of the reads around a run, the run's average
    is held to the fastest moment of its window; paired, the steps and the passes are averaged
    over the same moments, one statistic on both sides. Slow steps still count in full."""
    bandwidth = len(passes) / sum(1.0 / rate for rate in passes)
    return len(seconds) * bytes_per_step / sum(seconds) / bandwidth, bandwidth


def decode_bytes_per_token(llm: LLM, context: int) -> int:
    """Bytes one decode step must read: every weight once as uploaded (each in its own type; the embedding table
    only where it is also the LM head, since a lookup reads one row) plus the KV cache."""
    config, memory = llm.runner.config, llm.memory
    if memory is None:
        raise ValueError("the model's memory use is not known (load it with LLM.load)")
    weights = memory.weight_bytes
    if not config.tie_word_embeddings:
        weights -= config.vocab_size * row_bytes(llm.runner.weight_choices["w.embed"].uploaded, config.hidden_size)
    return weights + kv_bytes_per_token(config, llm.runner.layout.dtype) * context


def prefill_seconds(llm: LLM, prompt: list[int]) -> float:
    """Seconds from the prompt to its last token's logits, in the chunks `pie run` and the scheduler use."""
    sequence = llm.runner.new_sequence()
    try:
        start = time.perf_counter()
        llm.prefill(sequence, prompt)
        return time.perf_counter() - start
    finally:
        sequence.free()


def _decode_stream(llm: LLM, prompt: list[int], tokens: int) -> Generator[int, None, None]:
    """A greedy stream of ``tokens`` decode steps after the prompt, its prefill already run."""
    stream = llm.generate_tokens(prompt, max_tokens=tokens + 1, stop_token_ids=())
    next(stream)  # the first token comes from the prefill
    return stream


def decode_seconds(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Seconds for ``tokens`` greedy decode steps after the prompt (the prefill is not timed)."""
    stream = _decode_stream(llm, prompt, tokens)
    start = time.perf_counter()
    produced = sum(1 for _ in stream)
    elapsed = time.perf_counter() - start
    if produced != tokens:
        raise RuntimeError(f"decode produced {produced} tokens, expected {tokens}")
    return elapsed


def run_bench(
    model: str | None,
    engine: str | None,
    prompt_tokens: int,
    decode_tokens: int,
    runs: int,
    concurrency: int,
    kv_dtype: str = "float32",
    *,
    dtype: Dtype = "auto",
) -> dict[str, Any]:
    """``pie bench``: the report as a dict, its ``text`` what the command prints; ``dtype`` is ``--dtype``."""
    if prompt_tokens < 1 or decode_tokens < 1 or runs < 1 or concurrency < 1:
        raise ValueError("prompt tokens, decode tokens, runs and concurrency must all be at least 1")

    def kv_tokens(config: ModelConfig) -> int:
        """Room for every request, once a request past the model's context is refused: checked before a pool that
        large is sized, which past the device's memory was refused for that instead."""
        if prompt_tokens + decode_tokens > config.max_position_embeddings:
            raise ValueError(
                f"--prompt-tokens {prompt_tokens} and --decode-tokens {decode_tokens} make "
                f"{prompt_tokens + decode_tokens} tokens, more than the model's context of "
                f"{config.max_position_embeddings}"
            )
        return max(2048, concurrency * (prompt_tokens + decode_tokens + 16))

    llm = LLM.load(model, engine, max_cached_tokens=kv_tokens, kv_dtype=kv_dtype, dtype=dtype)
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
        "kv_dtype": kv_dtype,
        "dtype": dtype,
    }
    if llm.memory is not None:
        report.update(weight_bytes=llm.memory.weight_bytes, loaded_weight_bytes=llm.memory.loaded_weight_bytes,
                      kv_cache_bytes=llm.memory.kv_bytes, kv_cache_tokens=llm.memory.kv_tokens)
    if concurrency > 1:
        from pie.scheduler.bench import concurrent_bench

        report.update(concurrent_bench(llm, concurrency, prompt_tokens, decode_tokens))
        return report
    decode_seconds(llm, prompt[:8], 4)  # warm-up: first-use compiles and allocations
    prefill = statistics.median(prefill_seconds(llm, prompt) for _ in range(runs))
    bytes_per_token = decode_bytes_per_token(llm, prompt_tokens + decode_tokens // 2)
    read = read_pass(llm.device)
    rates, best_reads, strict_shares, shares, bandwidths = [], [], [], [], []
    for _ in range(runs):
        # The rate: steps back to back, as `pie run` decodes. The stricter share: that run against the faster
        # of the best reads right before and after it. The share: a run of steps paired with passes.
        before = measure_bandwidth(llm.device)
        rates.append(decode_tokens / decode_seconds(llm, prompt, decode_tokens))
        best_reads.append(max(before, measure_bandwidth(llm.device)))
        strict_shares.append(rates[-1] * bytes_per_token / best_reads[-1])
        share, bandwidth = paired_share(*paired_decode(llm, prompt, decode_tokens, read), bytes_per_token)
        shares.append(share)
        bandwidths.append(bandwidth)
    decode_rate, bandwidth = statistics.median(rates), statistics.median(bandwidths)
    roofline = bandwidth / bytes_per_token
    report.update(
        prefill_tokens_per_s=prompt_tokens / prefill,
        decode_tokens_per_s=decode_rate,
        bandwidth_gb_per_s=bandwidth / 1e9,
        best_bandwidth_gb_per_s=statistics.median(best_reads) / 1e9,
        decode_roofline_tokens_per_s=roofline,
        roofline_fraction=statistics.median(shares),
        roofline_fraction_of_best_read=statistics.median(strict_shares),
    )
    memory = f"{llm.memory.describe()}\n" if llm.memory is not None else ""
    report["text"] = (
        f"engine {device.engine} on {device.name}, median of {runs} runs"
        f"{'' if dtype == 'auto' else f', weights loaded as {dtype}'}\n"
        f"numpy BLAS: {blas_kernels()}\n"
        f"{memory}"
        f"prefill  {prompt_tokens} tokens: {report['prefill_tokens_per_s']:8.1f} tok/s\n"
        f"decode   {decode_tokens} tokens: {decode_rate:8.1f} tok/s\n"
        f"memory bandwidth (read): {bandwidth / 1e9:.1f} GB/s (read passes, one after each step of a decode run) "
        f"-> decode roofline {roofline:.1f} tok/s\n"
        f"roofline reached: {100 * report['roofline_fraction']:.0f}% (each run's steps against the passes between "
        f"them; median of the runs); {100 * report['roofline_fraction_of_best_read']:.0f}% against the best reads "
        f"around each run ({report['best_bandwidth_gb_per_s']:.1f} GB/s)"
    )
    return report


def paired_decode(
    llm: LLM, prompt: list[int], tokens: int, read: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """``paired_steps`` of ``tokens`` greedy decode steps after the prompt (the prefill is not timed)."""
    stream = _decode_stream(llm, prompt, tokens)
    try:
        return paired_steps(lambda: next(stream), tokens, read)
    finally:
        stream.close()
