"""Concurrent requests through the batch scheduler vs transformers `generate` at batch 8.

    python benchmarks/concurrency.py [--prompt-tokens 32] [--decode-tokens 32] [--concurrency 1,8,32] [--profile]

SmolLM2-135M fp32 (the embedded Q4_1 GGUF dequantized to float32 on load, read by
both sides) on the CPU engine: aggregate decode tokens/s at 1, 8 and 32 (or
`--concurrency`) concurrent greedy requests, then transformers at batch 8 on the same weights.
Decode rates exclude prefill on both sides: pie counts the tokens made while
every request decodes (from the last first-token to the first request's last
token; see `pie.scheduler.bench.steady_decode_rate`); transformers times
`generate` for N+1 tokens minus `generate` for 1.
`--profile` runs the 32-request case again under pyinstrument and prints
where the time went.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--concurrency", default=CONCURRENCY, help="comma-separated request counts")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    concurrencies = [int(count) for count in args.concurrency.split(",")]

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    cached = max(concurrencies) * (args.prompt_tokens + args.decode_tokens + 16)
    llm = LLM.load(None, "cpu", max_cached_tokens=cached)
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
