"""`pie tune`: time every variant of every kernel with more than one, per shape bucket, and keep the winners.

Each *cell* is one kernel site (see :mod:`pie.profiles.workloads`) at one
power-of-two row count. Its variants are launched round-robin after a warm-up,
so drift in the machine's load hits them alike, and a variant other than the
engine's default is chosen only when its upper quantile lies below the
default's lower quantile by a margin: a profile never makes a shape slower.

Every finished cell is written at once to a partial file beside the profile;
a run that is interrupted resumes from it and measures only what is missing.
"""

from __future__ import annotations

import json
import os
import platform
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from pie import __version__ as core_version
from pie.files import read_regular_file, write_atomically
from pie.plugins import Device, EngineError, lost_device, what_raised
from pie.profiles.loader import parse_profile
from pie.profiles.schema import Bucket, DeviceMeta, KernelTuning, Profile, ProfileError, Timing, TuneMeta
from pie.profiles.workloads import REFERENCE_DIMS, Dims, Site, launch_inputs, sites
from pie.profiles.writer import dump_profile

PARTIAL_FORMAT = 1
MAX_PARTIAL_BYTES = 64 << 20
"""The largest partial file read back; a bigger one is refused as damaged."""
QUANTILES = (0.2, 0.5, 0.8)
MAX_SPREAD = 2.0
"""A variant is chosen over the default only where both measured steadily: upper quantile at most
this many times the lower one. A machine whose load comes and goes (BLAS threads descheduled
mid-call) gives bimodal timings; those cells keep the default."""
STREAMED_BYTES = 128 * 2**20
"""A kernel's weight is launched from enough copies to total this much (at most MAX_WEIGHT_COPIES),
one after another, so each launch reads its weight from memory, as a forward pass does, and not
from a cache that holds one small weight (measured here: a cache-resident 576x576 GEMV ranks the
CPU engine's variants the other way round)."""
MAX_WEIGHT_COPIES = 64
BURST = 4
"""Launches of one variant in a row (each on the next weight copy), as a forward pass launches it
layer after layer, timed as a whole after SETTLE_NS of untimed launches: one synchronize at the
burst's end, so a sample is what a launch costs among others queued behind it, the larger of the
host's launch cost and the device's run time rather than their sum. Timed one launch and one
synchronize at a time, a GPU's quick tune chose a two-launch attention variant for small decode
batches whose device time was shorter, and those decodes ran slower with it."""
SETTLE_NS = 2_000_000
"""Untimed launches that open each variant's turn, long enough for another variant's idle threads
(OpenBLAS polls 2^18 cycles once pie has set ``OPENBLAS_THREAD_TIMEOUT``) to stop polling."""
PRUNE_FROM_ROWS = 8
"""Pruning reads the trend from this many rows up. Below it launch costs (GEMM packing, thread
start) dominate and move unlike the work: on the CPU engine BLAS loses to the native kernels by a
growing factor from 1 to 2 rows and wins again from 16."""
PRUNE_FACTOR = 1.25
"""A variant slower than the default by this factor (with confidence) at two growing row counts
in a row, and losing ground as rows grow, is not timed at larger row counts of that site."""


@dataclass(frozen=True)
class TuneSettings:
    mode: str
    budget_s: float | None
    max_rows: int
    warmup: int
    repeats: int
    min_repeats: int
    margin: float
    work_limit: int
    """Skip cells whose rows x static size exceeds this (bounds one launch's cost)."""
    grid: bool

    @classmethod
    def quick(cls, budget_s: float | None = 150.0) -> TuneSettings:
        return cls("quick", budget_s, 256, 2, 9, 3, 0.03, 1 << 28, grid=False)

    @classmethod
    def full(cls, budget_s: float | None = None) -> TuneSettings:
        return cls("full", budget_s, 4096, 3, 21, 5, 0.03, 1 << 32, grid=True)


@dataclass(frozen=True)
class Cell:
    site: Site
    rows: int

    @property
    def key(self) -> str:
        return f"{self.site.kernel}/{self.site.label}/{self.rows}"

    def describe(self) -> str:
        return f"{self.site.kernel} {self.site.label} x{self.rows} rows"


@dataclass
class CellResult:
    samples_ns: dict[str, list[int]]

    def timing(self, variant: str) -> Timing:
        low, median, high = np.quantile(np.asarray(self.samples_ns[variant], dtype=np.float64) / 1e3, QUANTILES)
        return Timing(round(float(low), 3), round(float(median), 3), round(float(high), 3))


