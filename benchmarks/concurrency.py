"""Concurrent requests through the batch scheduler vs transformers `generate` at batch 8.

    python benchmarks/concurrency.py [--prompt-tokens 32] [--decode-tokens 32] [--concurrency 1,8,32] [--profile]
    python benchmarks/concurrency.py --types Q4_1,F32 [--concurrency 32] [--runs 3]

SmolLM2-135M fp32 (the embedded Q4_1 GGUF dequantized to float32 on load, read by
both sides) on the CPU engine: aggregate decode tokens/s at 1, 8 and 32 (or
`--concurrency`) concurrent greedy requests, then transformers at batch 8 on the same weights.
Decode rates exclude prefill on both sides: pie counts the tokens made while
every request decodes (from the last first-token to the first request's last
token; see `pie.scheduler.bench.steady_decode_rate`); transformers times
`generate` for N+1 tokens minus `generate` for 1.
`--profile` runs the 32-request case again under pyinstrument and prints
where the time went.

`--types` instead runs the scheduler on each weight type of the default model kept as stored (the shipped
Q4_1 file, the others written from it by llama.cpp's quantizer as `decode_anchors.py --types` writes them;
that needs llama-cpp-python), the types in turn in each of `--runs` rounds, and prints each type's median
decode rate and its ratio to the last type's (issue 27's goal: Q4_1 at batch 32 at least as fast as F32).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import time
from collections import defaultdict

import numpy as np
from pie.blas import blas_kernels
from pie.model.store import resolve_model
from pie.runtime.llm import LLM
from pie.scheduler.bench import concurrent_bench

CONCURRENCY = "1,8,32"


def transformers_batch(model, prompts: list[list[int]], tokens: int) -> dict[str, float]:
    import torch

    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)

    def timed(new_tokens: int) -> float:
        start = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        return time.perf_counter() - start

    with torch.no_grad():
        timed(2)  # warm-up
        total = timed(tokens + 1)
        prefill = timed(1)
    batch = len(prompts)
    return {
        "decode_tokens_per_s": batch * tokens / (total - prefill),
        "output_tokens_per_s": batch * (tokens + 1) / total,
    }


def _in_engine(frame) -> bool:
    return "pie_engine_cpu" in (frame.file_path or "")


def profile_summary(llm: LLM, prompt_tokens: int, decode_tokens: int) -> str:
    from pyinstrument import Profiler

    profiler = Profiler(interval=0.001)
    profiler.start()
    concurrent_bench(llm, 32, prompt_tokens, decode_tokens)
    profiler.stop()
    root = profiler.last_session.root_frame()
    total = root.time
    kernels: dict[str, float] = defaultdict(float)
    inclusive: dict[str, float] = defaultdict(float)
    stack = [root]
    while stack:
        frame = stack.pop()
        stack.extend(frame.children)
        name = f"{frame.class_name + '.' if frame.class_name else ''}{frame.function}"
        # The outermost frame inside the engine is the kernel, whatever wrappers launched it.
        if _in_engine(frame) and (frame.parent is None or not _in_engine(frame.parent)):
            kernels[frame.function] += frame.time
        if name in ("Plan.run", "BatchScheduler.step", "ModelRunner.forward", "Sampler.sample", "ModelRunner.prepare"):
            inclusive[name] += frame.time
    lines = [f"profile of 32 concurrent requests ({total:.2f} s sampled)"]
    for name, seconds in sorted(inclusive.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {name:<28} {seconds:7.2f} s  {100 * seconds / total:5.1f}%")
    lines.append("  CPU engine kernels:")
    for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {name:<26} {seconds:7.2f} s  {100 * seconds / total:5.1f}%")
    scheduling = inclusive["BatchScheduler.step"] - inclusive["ModelRunner.forward"]
    lines.append(f"  scheduler bookkeeping (step minus forward): {scheduling:.2f} s ({100 * scheduling / total:.1f}%)")
    return "\n".join(lines)


def compare_types(types: list[str], concurrencies: list[int], prompt_tokens: int, decode_tokens: int,
                  runs: int) -> None:
    """The scheduler's decode rate per weight type and concurrency, the types alternating (the module's docstring)."""
    import tempfile
    from pathlib import Path

    from decode_anchors import SETTLE_SECONDS, write_type

    source = resolve_model(None)
    scratch = tempfile.TemporaryDirectory()
    cached = max(concurrencies) * (prompt_tokens + decode_tokens + 16)
    llms = {}
    for weight_type in types:
        path = source if weight_type == "Q4_1" else write_type(source, Path(scratch.name), weight_type)
        llms[weight_type] = LLM.load(str(path), "cpu", max_cached_tokens=cached)
        concurrent_bench(llms[weight_type], min(concurrencies), prompt_tokens, 4)  # warm-up
    rates: dict[tuple[str, int], list[float]] = defaultdict(list)
    for run in range(runs):
        for concurrency in concurrencies:
            for weight_type in types if run % 2 == 0 else types[::-1]:
                time.sleep(SETTLE_SECONDS)
                report = concurrent_bench(llms[weight_type], concurrency, prompt_tokens, decode_tokens)
                rates[(weight_type, concurrency)].append(report["decode_tokens_per_s"])
                print(f"run {run + 1} {weight_type} x{concurrency}: {report['decode_tokens_per_s']:.1f} decode tok/s",
                      flush=True)
    base = types[-1]
    print(f"SmolLM2-135M through the scheduler, {prompt_tokens} prompt + {decode_tokens} decode tokens per request, "
          f"median of {runs} runs")
    for concurrency in concurrencies:
        base_rate = statistics.median(rates[(base, concurrency)])
        for weight_type in types:
            rate = statistics.median(rates[(weight_type, concurrency)])
            print(f"  {weight_type:<7} x{concurrency:<3} {rate:8.1f} decode tok/s  ({rate / base_rate:.2f}x {base})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default=CONCURRENCY, help="comma-separated request counts")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--types", help="weight types to run the scheduler on, e.g. Q4_1,F32 (ratios to the last)")
    parser.add_argument("--runs", type=int, default=3, help="with --types: rounds, the types alternating")
    args = parser.parse_args()
    concurrencies = [int(count) for count in args.concurrency.split(",")]
    if args.types:
        from decode_anchors import LLAMA_FTYPES

        types = args.types.split(",")
        unknown = [t for t in types if t not in LLAMA_FTYPES]
        if unknown:
            parser.error(f"--types: unknown weight type {', '.join(unknown)}; known: {', '.join(LLAMA_FTYPES)}")
        if any(t != "Q4_1" for t in types):
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                parser.error("--types writes its files with llama.cpp's quantizer: install llama-cpp-python")
        compare_types(types, concurrencies, args.prompt_tokens, args.decode_tokens, args.runs)
        return

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    cached = max(concurrencies) * (args.prompt_tokens + args.decode_tokens + 16)
    llm = LLM.load(None, "cpu", max_cached_tokens=cached, dtype="float32")  # as transformers reads them
    print(f"SmolLM2-135M fp32, {args.prompt_tokens} prompt + {args.decode_tokens} decode tokens per request, greedy")
    print(f"pie's numpy BLAS: {blas_kernels()}")
    rates = {}
    for concurrency in concurrencies:
        report = concurrent_bench(llm, concurrency, args.prompt_tokens, args.decode_tokens)
        rates[concurrency] = report["decode_tokens_per_s"]
        print(f"pie cpu engine: {report['text']}")

    path = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, llm.runner.config.vocab_size, args.prompt_tokens).tolist() for _ in range(8)]
    hf = transformers_batch(model, prompts, args.decode_tokens)
    print(
        f"transformers generate, batch 8: {hf['decode_tokens_per_s']:.1f} decode tok/s "
        f"({hf['output_tokens_per_s']:.1f} tok/s with prefill)"
    )
    most = max(concurrencies)
    print(f"pie at {most} concurrent / transformers at batch 8 = {rates[most] / hf['decode_tokens_per_s']:.2f}x")
    if args.profile:
        print(profile_summary(llm, args.prompt_tokens, args.decode_tokens))


if __name__ == "__main__":
    main()
