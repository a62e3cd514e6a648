"""SmolLM2-135M fp32, batch 1: pie's CPU engine next to transformers and llama.cpp on the same weights, same run.

    python benchmarks/decode_anchors.py [--decode-tokens 64] [--runs 5]
    python benchmarks/decode_anchors.py --types F32,F16,Q8_0,Q4_1,Q4_K_M [--runs 5]

With ``--types``, pie and llama.cpp instead decode each weight type of the same model, both reading one
file per type: the shipped Q4_1 file itself, the others written from it by llama.cpp's own quantizer (Q4_K_M
mixes Q4_K and Q6_K, and Q5_0 and Q8_0 where SmolLM2's 576-wide rows are not whole K-quant super-blocks); pie
keeps each weight in its stored type where its kernels take it (``docs/weight-types.md``). Each round
runs every type, pie and llama.cpp back to back (ABBA, then BAAB); the ratio per type is the median of
the rounds' ratios. Without llama-cpp-python it measures pie alone.

All read the embedded default model (the Q4_1 GGUF, dequantized to float32 on load;
llama.cpp gets an F32 GGUF that its own quantizer writes from the same file).
Prints the median decode tokens/s of each, the ratios, and pie's and llama.cpp's shares of the
bandwidth roofline measured in the same run: a run of decode steps against read passes run between
them (`pie.bench.paired_share`), and each run against the best reads around it. pie and llama.cpp run back
to back in each round (ABBA, then BAAB) and the ratio is the median of the rounds' ratios. llama.cpp is measured when
`llama-cpp-python` is installed (`pip install llama-cpp-python`: it builds
llama.cpp from source, about 12 minutes here); otherwise the script says so.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import contextlib
import ctypes
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from pie.bench import (
    decode_bytes_per_token,
    decode_seconds,
    measure_bandwidth,
    paired_decode,
    paired_share,
    paired_steps,
    read_pass,
)
from pie.blas import blas_kernels
from pie.model.store import resolve_model
from pie.weights import describe_choices
from pie.runtime.llm import LLM


SETTLE_SECONDS = 0.5
"""Pause before each measurement: the previous one's idle threads (torch's OpenMP, llama.cpp's pool,
OpenBLAS, pie's) poll for work a while after it, and would take the cores from the next."""

LLAMA_THREADS = len(os.sched_getaffinity(0))
"""llama.cpp's threads: the CPUs this process may run on, as many as pie's native kernels take (`taskset -c 0`
runs both on one core, where a step is bound by compute rather than memory)."""


def pie_decode(llm: LLM, prompt: list[int], tokens: int) -> float:
    return tokens / decode_seconds(llm, prompt, tokens)


def transformers_decode(model, prompt: list[int], tokens: int) -> float:
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        model.generate(ids, max_new_tokens=1, do_sample=False)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens + 1, min_new_tokens=tokens + 1, do_sample=False)
        total = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
    return tokens / (total - prefill)


@contextlib.contextmanager
def quiet_native_output():
    """Silence what native code writes to stdout/stderr (llama.cpp's quantizer lists every tensor)."""
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "wb") as null:
        os.dup2(null.fileno(), 1)
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