class PartialFileError(ValueError):
    """The partial file of an interrupted run is there but cannot be resumed from (what is wrong in the message)."""


class PartialOfAnotherTuneError(PartialFileError):
    """The partial file holds an interrupted tune of another mode or model on this engine build and device, which
    a tune of that mode and model would resume: measuring over it would lose its measurements."""


ProgressFn = Callable[[str, int, int, float | None], None]
"""Called before each cell: (what is measured, cells done, cells in all, seconds of budget left)."""


class Tuner:
    """Measures one device. ``clock`` (nanoseconds) is injectable so tests can time fake kernels."""

    def __init__(
        self,
        device: Device,
        settings: TuneSettings,
        partial_path: Path,
        dims: Dims = REFERENCE_DIMS,
        *,
        clock: Callable[[], int] = time.perf_counter_ns,
        seed: int = 0,
    ):
        self.device = device
        self.settings = settings
        self.partial_path = Path(partial_path)
        self.dims = dims
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.results: dict[str, CellResult] = {}
        self.resumed = 0
        self.kept = 0
        """Cells the partial file holds: those measured before a save that an interrupt cut short are not."""
        self.seconds_before = 0.0
        self.budget_exhausted = False
        self.left_out: dict[str, str] = {}
        """``kernel[variant]`` -> why that variant (not a default) is not measured: it failed to compile or launch."""
        self._tunable: dict[str, tuple[str, ...]] | None = None
        self.load_average: float | None = None

    # -- what to measure ------------------------------------------------------

    def tunable(self) -> dict[str, tuple[str, ...]]:
        """Kernels with more than one variant on this device (only those have anything to choose).

        Quick mode keeps those a plan of the workload's model launches; a full sweep takes all,
        the launched ones first.
        """
        if self._tunable is None:
            every = {name: variants for name, variants in self.device.kernels().items() if len(variants) > 1}
            launched = self._launched()
            first = {name: every[name] for name in launched if name in every}
            rest = (
                {} if self.settings.mode == "quick" and launched else {n: v for n, v in every.items() if n not in first}
            )
            self._tunable = {**first, **rest}
        return self._tunable

    def _launched(self) -> list[str]:
        """Kernels the plan of the workload's model launches on this device (empty if it cannot be lowered)."""
        from pie.poem import build_decoder_graph, lower

        try:
            plan = lower(build_decoder_graph(self.dims.config()), self.device)
        except (EngineError, ValueError, KeyError):
            return []
        return list(dict.fromkeys(step.kernel for step in plan.steps if not step.whole_region))

    def cells(self) -> list[Cell]:
        """Every cell, small row counts first across all sites: cheap and most often decisive."""
        tunable = self.tunable()
        chosen = [s for s in sites(self.dims, self.settings.grid) if s.kernel in tunable]
        found: list[Cell] = []
        rows = 1
        while rows <= self.settings.max_rows:
            for site in chosen:
                if rows <= site.max_rows and rows * max(site.size, 1) <= self.settings.work_limit:
                    found.append(Cell(site, rows))
            rows *= 2
        return found

    # -- the partial file -------------------------------------------------------

    def _run_key(self) -> dict[str, Any]:
        info = self.device.info
        return {
            "engine": self.device.name,
            "engine_version": self.device.engine.version,
            "device": [info.vendor, info.name, info.architecture, info.driver],
            "dims": asdict(self.dims),
            "settings": {k: v for k, v in asdict(self.settings).items() if k != "budget_s"},
        }

    def load_partial(self) -> bool:
        """Take up the cells of an earlier interrupted run of the same measurement, if any.

        False when there is no partial file or it is of another engine build or device (it can never be
        resumed here). PartialOfAnotherTuneError where it is of another mode or model on this one, and a
        damaged one raises PartialFileError, both before anything is measured: what it holds is checked by
        making the profile it would give, as the run's end does.
        """
        try:
            data = json.loads(read_regular_file(self.partial_path, MAX_PARTIAL_BYTES))
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise PartialFileError(f"{self.partial_path}: cannot be read ({reason})") from exc
        if not isinstance(data, dict) or data.get("format") != PARTIAL_FORMAT:
            raise PartialFileError(f"{self.partial_path}: not a partial file of format {PARTIAL_FORMAT}")
        key, mine = data.get("key"), self._run_key()
        if key != mine:
            if isinstance(key, dict) and all(key.get(k) == mine[k] for k in ("engine", "engine_version", "device")):
                cells = data.get("cells")
                raise PartialOfAnotherTuneError(
                    f"{self.partial_path} holds {len(cells) if isinstance(cells, dict) else 'the'} measurement(s) of "
                    f"an interrupted {_tune_words(key)}, not of this {_tune_words(mine)}")
            return False
        try:
            results = {
                str(key): CellResult({str(variant): [int(t) for t in times] for variant, times in samples.items()})
                for key, samples in data["cells"].items()
            }
            seconds = float(data["seconds"])
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PartialFileError(f"{self.partial_path}: damaged ({type(exc).__name__}: {exc})") from exc
        usable = {key: result for key, result in results.items() if all(result.samples_ns.values())}
        self.results.update(usable)
        try:
            parse_profile(dump_profile(self.profile(seconds)))
        except ProfileError as exc:
            self.results.clear()
            raise PartialFileError(f"{self.partial_path}: its measurements make no valid profile ({exc.message})") from exc
        self.resumed = self.kept = len(self.results)
        self.seconds_before = seconds
        return True

    def _save_partial(self, seconds: float) -> None:
        data = {
            "format": PARTIAL_FORMAT,
            "key": self._run_key(),
            "seconds": seconds,
            "cells": {key: result.samples_ns for key, result in self.results.items()},
        }
        write_atomically(self.partial_path, json.dumps(data))
        self.kept = len(self.results)

    # -- measuring ------------------------------------------------------------------

    def run(self, progress: ProgressFn | None = None) -> Profile:
        """Measure every missing cell (within the budget) and return the profile.

        An exception (KeyboardInterrupt included) leaves the partial file holding every finished cell.
        """
        start = self.clock()
        self.load_average = load_average()
        budget = self.settings.budget_s
        deadline = None if budget is None else start + int(budget * 1e9)
        cells = self.cells()
        todo = [cell for cell in cells if cell.key not in self.results]
        done = len(cells) - len(todo)
        reached = done
        for index, cell in enumerate(todo):
            now = self.clock()
            left = None if deadline is None else (deadline - now) / 1e9
            if left is not None and left <= 0:
                self.budget_exhausted = True
                break
            if progress is not None:
                progress(cell.describe(), done + index, len(cells), left)
            variants = self._variants_for(cell)
            if variants is None:
                reached = done + index + 1
                continue
            cap_ns = None if left is None else max(0.2e9, left * 1e9 / (len(todo) - index))
            result = self._measure(cell, variants, cap_ns, deadline)
            if result is None:
                self.budget_exhausted = True
                break
            reached = done + index + 1
            self.results[cell.key] = result
            self._save_partial(self.seconds_before + (self.clock() - start) / 1e9)
        if progress is not None:
            progress("budget spent" if self.budget_exhausted else "done", reached, len(cells), None)
        seconds = self.seconds_before + (self.clock() - start) / 1e9
        return self.profile(seconds)

    def _variants_for(self, cell: Cell) -> tuple[str, ...] | None:
        """The variants worth timing in ``cell`` (the default first), or None when none but the default is."""
        kernel = cell.site.kernel
        variants = tuple(v for v in self.tunable()[kernel] if f"{kernel}[{v}]" not in self.left_out)
        default = variants[0]
        history = []
        rows = PRUNE_FROM_ROWS
        while rows < cell.rows:
            found = self.results.get(Cell(cell.site, rows).key)
            if found is not None:
                history.append(found)
            rows *= 2
        pairs = list(zip(history, history[1:], strict=False))
        others = tuple(v for v in variants[1:] if not any(_losing_ground(pair, default, v) for pair in pairs))
        return (default, *others) if others else None

    def _measure(
        self, cell: Cell, variants: tuple[str, ...], cap_ns: float | None, deadline: int | None
    ) -> CellResult | None:
        """Time ``variants`` in ``cell``; None where ``deadline`` passes before each has its ``min_repeats`` samples
        (the cell is not kept: fewer samples would choose by noise). One that fails to compile or in its warm-up is
        left out (``left_out``); EngineError naming the variant when that is the default (the engine's own choice: it
        cannot run a model), or when one fails after its warm-up. A lost device (:class:`DeviceLost`) ends the tune
        whichever variant ran."""
        device, settings = self.device, self.settings
        launch = launch_inputs(cell.site, cell.rows, self.dims, self.rng)
        pool = device.allocate_pages(launch.layout) if launch.layout is not None else None
        try:
            weight = _weight(cell.site.kernel, launch.args)
            weight_at = None if weight is None else weight[0]
            args = [None if a is None or i == weight_at else device.upload(a) for i, a in enumerate(launch.args)]
            if launch.layout is not None:
                args[launch.pool_index] = pool
            arg_sets = [args] if weight is None else _with_weight_copies(device, args, *weight)
            warm: dict[str, Callable[..., Any]] = {}
            expected: list[np.ndarray] = []
            for variant in variants:
                try:
                    launcher = device.compile(cell.site.kernel, variant, **launch.options)
                    results = _float_results(device, launcher(*arg_sets[0]))
                    for index in range(1, max(settings.warmup, len(arg_sets))):
                        launcher(*arg_sets[index % len(arg_sets)])
                        if self._past(deadline):
                            break
                    device.synchronize()
                    if self._past(deadline):
                        return None
                except (Exception, SystemExit) as exc:
                    if lost_device(exc):  # the device's failure, not the variant's: every later launch fails too
                        raise
                    failure = _failure(device, cell.site.kernel, variant, exc)
                    if variant == variants[0]:
                        raise EngineError(failure) from exc
                    self.left_out[f"{cell.site.kernel}[{variant}]"] = failure
                    continue
                if variant == variants[0]:
                    expected = results
                else:
                    wrong = _disagreement(results, expected)
                    if wrong is not None:  # fast but wrong: never to be chosen
                        self.left_out[f"{cell.site.kernel}[{variant}]"] = (
                            f"engine {device.name!r}: kernel {cell.site.kernel}[{variant}] does not compute what "
                            f"{cell.site.kernel}[{variants[0]}] does: {wrong}")
                        continue
                warm[variant] = launcher
            variants, launchers = tuple(warm), list(warm.values())
            samples: list[list[int]] = [[] for _ in variants]
            began = self.clock()
            launches = 0
            which = 0
            try:
                for round_index in range(settings.repeats):
                    # Rotate the order each round so no variant always runs right after another.
                    for offset in range(len(variants)):
                        which = (round_index + offset) % len(variants)
                        settle_until = self.clock() + SETTLE_NS
                        while self.clock() < settle_until:
                            launchers[which](*arg_sets[launches % len(arg_sets)])
                            launches += 1
                        device.synchronize()
                        t0 = self.clock()
                        for _ in range(BURST):
                            launchers[which](*arg_sets[launches % len(arg_sets)])
                            launches += 1
                        device.synchronize()
                        samples[which].append((self.clock() - t0) // BURST)
                        if round_index + 1 < settings.min_repeats and self._past(deadline):
                            return None
                    if round_index + 1 >= settings.min_repeats:
                        now = self.clock()
                        if (cap_ns is not None and now - began > cap_ns) or (deadline is not None and now > deadline):
                            break
            except (Exception, SystemExit) as exc:
                raise EngineError(_failure(device, cell.site.kernel, variants[which], exc)) from exc
        finally:
            if pool is not None:
                device.free_pages(pool)
        return CellResult(dict(zip(variants, samples, strict=True)))

    def _past(self, deadline: int | None) -> bool:
        return deadline is not None and self.clock() > deadline

    # -- the result ------------------------------------------------------------------

    def device_meta(self) -> DeviceMeta:
        """The device as its profile records it."""
        info = self.device.info
        return DeviceMeta(
            vendor=_clean(info.vendor),
            name=_clean(info.name),
            architecture=_clean(info.architecture),
            kind=info.kind,
            driver=_clean(info.driver, empty=True),
            memory_bytes=max(0, int(info.memory_bytes)),
        )

    def profile(self, seconds: float) -> Profile:
        kernels = []
        for kernel, variants in self.tunable().items():
            tuning = _kernel_tuning(kernel, variants, self._measured_cells(kernel), self.settings.margin)
            if tuning is not None:
                kernels.append(tuning)
        workload = self.dims.describe() + (
            "; square weights " + "..".join(map(str, (256, 4096))) if self.settings.grid else ""
        )
        return Profile(
            name=default_profile_name(self.device),
            engine=self.device.name,
            engine_version=self.device.engine.version or "unknown",
            device=self.device_meta(),
            tools=tool_versions(self.device),
            tune=TuneMeta(
                mode=self.settings.mode,
                measured_at=datetime.now(UTC).isoformat(timespec="seconds"),
                seconds=round(seconds, 1),
                warmup=self.settings.warmup,
                repeats=self.settings.repeats,
                margin=self.settings.margin,
                workload=_clean(workload),
                load_average=self.load_average,
            ),
            kernels=tuple(kernels),
        )

    def _measured_cells(self, kernel: str) -> list[tuple[Cell, CellResult]]:
        return [
            (cell, self.results[cell.key])
            for cell in self.cells()
            if cell.site.kernel == kernel and cell.key in self.results
        ]


def measured_alike(earlier: Profile, profile: Profile) -> bool:
    """Whether the buckets of ``earlier`` may stand beside ``profile``'s: measured with the same engine build on
    the same device (its driver included) and chosen by the same margin. The mode and model may differ: a quick
    tune after a full one keeps the full one's larger row counts and square weights."""
    def what(p: Profile) -> tuple[object, ...]:
        device = p.device
        return (p.engine, p.engine_version, device.vendor, device.name, device.architecture, device.kind,
                device.driver, p.tune.margin)

    return not earlier.is_default and what(earlier) == what(profile)


def carry_over(profile: Profile, earlier: Profile) -> tuple[Profile, int]:
    """``profile`` with the buckets of ``earlier`` (see :func:`measured_alike`) that it did not measure, and how
    many those are: a run cut short by its budget keeps what an earlier, longer run found."""
    kernels = []
    kept = 0
    for tuning in profile.kernels:
        before = earlier.kernel(tuning.kernel)
        if before is None or (before.default, before.variants) != (tuning.default, tuning.variants):
            kernels.append(tuning)
            continue
        measured = {bucket.anchors for bucket in tuning.buckets}
        older = [bucket for bucket in before.buckets if bucket.anchors not in measured]
        kept += len(older)
        buckets = sorted((*tuning.buckets, *older), key=lambda b: (b.size, b.min_kv_tokens, b.rows))
        kernels.append(replace(tuning, buckets=tuple(buckets)))
    for before in earlier.kernels:
        if profile.kernel(before.kernel) is None:
            kernels.append(before)
            kept += len(before.buckets)
    return replace(profile, kernels=tuple(kernels)), kept


AGREEMENT = 0.05
"""How far a variant's results may be from the default's, as the norm of the difference over the default's norm:
variants differ in rounding (another order of sums, narrower activations), not by this much unless one is wrong."""


def _float_results(device: Device, result: Any) -> list[np.ndarray]:
    """A launch's floating-point results on the host (an in-place kernel's None gives none; indices are left out:
    the values beside them say the same)."""
    results = result if isinstance(result, (tuple, list)) else [result]
    arrays = [np.asarray(device.download(r)) for r in results if r is not None]
    return [array.astype(np.float64) for array in arrays if np.issubdtype(array.dtype, np.floating)]


def _disagreement(got: list[np.ndarray], expected: list[np.ndarray]) -> str | None:
    """How ``got`` differs from ``expected`` past AGREEMENT, or None where it does not."""
    if [a.shape for a in got] != [a.shape for a in expected]:
        return f"results of shapes {[a.shape for a in got]}, not {[a.shape for a in expected]}"
    for mine, theirs in zip(got, expected, strict=True):
        finite = np.isfinite(theirs)
        if not np.array_equal(np.isfinite(mine), finite):
            return "non-finite values where the default's are finite, or the other way round"
        scale = float(np.linalg.norm(theirs[finite]))
        error = float(np.linalg.norm((mine - theirs)[finite]))
        if error > AGREEMENT * max(scale, 1e-30):
            return f"a relative difference of {error / max(scale, 1e-30):.3g} (at most {AGREEMENT} is rounding)"
    return None


def _failure(device: Device, kernel: str, variant: str, exc: BaseException) -> str:
    """Why ``kernel[variant]`` cannot be measured: an EngineError's words (they name the engine), else the engine,
    the variant and what it raised."""
    if isinstance(exc, EngineError):
        return str(exc)
    return f"engine {device.name!r}: kernel {kernel}[{variant}] failed: {what_raised(exc)}"


def _weight(kernel: str, host_args: list[np.ndarray | None]) -> tuple[int, np.ndarray] | None:
    """The launch's weight matrix and its position, if it has one (see STREAMED_BYTES)."""
    from pie.poem.lower import SIZE_ARGUMENT

    index = SIZE_ARGUMENT.get(kernel)
    weight = None if index is None else host_args[index]
    return (index, weight) if index is not None and weight is not None and weight.ndim == 2 else None


def _with_weight_copies(device: Device, args: list[Any], index: int, weight: np.ndarray) -> list[list[Any]]:
    """Sets of ``args`` whose weight (at ``index``) is each another upload of the same values (see
    STREAMED_BYTES), uploaded as a model's weights are."""
    copies = min(MAX_WEIGHT_COPIES, -(-STREAMED_BYTES // max(weight.nbytes, 1)))
    arg_sets = []
    for _ in range(copies):
        arguments = list(args)
        arguments[index] = device.upload_weights([weight])[0]
        arg_sets.append(arguments)
    return arg_sets


def _losing_ground(pair: tuple[CellResult, CellResult], default: str, variant: str) -> bool:
    """Whether ``variant`` lost clearly at both row counts of ``pair``, by more at the larger one
    (or was no longer timed there)."""
    ratios = []
    for result in pair:
        if variant not in result.samples_ns:
            return True
        mine, base = result.timing(variant), result.timing(default)
        if mine.low <= base.high * PRUNE_FACTOR:
            return False
        ratios.append(mine.median / base.median)
    return ratios[1] >= ratios[0]


def _kernel_tuning(
    kernel: str, variants: tuple[str, ...], measured: list[tuple[Cell, CellResult]], margin: float
) -> KernelTuning | None:
    """Buckets from cells: sites that share a bucket (size, rows, KV threshold) must all agree on a
    non-default winner."""
    default = variants[0]
    grouped: dict[tuple[int, int, int], list[tuple[Cell, CellResult]]] = {}
    for cell, result in measured:
        grouped.setdefault((cell.site.size, cell.site.min_kv_tokens, cell.rows), []).append((cell, result))
    buckets = []
    for (size, min_kv, rows), group in sorted(grouped.items()):
        common = [v for v in variants if all(v in result.samples_ns for _, result in group)]
        times = {v: _summed([result.timing(v) for _, result in group]) for v in common}
        winners = [
            v
            for v in common[1:]
            if all(_clearly_faster(result.timing(v), result.timing(default), margin) for _, result in group)
            and times[v].beats(times[default], margin)
        ]
        choice = min(winners, key=lambda v: times[v].median) if winners else default
        shapes = tuple(dict.fromkeys(cell.site.shape for cell, _ in group))
        buckets.append(Bucket(size, rows, choice, tuple(sorted(times.items())), shapes, min_kv))
    if not buckets:
        return None
    return KernelTuning(kernel, default, variants, tuple(buckets))


def _clearly_faster(mine: Timing, default: Timing, margin: float) -> bool:
    steady = mine.high <= mine.low * MAX_SPREAD and default.high <= default.low * MAX_SPREAD
    return steady and mine.beats(default, margin)


def _summed(timings: Iterable[Timing]) -> Timing:
    items = list(timings)
    return Timing(*(round(sum(getattr(t, q) for t in items), 3) for q in ("low", "median", "high")))


def _tune_words(key: dict[str, Any]) -> str:
    """A run key (:meth:`Tuner._run_key`) in words: its mode and the model whose shapes it measures."""
    settings, dims = key.get("settings"), key.get("dims")
    mode = settings.get("mode") if isinstance(settings, dict) else None
    label = dims.get("label") if isinstance(dims, dict) else None
    return f"{mode or 'unknown'} tune ({label or 'another model'})"


def load_average() -> float | None:
    """The one-minute load average, where the OS reports one: timings taken under load are noisy."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def _clean(text: str, empty: bool = False) -> str:
    text = "".join(c for c in str(text) if c.isprintable()).strip()[:256]
    return text if text or empty else "unknown"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def default_profile_name(device: Device) -> str:
    info = device.info
    parts = [_slug(device.name), _slug(info.vendor), _slug(info.name)]
    return "-".join(p for p in parts if p)[:100].strip("-._") or "profile"


def tool_versions(device: Device) -> tuple[tuple[str, str], ...]:
    """Versions of what the measurement ran on: Python, pie-core, the engine and what it reports using."""
    tools = {"python": platform.python_version(), "pie_core": core_version}
    tools[_slug(device.name).replace("-", "_") or "engine"] = device.engine.version or "unknown"
    for finding in device.engine.diagnose():
        key = _slug(finding.what).replace("-", "_")[:64]
        if finding.ok and key and key not in tools:
            tools[key] = _clean(finding.detail)
    return tuple(tools.items())
