"""Why `pie bench` pairs each decode step with a read pass: the checks behind the paired roofline share.

    python benchmarks/roofline_pairing.py [--rounds 4] [--blocks 24]

Per round, in one decode at batch 1 (SmolLM2-135M fp32, CPU engine): blocks of 6 steps back to back
(the last 5 timed, each right after a step) alternate with blocks of 5 steps each right after a read pass
(`pie.bench.read_pass`). Prints the median step after a step and after a pass (whether pairing flatters
the steps: it would if steps after a pass ran faster), and the passes' 10th, 50th and 90th percentiles and
best (how far the best read sits above the typical one).
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import statistics
import time

import numpy as np
from pie.bench import read_pass
from pie.runtime.llm import LLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=24)
    args = parser.parse_args()
    llm = LLM.load(None, "cpu")
    read = read_pass(llm.device)
    prompt = [int(t) for t in np.random.default_rng(0).integers(100, 49152, 32)]
    for _ in range(args.rounds):
        stream = llm.generate_tokens(prompt, max_tokens=11 * args.blocks + 1, stop_token_ids=())
        next(stream)  # the first token comes from the prefill
        after_step, after_pass, passes = [], [], []
        for _ in range(args.blocks):
            for index in range(6):
                start = time.perf_counter()
                next(stream)
                if index:
                    after_step.append(time.perf_counter() - start)
            for _ in range(5):
                passes.append(read() / 1e9)
                start = time.perf_counter()
                next(stream)
                after_pass.append(time.perf_counter() - start)
        stream.close()
        step, paired = statistics.median(after_step), statistics.median(after_pass)
        low, middle, high = np.percentile(passes, [10, 50, 90])
        print(
            f"step after a step {1e3 * step:.3f} ms, after a pass {1e3 * paired:.3f} ms ({paired / step:.3f}x); "
            f"passes p10 {low:.1f}, median {middle:.1f}, p90 {high:.1f}, best {max(passes):.1f} GB/s"
        )


if __name__ == "__main__":
    main()