LLAMA_FTYPES = {"F32": "LLAMA_FTYPE_ALL_F32", "F16": "LLAMA_FTYPE_MOSTLY_F16", "BF16": "LLAMA_FTYPE_MOSTLY_BF16",
                "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1",
                "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def write_type(source: Path, directory: Path, weight_type: str) -> Path:
    """``source`` requantized by llama.cpp's quantizer to ``weight_type`` (the file itself where it is that)."""
    import llama_cpp

    target = directory / f"model-{weight_type.lower()}.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_FTYPES[weight_type])
    params.allow_requantize = True
    with quiet_native_output():
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama.cpp could not write a {weight_type} copy of {source}")
    return target


def compare_types(types: list[str], runs: int, decode_tokens: int) -> None:
    """pie and llama.cpp on each weight type of the default model, same run (see the module's docstring)."""
    try:
        import llama_cpp
    except ImportError:
        llama_cpp = None
    source = resolve_model(None)
    scratch = tempfile.TemporaryDirectory()
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 49152, 32)]
    pies, llamas, files = {}, {}, {}
    for weight_type in types:
        shipped = weight_type == "Q4_1"
        files[weight_type] = source if shipped or llama_cpp is None else write_type(source, Path(scratch.name), weight_type)
        pies[weight_type] = LLM.load(str(files[weight_type]), "cpu")
        weights = describe_choices(pies[weight_type].runner.weight_choices).splitlines()[0]
        print(f"{weight_type}: {files[weight_type].name} loaded; {weights}", flush=True)
        pie_decode(pies[weight_type], prompt, 8)
        if llama_cpp is not None:
            llamas[weight_type] = llama_cpp.Llama(
                str(files[weight_type]), n_ctx=512, n_batch=512, n_threads=LLAMA_THREADS,
                n_threads_batch=LLAMA_THREADS, verbose=False,
            )
            llama_cpp_decode(llamas[weight_type], prompt, 8)
    rates: dict[tuple[str, str], list[float]] = {}
    ratios: dict[str, list[float]] = {t: [] for t in types}
    for run in range(runs):
        for weight_type in types:
            order = ("pie", "llama", "llama", "pie") if run % 2 == 0 else ("llama", "pie", "pie", "llama")
            got: dict[str, list[float]] = {"pie": [], "llama": []}
            for who in order if llamas else ("pie", "pie"):
                time.sleep(SETTLE_SECONDS)
                if who == "pie":
                    got[who].append(pie_decode(pies[weight_type], prompt, decode_tokens))
                else:
                    got[who].append(llama_cpp_decode(llamas[weight_type], prompt, decode_tokens))
            for who, values in got.items():
                if values:
                    rates.setdefault((weight_type, who), []).append(statistics.mean(values))
            if got["llama"]:
                ratios[weight_type].append(statistics.mean(got["pie"]) / statistics.mean(got["llama"]))
            shown = ", ".join(f"{who} {statistics.mean(v):.1f}" for who, v in got.items() if v)
            print(f"run {run + 1} {weight_type}: {shown} tok/s", flush=True)
    print(f"SmolLM2-135M, batch 1, {decode_tokens} decode tokens, median of {runs} runs; pie's native activations: "
          f"{os.environ.get('PIE_CPU_ACTIVATIONS', 'default')}")
    print(f"{'weights':<8} {'file MB':>8} {'pie tok/s':>10} {'llama.cpp':>10} {'pie/llama.cpp':>14}")
    for weight_type in types:
        size = files[weight_type].stat().st_size / 1e6
        pie_rate = statistics.median(rates[(weight_type, "pie")])
        if ratios[weight_type]:
            llama_rate = statistics.median(rates[(weight_type, "llama")])
            runs_text = ", ".join(f"{r:.2f}" for r in ratios[weight_type])
            print(f"{weight_type:<8} {size:8.1f} {pie_rate:10.1f} {llama_rate:10.1f} "
                  f"{statistics.median(ratios[weight_type]):13.2f}x  (runs: {runs_text})")
        else:
            print(f"{weight_type:<8} {size:8.1f} {pie_rate:10.1f} {'-':>10} {'-':>14}")


def llama_cpp_f32(source: Path, directory: Path, n_ctx: int = 512):
    """A llama.cpp model of ``source`` requantized to F32 (2 threads, ``n_ctx`` tokens of context, the
    whole of them in one batch), or None without llama-cpp-python."""
    try:
        import llama_cpp
    except ImportError:
        return None
    target = directory / "model-f32.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    with quiet_native_output():
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if failed:
        raise RuntimeError(f"llama.cpp could not write an F32 copy of {source}")
    return llama_cpp.Llama(
        str(target), n_ctx=n_ctx, n_batch=n_ctx, n_threads=LLAMA_THREADS, n_threads_batch=LLAMA_THREADS, verbose=False
    )


def llama_cpp_decode(model, prompt: list[int], tokens: int) -> float:
    """Greedy decode through llama.cpp one token per call, prefill untimed."""
    model.reset()
    model.eval(prompt)
    start = time.perf_counter()
    for _ in range(tokens):
        llama_cpp_step(model)
    return tokens / (time.perf_counter() - start)


def llama_cpp_step(model) -> None:
    model.eval([int(np.argmax(model.scores[model.n_tokens - 1]))])


