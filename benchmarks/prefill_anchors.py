"""SmolLM2-135M fp32, one prompt: pie's CPU engine prefill next to transformers and llama.cpp, same run.

    python benchmarks/prefill_anchors.py [--prompt-tokens 128,512] [--runs 5]

The time from a prompt to its first token's logits, each side set up as in `decode_anchors.py` (the
embedded Q4_1 GGUF dequantized to float32; llama.cpp on an F32 GGUF its own quantizer writes, 2 threads,
the whole prompt in one batch; pie in the 512-token passes of `pie run` and the scheduler). pie and
llama.cpp run back to back in each round and the ratio is the median of the rounds' ratios;
transformers is one forward pass over the prompt.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from decode_anchors import SETTLE_SECONDS, llama_cpp_f32
from pie.bench import prefill_seconds
from pie.blas import blas_kernels
from pie.model.store import resolve_model
from pie.runtime.llm import LLM


def pie_prefill(llm: LLM, prompt: list[int]) -> float:
    return len(prompt) / prefill_seconds(llm, prompt)


def llama_cpp_prefill(model, prompt: list[int]) -> float:
    model.reset()
    start = time.perf_counter()
    model.eval(prompt)
    return len(prompt) / (time.perf_counter() - start)


def transformers_prefill(model, prompt: list[int]) -> float:
    import torch

    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids)
        return len(prompt) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", default="128,512", help="comma-separated prompt lengths")
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = resolve_model(None)
    llm = LLM.load(None, "cpu", max_cached_tokens=max(lengths) + 64)
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    scratch = tempfile.TemporaryDirectory()
    llama = llama_cpp_f32(path, Path(scratch.name), n_ctx=max(512, max(lengths)))
    rng = np.random.default_rng(0)
    print(f"SmolLM2-135M fp32, prefill of one prompt, median of {args.runs} runs")
    print(f"pie's numpy BLAS: {blas_kernels()}")
    for length in lengths:
        prompt = [int(t) for t in rng.integers(100, 49152, length)]
        pie_prefill(llm, prompt)
        transformers_prefill(reference, prompt)
        if llama is not None:
            llama_cpp_prefill(llama, prompt)
        pie_runs, hf_runs, llama_runs, llama_ratios = [], [], [], []
        for run in range(args.runs):
            order = ("pie", "llama") if run % 2 == 0 else ("llama", "pie")
            rates = {}
            for who in order if llama is not None else ("pie",):
                time.sleep(SETTLE_SECONDS)
                rates[who] = pie_prefill(llm, prompt) if who == "pie" else llama_cpp_prefill(llama, prompt)
            pie_runs.append(rates["pie"])
            if "llama" in rates:
                llama_runs.append(rates["llama"])
                llama_ratios.append(rates["pie"] / rates["llama"])
            time.sleep(SETTLE_SECONDS)
            hf_runs.append(transformers_prefill(reference, prompt))
        pie_rate, hf_rate = statistics.median(pie_runs), statistics.median(hf_runs)
        line = f"{length:5d} tokens: pie {pie_rate:7.1f} tok/s, transformers {hf_rate:7.1f} ({pie_rate / hf_rate:.2f}x)"
        if llama_runs:
            line += f", llama.cpp F32 {statistics.median(llama_runs):7.1f} ({statistics.median(llama_ratios):.2f}x)"
        else:
            line += ", llama.cpp not measured: llama-cpp-python is not installed"
        print(line)


if __name__ == "__main__":
    main()
