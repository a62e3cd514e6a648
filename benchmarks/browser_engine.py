"""The WebGPU engine's browser device (Chromium's WebGPU) next to its native one (wgpu-native; lavapipe here).

    python benchmarks/browser_engine.py                      # SmolLM2-135M, batch 1 and 8, 8 timed steps
    python benchmarks/browser_engine.py --steps 4 --batches 1
    python benchmarks/browser_engine.py --browser-adapter swiftshader   # Chromium's SwiftShader instead

Decode tokens/s as ``lavapipe_engines.py`` measures them: after a prompt per sequence, one
warm-up step, then ``--steps`` timed batched decode steps, every run alternating the two
devices (``--runs``), medians printed. For the browser, each step is also split into the time
the page spent on its messages (decoding them, recording, the device running them, reading
back), the transport (the rest of the time the engine waited: the socket both ways, the
hand-offs between threads) and the engine's own Python (recording the commands); with the
bytes each step sent and received. The browser's adapter is ``PIE_WGPU_BROWSER_ADAPTER``'s
(``--browser-adapter``): by default on Linux ``system``, the same Vulkan driver as the native
device, under ANGLE and Dawn's OpenGL ES backend, so the ratio measures the design's overhead
(and that longer path), not two different rasterizers. Both lines name their adapter.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import os
import statistics
import time
from dataclasses import dataclass

import numpy as np
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import Device, EngineRegistry
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie_engine_wgpu.browser import ADAPTER_ENV, ADAPTERS
from pie_engine_wgpu.plugin import WgpuEngine

PROMPT = "The capital of France is"


@dataclass
class Run:
    step_s: float
    page_s: float = 0.0
    record_s: float = 0.0
    exchange_s: float = 0.0
    sent: float = 0.0
    received: float = 0.0


def decode(device: Device, model, tensors, batch: int, steps: int, session=None) -> Run:
    runner = ModelRunner(model.config, tensors, device, page_size=16, max_cached_tokens=64 * batch + 256)
    try:
        prompt = model.tokenizer.encode(PROMPT)
        sequences = [runner.new_sequence() for _ in range(batch)]
        logits = runner.step([SequenceWork(s, prompt) for s in sequences])
        tokens = [int(np.argmax(row)) for row in logits]
        logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])  # warm-up
        counters = ("page_seconds", "record_seconds", "exchange_seconds", "bytes_sent", "bytes_received")
        before = [getattr(session, name) for name in counters] if session else None
        start = time.perf_counter()
        for _ in range(steps):
            tokens = [int(np.argmax(row)) for row in logits]
            logits = runner.step([SequenceWork(s, [t]) for s, t in zip(sequences, tokens, strict=True)])
        run = Run((time.perf_counter() - start) / steps)
        if session is not None and before is not None:
            run.page_s, run.record_s, run.exchange_s, run.sent, run.received = (
                (getattr(session, name) - start_value) / steps for name, start_value in zip(counters, before, strict=True)
            )
        return run
    finally:
        runner.close()


def median(runs: list[Run], field: str) -> float:
    return statistics.median(getattr(r, field) for r in runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--browser-adapter", choices=list(ADAPTERS), default=None, help=f"sets {ADAPTER_ENV}")
    args = parser.parse_args()
    if args.browser_adapter:
        os.environ[ADAPTER_ENV] = args.browser_adapter

    model = load_model(resolve_model(args.model))
    tensors = list(model.tensors())
    config = model.config
    print(f"model {model.source}: {config.num_layers} layers, hidden {config.hidden_size}, vocab {config.vocab_size}")
    native = EngineRegistry().engine("wgpu").open(0)
    browser_engine = WgpuEngine(device="browser")
    registry = EngineRegistry()
    registry.register("wgpu", browser_engine, "pie-engine-wgpu")
    browser = registry.engine("wgpu").open(0)
    backend = browser_engine.backend(browser.info)
    session = backend.session
    print(f"native : {native.info.name}, {native.info.driver} (wgpu-native, {dict(native.info.extra)['backend']})")
    print(f"browser: {browser.info.name}")  # the name the started page gave: the adapter it got
    try:
        for batch in (int(b) for b in args.batches.split(",")):
            natives, browsers = [], []
            for _ in range(args.runs):
                natives.append(decode(native, model, tensors, batch, args.steps))
                browsers.append(decode(browser, model, tensors, batch, args.steps, session))
            step_native, step_browser = median(natives, "step_s"), median(browsers, "step_s")
            page, record, exchange = (median(browsers, f) for f in ("page_s", "record_s", "exchange_s"))
            transport = max(exchange - page, 0.0)
            print(
                f"batch {batch}: native {batch / step_native:6.2f} tok/s ({step_native * 1e3:7.1f} ms/step)   "
                f"browser {batch / step_browser:6.2f} tok/s ({step_browser * 1e3:7.1f} ms/step)   "
                f"browser/native step {step_browser / step_native:.2f}x",
                flush=True,
            )
            print(
                f"  browser step: page {page * 1e3:.1f} ms (of it recording {record * 1e3:.1f} ms), transport {transport * 1e3:.2f} ms "
                f"({transport / step_browser:.1%} of the step), engine Python {(step_browser - exchange) * 1e3:.1f} ms; "
                f"{median(browsers, 'sent') / 1024:.0f} KiB out, {median(browsers, 'received') / 1024:.0f} KiB back a step",
                flush=True,
            )
    finally:
        browser_engine.close(browser.info)


if __name__ == "__main__":
    main()