def llama_cpp_paired(model, prompt: list[int], tokens: int, read) -> tuple[list[float], list[float]]:
    """llama.cpp's decode steps, each followed by a read pass (``paired_steps``)."""
    model.reset()
    model.eval(prompt)
    return paired_steps(lambda: llama_cpp_step(model), tokens, read)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--types", help="weight types to compare pie and llama.cpp on, e.g. F32,F16,Q8_0,Q4_1")
    args = parser.parse_args()
    if args.types:
        types = args.types.split(",")
        unknown = [t for t in types if t not in LLAMA_FTYPES]
        if unknown:
            parser.error(f"--types: unknown weight type {', '.join(unknown)}; known: {', '.join(LLAMA_FTYPES)}")
        compare_types(types, args.runs, args.decode_tokens)
        return

    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    path = resolve_model(None)
    llm = LLM.load(None, "cpu", dtype="float32")  # the peers read these weights in float32 too
    reference = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, torch_dtype=torch.float32).eval()
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 49152, 32)]
    scratch = tempfile.TemporaryDirectory()
    llama = llama_cpp_f32(path, Path(scratch.name))
    pie_decode(llm, prompt, 8)
    if llama is not None:
        llama_cpp_decode(llama, prompt, 8)
    pie_runs, hf_runs, llama_runs, bandwidths, llama_ratios, hf_ratios = [], [], [], [], [], []
    pie_shares, llama_shares = [], []
    paired: dict[str, list[float]] = {"pie": [], "llama": []}
    bytes_per_token = decode_bytes_per_token(llm, len(prompt) + args.decode_tokens // 2)
    read = read_pass(llm.device)
    for run in range(args.runs):
        # pie and llama.cpp back to back, ABBA then BAAB: the machine's speed moves by tens of percent
        # within seconds, so only adjacent measurements compare. The bandwidth probe runs right before and
        # right after them, and the round is held to the faster read (a round that straddles a change of
        # spell would otherwise read above 100%); then transformers, which takes seconds per run.
        order = ("pie", "llama", "llama", "pie") if run % 2 == 0 else ("llama", "pie", "pie", "llama")
        before = measure_bandwidth(llm.device)
        rates: dict[str, list[float]] = {"pie": [], "llama": []}
        for who in order if llama is not None else ("pie", "pie"):
            time.sleep(SETTLE_SECONDS)
            if who == "pie":
                rates[who].append(pie_decode(llm, prompt, args.decode_tokens))
            else:
                rates[who].append(llama_cpp_decode(llama, prompt, args.decode_tokens))
        pie_rate = statistics.mean(rates["pie"])
        pie_runs.append(pie_rate)
        if rates["llama"]:
            llama_runs.append(statistics.mean(rates["llama"]))
            llama_ratios.append(pie_rate / llama_runs[-1])
        bandwidths.append(max(before, measure_bandwidth(llm.device)))
        roofline = bandwidths[-1] / bytes_per_token
        pie_shares.append(pie_rate / roofline)
        if rates["llama"]:
            llama_shares.append(llama_runs[-1] / roofline)
        # Then each one's steps paired with read passes, in turn.
        for who in ("pie", "llama") if run % 2 == 0 else ("llama", "pie"):
            time.sleep(SETTLE_SECONDS)
            if who == "pie":
                steps = paired_decode(llm, prompt, args.decode_tokens, read)
            elif llama is not None:
                steps = llama_cpp_paired(llama, prompt, args.decode_tokens, read)
            else:
                continue
            paired[who].append(paired_share(*steps, bytes_per_token)[0])
        time.sleep(SETTLE_SECONDS)
        hf_runs.append(transformers_decode(reference, prompt, args.decode_tokens))
        time.sleep(SETTLE_SECONDS)
        hf_ratios.append(pie_decode(llm, prompt, args.decode_tokens) / hf_runs[-1])
    pie_rate, hf_rate = statistics.median(pie_runs), statistics.median(hf_runs)
    bandwidth = statistics.median(bandwidths)
    print(f"SmolLM2-135M fp32, batch 1, {args.decode_tokens} decode tokens, median of {args.runs} runs")
    print(f"pie's numpy BLAS: {blas_kernels()}")
    print(f"pie (cpu engine)       {pie_rate:7.1f} tok/s")
    print(f"transformers (torch)   {hf_rate:7.1f} tok/s   pie / transformers = {statistics.median(hf_ratios):.2f}x")
    if llama_runs:
        llama_rate = statistics.median(llama_runs)
        print(
            f"llama.cpp F32          {llama_rate:7.1f} tok/s   pie / llama.cpp = {statistics.median(llama_ratios):.2f}x "
            f"(runs: {', '.join(f'{r:.2f}' for r in llama_ratios)})"
        )
    else:
        print("llama.cpp              not measured: llama-cpp-python is not installed")
    reached = f"pie {100 * statistics.median(paired['pie']):.0f}%"
    if paired["llama"]:
        reached += f", llama.cpp {100 * statistics.median(paired['llama']):.0f}%"
    strict = f"pie {100 * statistics.median(pie_shares):.0f}%"
    if llama_shares:
        strict += f", llama.cpp {100 * statistics.median(llama_shares):.0f}%"
    print(f"roofline reached, each run's decode steps against read passes between them (median of the runs): {reached}")
    print(
        f"against the best reads around each run ({bandwidth / 1e9:.1f} GB/s, {bandwidth / bytes_per_token:.1f} "
        f"tok/s, medians): {strict} (median of the runs)"
    )


if __name__ == "__main__":
    main()
