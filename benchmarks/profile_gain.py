"""What a tuned device profile buys end to end, per engine, and what the quick tune costs.

    python benchmarks/profile_gain.py [--engines cpu] [--model NAME] [--budget 150] [--no-tune]
                                      [--save PATH] [--blas-threads N] [--batch 1,2,4] [--runs 6]

For each working engine: runs `pie tune`'s quick mode (timed; the goal is at most 3 minutes),
then loads the model twice on the same device, once with the engine's default variants and
once with the tuned profile, and measures prefill and decode (batch 1, 2 and 4) alternating the two
runners (ABBA, after a warm-up), so drift in the machine's load hits both alike. Reports medians
and best runs, the per-launch cost of the bucket dispatcher next to a direct launcher call, and
the kernel sweep as the tune measured it: per shape bucket, the default variant's time over the
chosen one's (the profile never picks a variant that is not faster with confidence).
`--no-tune` uses the profile that would apply anyway (`pie profile show`). On a shared machine,
`--blas-threads 1` keeps OpenBLAS from stalling on descheduled threads (which can slow small
calls tenfold); tune and runs then both use that setting.
"""

from __future__ import annotations

import pie  # noqa: F401  (first: it sets how long OpenBLAS's idle threads poll, before numpy loads OpenBLAS)

import argparse
import math
import statistics
import tempfile
import time
import timeit
from contextlib import nullcontext
from pathlib import Path

import numpy as np
from pie.model.loader import load_model
from pie.model.store import resolve_model
from pie.plugins import Device, EngineRegistry
from pie.poem.lower import ShapeBuckets, bucketed_launcher
from pie.profiles import ProfileChooser, active_profile, dump_profile
from pie.profiles.cli import describe_choices
from pie.profiles.tuner import Tuner, TuneSettings
from pie.runtime.model_runner import ModelRunner, SequenceWork
from threadpoolctl import threadpool_limits


def tune(device: Device, budget: float, save: Path | None) -> tuple[ProfileChooser, float, str]:
    with tempfile.TemporaryDirectory() as folder:
        tuner = Tuner(device, TuneSettings.quick(budget), Path(folder) / "partial.json")
        started = time.perf_counter()
        profile = tuner.run()
        seconds = time.perf_counter() - started
    cells = f"{len(tuner.results)} of {len(tuner.cells())} cells measured, load average {profile.tune.load_average}"
    if save is not None:
        path = save / f"{profile.name}.toml" if save.is_dir() else save
        path.write_text(dump_profile(profile), encoding="utf-8")
        print(f"wrote {path}")
    print(describe_choices(profile))
    return ProfileChooser(profile), seconds, cells


def prefill_seconds(runner: ModelRunner, tokens: list[int]) -> float:
    sequence = runner.new_sequence()
    try:
        started = time.perf_counter()
        runner.step([SequenceWork(sequence, tokens)])
        return time.perf_counter() - started
    finally:
        sequence.free()


def decode_tokens_per_second(runner: ModelRunner, batch: int, steps: int, prompt: list[int]) -> float:
    sequences = [runner.new_sequence() for _ in range(batch)]
    try:
        runner.step([SequenceWork(s, prompt) for s in sequences])
        next_tokens = [[int(t)] for t in range(batch)]
        started = time.perf_counter()
        for _ in range(steps):
            logits = runner.step([SequenceWork(s, t) for s, t in zip(sequences, next_tokens, strict=True)])
            next_tokens = [[int(np.argmax(row))] for row in logits]
        return batch * steps / (time.perf_counter() - started)
    finally:
        for sequence in sequences:
            sequence.free()


def dispatch_overhead_ns(device: Device) -> tuple[float, float]:
    """A direct launcher call vs the same call through a bucket dispatcher (tiny linear, 1 row)."""
    x, w = device.upload(np.ones((1, 4), np.float32)), device.upload(np.ones((4, 4), np.float32))
    default = device.compile("linear")
    variants = device.kernels()["linear"]
    other = variants[1] if len(variants) > 1 else variants[0]
    launch = bucketed_launcher(
        "linear", ShapeBuckets(((16, 2, other),)), {other: device.compile("linear", other)}, default
    )
    launch(x, w, None)

    def per_call(fn) -> float:
        return statistics.median(timeit.repeat(fn, number=20_000, repeat=7)) / 20_000 * 1e9

    return per_call(lambda: default(x, w, None)), per_call(lambda: launch(x, w, None))


