"""SmolLM2-135M fp32, one prompt: pie's CPU engine prefill next to transformers and llama.cpp, same run.

    python benchmarks/prefill_anchors.py [--prompt-tokens 128,512] [--runs 5]
    python benchmarks/prefill_anchors.py --types F32,F16,Q8_0,Q4_1,Q4_K_M [--runs 5]

The time from a prompt to its first token's logits, each side set up as in `decode_anchors.py` (the
embedded Q4_1 GGUF dequantized to float32; llama.cpp on an F32 GGUF its own quantizer writes, 2 threads,
the whole prompt in one batch; pie in the 512-token passes of `pie run` and the scheduler). pie and
llama.cpp run back to back in each round and the ratio is the median of the rounds' ratios;
transformers is one forward pass over the prompt.

With ``--types``, pie and llama.cpp instead prefill each weight type of the same model, both reading one file
per type, written as ``decode_anchors.py --types`` writes them (llama.cpp's quantizer, from the shipped Q4_1
file); each round runs every type and length, pie and llama.cpp back to back (ABBA, then BAAB).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from decode_anchors import LLAMA_FTYPES, LLAMA_THREADS, SETTLE_SECONDS, llama_cpp_f32, write_type
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


def compare_types(types: list[str], lengths: list[int], runs: int) -> None:
    """pie and llama.cpp prefill on each weight type of the default model, same run (the module's docstring)."""
    import llama_cpp

    source = resolve_model(None)
    scratch = tempfile.TemporaryDirectory()
    context = max(512, max(lengths))
    rng = np.random.default_rng(0)
    prompts = {length: [int(t) for t in rng.integers(100, 49152, length)] for length in lengths}
    pies, llamas = {}, {}
    for weight_type in types:
        path = source if weight_type == "Q4_1" else write_type(source, Path(scratch.name), weight_type)
        pies[weight_type] = LLM.load(str(path), "cpu", max_cached_tokens=max(lengths) + 64)
        llamas[weight_type] = llama_cpp.Llama(
            str(path), n_ctx=context, n_batch=context, n_threads=LLAMA_THREADS, n_threads_batch=LLAMA_THREADS,
            verbose=False,
        )
        for prompt in prompts.values():  # warm both
            pie_prefill(pies[weight_type], prompt)
            llama_cpp_prefill(llamas[weight_type], prompt)
        print(f"{weight_type}: {path.name} loaded", flush=True)
    rates: dict[tuple[str, int, str], list[float]] = {}
    ratios: dict[tuple[str, int], list[float]] = {}
    for run in range(runs):
        order = ("pie", "llama", "llama", "pie") if run % 2 == 0 else ("llama", "pie", "pie", "llama")
        for weight_type in types:
            for length, prompt in prompts.items():
                got: dict[str, list[float]] = {"pie": [], "llama": []}
                for who in order:
                    time.sleep(SETTLE_SECONDS)
                    if who == "pie":
                        got[who].append(pie_prefill(pies[weight_type], prompt))
                    else:
                        got[who].append(llama_cpp_prefill(llamas[weight_type], prompt))
                for who, values in got.items():
                    rates.setdefault((weight_type, length, who), []).append(statistics.mean(values))
                ratios.setdefault((weight_type, length), []).append(statistics.mean(got["pie"]) / statistics.mean(got["llama"]))
        print(f"run {run + 1} done", flush=True)
    print(f"SmolLM2-135M, prefill of one prompt, median of {runs} runs; pie's native activations: "
          f"{os.environ.get('PIE_CPU_ACTIVATIONS', 'default')}")
    print(f"{'weights':<8} {'tokens':>6} {'pie tok/s':>10} {'llama.cpp':>10} {'pie/llama.cpp':>14}")
    for weight_type in types:
        for length in lengths:
            pie_rate = statistics.median(rates[(weight_type, length, "pie")])
            llama_rate = statistics.median(rates[(weight_type, length, "llama")])
            runs_text = ", ".join(f"{r:.2f}" for r in ratios[(weight_type, length)])
            print(f"{weight_type:<8} {length:6d} {pie_rate:10.1f} {llama_rate:10.1f} "
                  f"{statistics.median(ratios[(weight_type, length)]):13.2f}x  (runs: {runs_text})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", default="128,512", help="comma-separated prompt lengths")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--types", help="weight types to compare pie and llama.cpp on, e.g. F32,F16,Q8_0,Q4_1,Q4_K_M")
    args = parser.parse_args()
    lengths = [int(n) for n in args.prompt_tokens.split(",")]
    if args.types:
        types = args.types.split(",")
        unknown = [t for t in types if t not in LLAMA_FTYPES]
        if unknown:
            parser.error(f"--types: unknown weight type {', '.join(unknown)}; known: {', '.join(LLAMA_FTYPES)}")
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            parser.error("--types compares with llama.cpp: install llama-cpp-python (pip install llama-cpp-python)")
        compare_types(types, lengths, args.runs)
        return

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = resolve_model(None)
    llm = LLM.load(None, "cpu", max_cached_tokens=max(lengths) + 64, dtype="float32")  # as the peers read them
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