def sweep_summary(profile) -> str:
    """The profile's own measurements over its kernel sweep: chosen variant vs the default per bucket."""
    gains = [(gain, tuning.kernel, bucket) for tuning in profile.kernels for bucket, gain in tuning.speedups()]
    if not gains:
        return "kernel sweep: no bucket timed the default"
    geomean = math.exp(sum(math.log(g) for g, _, _ in gains) / len(gains))
    best, kernel, bucket = max(gains, key=lambda item: item[0])
    return (
        f"kernel sweep ({len(gains)} buckets, the tune's own medians): profile vs defaults geomean {geomean:.2f}x, "
        f"slowest bucket {min(g for g, _, _ in gains):.2f}x, best {best:.2f}x "
        f"({kernel}, size 2^{bucket.size.bit_length() - 1}, {bucket.rows} rows: {bucket.variant})"
    )


def measure(engine: str, args: argparse.Namespace, tensors: list, config) -> None:
    registry = EngineRegistry()
    device = registry.engine(engine).open(0)
    print(f"\n== {engine}: {device.info.name} ({device.info.vendor}, {device.info.architecture})")
    if args.no_tune:
        profile, reason = active_profile(device)
        print(f"profile: {reason}")
        if profile is None:
            return
        chooser = ProfileChooser(profile)
    else:
        chooser, seconds, cells = tune(device, args.budget, args.save)
        print(f"quick tune: {seconds:.1f} s ({cells}; goal <= 180 s)")
    print(f"chooser: {chooser!r}")
    print(sweep_summary(chooser.profile))
    if "linear" in device.kernels():
        direct, dispatched = dispatch_overhead_ns(device)
        print(
            f"launch cost: direct {direct:.0f} ns, through the bucket dispatcher {dispatched:.0f} ns "
            f"(+{dispatched - direct:.0f} ns)"
        )
    runners = {
        "defaults": ModelRunner(config, iter(tensors), device, max_cached_tokens=4096),
        "profile": ModelRunner(config, iter(tensors), device, max_cached_tokens=4096, choose_variant=chooser),
    }
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(0, config.vocab_size, args.prompt)]
    short = prompt[:16]
    metrics = {f"prefill {args.prompt} tok/s": lambda runner: args.prompt / prefill_seconds(runner, prompt)}
    for batch in args.batch:
        metrics[f"decode batch {batch} tok/s"] = lambda runner, b=batch: decode_tokens_per_second(
            runner, b, args.decode, short
        )
    for metric, run in metrics.items():
        for runner in runners.values():
            run(runner)  # warm-up: first launches, page faults
        samples: dict[str, list[float]] = {label: [] for label in runners}
        for index in range(args.runs):
            # ABBA order, so a load change during the run weighs on both alike.
            order = list(runners) if index % 2 == 0 else list(runners)[::-1]
            for label in order:
                samples[label].append(run(runners[label]))
        base, tuned = samples["defaults"], samples["profile"]
        print(
            f"{metric:<24} defaults {statistics.median(base):8.1f} (best {max(base):7.1f})   "
            f"profile {statistics.median(tuned):8.1f} (best {max(tuned):7.1f})   "
            f"median {(statistics.median(tuned) / statistics.median(base) - 1) * 100:+.1f}%"
        )
    for runner in runners.values():
        runner.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engines", help="comma-separated engines (default: every working one)")
    parser.add_argument("--model", default=None, help="model name or path (default: SmolLM2-135M)")
    parser.add_argument("--budget", type=float, default=150.0, help="quick tune budget in seconds")
    parser.add_argument("--no-tune", action="store_true", help="use the profile that applies instead of tuning")
    parser.add_argument("--save", type=Path, help="also write the tuned profile to this file or folder")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=16)
    parser.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--runs", type=int, default=6)
    parser.add_argument(
        "--blas-threads", type=int, help="limit BLAS threads for the tune and the runs (steadier on a shared machine)"
    )
    args = parser.parse_args()
    loaded = load_model(resolve_model(args.model))
    tensors = list(loaded.tensors())
    registry = EngineRegistry()
    engines = args.engines.split(",") if args.engines else [s.name for s in registry.statuses() if s.status == "ok"]
    print(
        f"model: {loaded.source}; runs: {args.runs} (medians); "
        f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}"
    )
    limit = threadpool_limits(args.blas_threads, user_api="blas") if args.blas_threads else nullcontext()
    with limit:
        for engine in engines:
            measure(engine, args, tensors, loaded.config)


if __name__ == "__main__":
    main()
