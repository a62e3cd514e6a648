"""The tuner on a fake clock (deterministic crossovers, budget, interrupt and resume) and on the CPU engine."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pie.profiles import check_fits, dump_profile, parse_profile
from pie.hookspecs import hookimpl
from pie.plugins import DeviceLost, EngineError
from pie.profiles.tuner import (
    MAX_WEIGHT_COPIES,
    STREAMED_BYTES,
    PartialFileError,
    PartialOfAnotherTuneError,
    Tuner,
    TuneSettings,
    carry_over,
    measured_alike,
)
from pie.profiles.workloads import Dims
from profile_fakes import VERSION, FakeEngine, make_profile, open_fake

TINY = Dims(64, 128, 4, 2, 16, 256, "tiny test model")
SETTINGS = replace(TuneSettings.quick(None), max_rows=256, repeats=5, min_repeats=3)


def fake_tuner(
    tmp_path: Path, engine: FakeEngine | None = None, settings: TuneSettings = SETTINGS, version: str = VERSION
) -> tuple[Tuner, FakeEngine]:
    engine = engine or FakeEngine()
    tuner = Tuner(open_fake(engine, version), settings, tmp_path / "fake.partial.json", TINY, clock=engine.clock)
    return tuner, engine


def test_finds_the_crossover_and_never_picks_a_slower_variant(tmp_path: Path) -> None:
    tuner, engine = fake_tuner(tmp_path)
    profile = tuner.run()
    (tuning,) = profile.kernels
    assert tuning.kernel == "linear" and tuning.default == "blas"
    # rows costs 10+5r us, blas 45+r: rows wins clearly up to 8 rows, loses from 16.
    for bucket in tuning.buckets:
        assert bucket.variant == ("rows" if bucket.rows <= 8 else "blas"), bucket
        chosen, default = bucket.time(bucket.variant), bucket.time("blas")
        assert chosen is not None and default is not None and chosen.median <= default.median
    sizes = {b.size for b in tuning.buckets}
    assert sizes == {4096, 8192, 16384}  # o; qkv and down share 2^13; gate_up and lm_head share 2^14
    merged = next(b for b in tuning.buckets if b.size == 8192 and b.rows == 1)
    assert set(merged.shapes) == {(128, 64), (64, 128)}
    # After losing at 16 and 32 rows by a growing factor, "rows" is no longer timed.
    assert max(rows for _, variant, rows in engine.launches if variant == "rows") == 32
    assert parse_profile(dump_profile(profile)) == profile


class BrokenVariant(FakeEngine):
    """Its ``variant`` of linear raises when compiled (``when`` "compile") or launched ("launch"), or calls sys.exit
    when compiled ("exit")."""

    def __init__(self, variant: str, when: str) -> None:
        super().__init__()
        self.broken, self.when = variant, when

    @hookimpl
    def pie_compile_kernel(self, device, request):
        if request.variant != self.broken:
            return super().pie_compile_kernel(device, request)
        if self.when == "compile":
            raise RuntimeError("no such instruction")
        if self.when == "exit":
            sys.exit(3)

        def launch(*args: object) -> None:
            raise RuntimeError("illegal address")

        return launch


WHAT_RAISED = {"compile": "compiling kernel linear[rows] failed: RuntimeError: no such instruction",
               "launch": "kernel linear[rows] failed: RuntimeError: illegal address",
               "exit": "compiling kernel linear[rows] failed: it called sys.exit(3)"}


@pytest.mark.parametrize("when", sorted(WHAT_RAISED))
def test_a_variant_that_fails_is_left_out_and_the_tune_goes_on(tmp_path: Path, when: str) -> None:
    """It ended the tune as an internal error of pie's, naming neither the engine nor the variant."""
    tuner, _ = fake_tuner(tmp_path, BrokenVariant("rows", when))
    profile = tuner.run()
    assert profile.kernels and all(b.variant == "blas" for b in profile.kernels[0].buckets)
    assert tuner.left_out == {"linear[rows]": f"engine 'fake': {WHAT_RAISED[when]}"}


@pytest.mark.parametrize("when", sorted(WHAT_RAISED))
def test_a_default_variant_that_fails_ends_the_tune_naming_the_engine(tmp_path: Path, when: str) -> None:
    tuner, _ = fake_tuner(tmp_path, BrokenVariant("blas", when))
    with pytest.raises(EngineError, match=r"^engine 'fake': (compiling )?kernel linear\[blas\] failed: (RuntimeE|it c)"):
        tuner.run()


class LostInVariant(FakeEngine):
    """Its device is lost in the warm-up of linear[rows] at ``from_rows`` rows, and every launch fails from then on."""

    def __init__(self, from_rows: int) -> None:
        super().__init__()
        self.from_rows, self.lost = from_rows, False

    @hookimpl
    def pie_compile_kernel(self, device, request):
        launcher = super().pie_compile_kernel(device, request)

        def launch(x: np.ndarray, *args: object) -> np.ndarray:
            self.lost = self.lost or (request.variant == "rows" and x.shape[0] >= self.from_rows)
            if self.lost:
                raise DeviceLost("the fake accelerator fell off its bus")
            return launcher(x, *args)

        return launch


def test_a_device_lost_in_a_variants_warm_up_ends_the_tune_keeping_what_was_measured(tmp_path: Path) -> None:
    """It was taken for the variant's own failure: the variant was left out and the tune went on launching on a lost
    device, to end in the next cell blaming the default, or, where every launch of the default still ran, to write a
    profile without the variant as though it had measured it."""
    tuner, engine = fake_tuner(tmp_path, LostInVariant(from_rows=4))
    with pytest.raises(DeviceLost, match="fell off its bus"):
        tuner.run()
    assert engine.lost and not tuner.left_out
    saved = json.loads((tmp_path / "fake.partial.json").read_text())
    assert saved["cells"] and all(key.rsplit("/", 1)[1] in ("1", "2") for key in saved["cells"])


class WrongVariant(FakeEngine):
    """Its ``rows`` variant of linear is the fastest and returns the product with one column of weights dropped."""

    @hookimpl
    def pie_compile_kernel(self, device, request):
        launcher = super().pie_compile_kernel(device, request)
        if request.variant != "rows":
            return launcher

        def wrong(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
            y = launcher(x, weight, bias)
            y[:, 0] = 0.0
            return y

        return wrong


def test_a_variant_that_computes_something_else_is_never_chosen(tmp_path: Path) -> None:
    """The tuner timed variants without looking at what they computed: a fast wrong one went into the profile, and
    every pie run on that device with it."""
    tuner, _ = fake_tuner(tmp_path, WrongVariant())
    profile = tuner.run()
    assert all(b.variant == "blas" for b in profile.kernels[0].buckets)
    (why,) = tuner.left_out.values()
    assert why.startswith("engine 'fake': kernel linear[rows] does not compute what linear[blas] does: a relative "
                          "difference of")


def test_noise_keeps_the_default(tmp_path: Path) -> None:
    """Variants within each other's noise: the default stays everywhere."""

    def cost(variant: str, rows: int, size: int) -> float:
        return 100.0

    engine = FakeEngine(cost=cost)
    engine.jitter_scale = 0.2
    tuner, _ = fake_tuner(tmp_path, engine)
    profile = tuner.run()
    assert all(b.variant == "blas" for b in profile.kernels[0].buckets)
    assert tuner.device.kernels()["linear"][0] == "blas"


def test_budget_stops_early_with_a_valid_profile(tmp_path: Path) -> None:
    tuner, _ = fake_tuner(tmp_path, settings=replace(SETTINGS, budget_s=0.05))
    profile = tuner.run()
    assert tuner.budget_exhausted
    measured = sum(len(k.buckets) for k in profile.kernels)
    assert 0 < measured < len(tuner.cells())
    assert parse_profile(dump_profile(profile)) == profile


def test_a_cell_that_outlasts_the_budget_is_cut_off_not_finished(tmp_path: Path) -> None:
    """Cells were cut short only after their minimum rounds: where launches are slow (a long context on lavapipe,
    half a second each) a 10 s budget spent 55 s, and `--full --budget 10` 286 s in its first cell."""
    launch_us = 100_000.0
    engine = FakeEngine(cost=lambda variant, rows, size: 10.0 if rows == 1 else launch_us)
    budget_s = 2.5
    tuner, _ = fake_tuner(tmp_path, engine, replace(SETTINGS, budget_s=budget_s))
    profile = tuner.run()
    assert tuner.budget_exhausted and set(tuner.results) == {cell.key for cell in tuner.cells() if cell.rows == 1}
    # At most one burst (and its settling launch) past the budget: 5 launches, 1.01 times their cost with jitter.
    assert engine.clock.now <= budget_s * 1e9 + 5 * launch_us * 1e3 * 1.01
    assert set(json.loads((tmp_path / "fake.partial.json").read_text())["cells"]) == set(tuner.results)
    assert parse_profile(dump_profile(profile)) == profile

    slow = FakeEngine(cost=lambda variant, rows, size: launch_us)
    tuner, _ = fake_tuner(tmp_path / "slow", slow, replace(SETTINGS, budget_s=budget_s))
    profile = tuner.run()
    assert tuner.budget_exhausted and not tuner.results and not profile.kernels
    assert slow.clock.now <= budget_s * 1e9 + 5 * launch_us * 1e3 * 1.01


def test_interrupted_tune_resumes_without_measuring_again(tmp_path: Path) -> None:
    reference, _ = fake_tuner(tmp_path / "reference")
    expected = reference.run()

    tuner, _ = fake_tuner(tmp_path)
    calls = []

    def interrupt_after_seven(what: str, done: int, total: int, left: float | None) -> None:
        calls.append(what)
        if len(calls) == 8:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tuner.run(interrupt_after_seven)
    saved = json.loads((tmp_path / "fake.partial.json").read_text())
    assert len(saved["cells"]) == 7

    again, engine = fake_tuner(tmp_path)
    assert again.load_partial() and again.resumed == 7
    seen: list[str] = []
    profile = again.run(lambda what, done, total, left: seen.append(what))
    assert not set(calls[:7]) & set(seen), "a finished measurement was taken again"
    assert [k.choices() for k in profile.kernels] == [k.choices() for k in expected.kernels]


def test_partial_of_another_run_is_ignored(tmp_path: Path) -> None:
    tuner, _ = fake_tuner(tmp_path, settings=replace(SETTINGS, budget_s=0.05))
    tuner.run()
    other, _ = fake_tuner(tmp_path, version="9.0.0")
    assert not other.load_partial() and not other.results
    assert not fake_tuner(tmp_path / "elsewhere")[0].load_partial()  # none at all


def test_partial_of_another_mode_is_refused_not_measured_over(tmp_path: Path) -> None:
    """An interrupted full tune's partial file was ignored by a quick tune of the same profile, which then wrote its
    own measurements over it: hours of a full sweep were lost to a quick run."""
    tuner, _ = fake_tuner(tmp_path, settings=replace(SETTINGS, budget_s=0.05))
    tuner.run()
    saved = (tmp_path / "fake.partial.json").read_text()
    full, _ = fake_tuner(tmp_path, settings=replace(TuneSettings.full(None), max_rows=256))
    with pytest.raises(PartialOfAnotherTuneError, match="measurement\\(s\\) of an interrupted quick tune \\(tiny test "
                       "model\\), not of this full tune \\(tiny test model\\)"):
        full.load_partial()
    assert not full.results and (tmp_path / "fake.partial.json").read_text() == saved


GOOD_CELL = {"blas": [4000, 4100, 4200], "rows": [3000, 3100, 3200]}


@pytest.mark.parametrize(
    ("cells", "seconds", "problem"),
    [
        ({"linear/o/1": {"blas": ["x"]}}, 1.0, "damaged \\(ValueError"),
        ([], 1.0, "damaged \\(AttributeError"),
        ({"linear/o/1": GOOD_CELL}, float("nan"), "tune.seconds: nan is not a finite number"),
        ({"linear/o/1": GOOD_CELL}, -1.0, "tune.seconds: -"),
        ({"linear/o/1": {"rows": [3000, 3100, 3200]}}, 1.0, "has no times for variant 'blas'"),
        ({"linear/o/1": {"blas": [-5, -5, -5], "rows": [1, 1, 1]}}, 1.0, "must be above 0"),
        ({"linear/o/1": {"blas": [10**30] * 3, "rows": [1, 1, 1]}}, 1.0, "must be above 0"),
    ],
    ids=["not integers", "cells not a table", "NaN seconds", "negative seconds", "no default", "negative", "huge"],
)
def test_a_damaged_partial_is_refused_before_measuring(tmp_path: Path, cells: object, seconds: float, problem: str) -> None:
    """Each of these used to be taken up and fail only when the finished profile was checked."""
    tuner, engine = fake_tuner(tmp_path)
    (tmp_path / "fake.partial.json").write_text(
        json.dumps({"format": 1, "key": tuner._run_key(), "seconds": seconds, "cells": cells})
    )
    with pytest.raises(PartialFileError, match=problem):
        tuner.load_partial()
    assert not tuner.results and not engine.launches
    assert tuner.run().kernels and engine.launches  # and measuring from scratch works


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"format": 99}'])
def test_a_partial_that_is_not_one_is_refused(tmp_path: Path, text: str) -> None:
    tuner, _ = fake_tuner(tmp_path)
    (tmp_path / "fake.partial.json").write_text(text)
    with pytest.raises(PartialFileError, match="fake.partial.json"):
        tuner.load_partial()


def test_a_small_tune_on_the_cpu_engine_round_trips(tmp_path: Path) -> None:
    pytest.importorskip("pie_engine_cpu")
    from pie.plugins import EngineRegistry

    device = EngineRegistry(env={"PIE_ENGINES": "cpu"}).engine("cpu").open(0)
    settings = replace(TuneSettings.quick(None), max_rows=8, repeats=3, warmup=1)  # to the end, whatever the load
    tuner = Tuner(device, settings, tmp_path / "cpu.partial.json", TINY)
    # Quick mode times what a plan launches: the fused projections, not the plain linear they replace, and the
    # embedding lookup (native beside numpy). The attention kernels have native variants beside numpy's too,
    # but an engine that compiles the attention regions whole (the CPU engine, where its native kernels build)
    # launches none of them.
    launched = {"linear_add", "rms_norm_linear", "rms_norm_gate_up_silu", "embedding"}
    assert launched <= set(tuner.tunable()) <= launched | {"rope", "append_kv", "attention"}
    full = Tuner(device, TuneSettings.full(), tmp_path / "unused.json", TINY)
    assert set(full.tunable()) >= set(tuner.tunable()) | {"linear"}
    profile = tuner.run()
    assert profile.kernels and not tuner.budget_exhausted
    text = dump_profile(profile)
    loaded = parse_profile(text, "cpu.toml")
    assert loaded == profile
    check_fits(loaded, "cpu", device.engine.version, device.kernels())
    for tuning in loaded.kernels:
        for bucket in tuning.buckets:
            assert bucket.time(tuning.default) is not None


def test_unsteady_timings_keep_the_default(tmp_path: Path) -> None:
    """Bimodal timings (a busy machine descheduling threads) never justify a choice, however fast the median."""
    stalls = iter(range(10**9))

    def cost(variant: str, rows: int, size: int) -> float:
        if variant == "rows":
            return 5.0 if next(stalls) // 4 % 3 else 40.0  # usually much faster; every third run of 4 stalls
        return 50.0

    tuner, _ = fake_tuner(tmp_path, FakeEngine(cost=cost), settings=replace(SETTINGS, max_rows=4, repeats=9))
    profile = tuner.run()
    buckets = profile.kernels[0].buckets
    assert buckets and all(b.variant == "blas" for b in buckets)
    assert all(b.time("rows").median < b.time("blas").low for b in buckets)  # type: ignore[union-attr]


class _QueueingEngine(FakeEngine):
    """Launches return after the host's share of ``cost``; the device runs the rest in order, behind
    the launches queued before, and ``synchronize`` waits for it: a GPU's stream on the fake clock."""

    def __init__(self, host_us: dict[str, float], device_us: dict[str, float]) -> None:
        super().__init__(cost=lambda variant, rows, size: host_us[variant])
        self.jitter_scale = 0.0
        self.device_us = device_us
        self.device_free_at = 0

    @hookimpl
    def pie_compile_kernel(self, device, request):
        launch = super().pie_compile_kernel(device, request)
        variant = request.variant or self.kernels[request.name][0]

        def queued(*args):
            out = launch(*args)  # the host's share; the device starts once it has the launch
            self.device_free_at = max(self.clock.now, self.device_free_at) + int(self.device_us[variant] * 1000)
            return out

        return queued

    @hookimpl
    def pie_synchronize(self, device) -> None:
        self.clock.now = max(self.clock.now, self.device_free_at)


def test_launches_are_timed_queued_as_a_forward_pass_queues_them(tmp_path: Path) -> None:
    """"rows" runs shorter on the device but costs the host more per launch than "blas" runs: one
    launch and one synchronize at a time it would look faster (25 + 2 against 10 + 20 us); launched
    four at a time, as a forward pass launches, it costs 25.5 us a launch and "blas" 22.5."""
    engine = _QueueingEngine(host_us={"blas": 10.0, "rows": 25.0}, device_us={"blas": 20.0, "rows": 2.0})
    tuner, _ = fake_tuner(tmp_path, engine, settings=replace(SETTINGS, max_rows=2))
    (tuning,) = tuner.run().kernels
    assert tuning.buckets and all(b.variant == "blas" for b in tuning.buckets)
    for bucket in tuning.buckets:  # a bucket's time sums the sites it serves
        rows, blas = bucket.time("rows"), bucket.time("blas")
        assert rows is not None and blas is not None
        assert rows.median == pytest.approx(25.5 / 22.5 * blas.median)


class _WeightRecordingEngine(FakeEngine):
    """Records the address of every weight a ``linear`` launch reads."""

    def __init__(self) -> None:
        super().__init__()
        self.weights: dict[tuple[int, ...], set[int]] = {}

    @hookimpl
    def pie_compile_kernel(self, device, request):
        launch = super().pie_compile_kernel(device, request)
        if request.name != "linear":
            return launch

        def recording(x, weight, bias=None):
            self.weights.setdefault(weight.shape, set()).add(weight.ctypes.data)
            return launch(x, weight, bias)

        return recording


def test_each_launch_streams_another_copy_of_the_weight(tmp_path: Path) -> None:
    """A weight small enough for the caches is launched from many copies, as a forward pass reads
    each weight once from memory; every copy holds the same values."""
    engine = _WeightRecordingEngine()
    tuner, _ = fake_tuner(tmp_path, engine)
    tuner.run()
    assert engine.weights, "no linear launch was recorded"
    for shape, addresses in engine.weights.items():
        copies = min(MAX_WEIGHT_COPIES, -(-STREAMED_BYTES // (4 * shape[0] * shape[1])))
        # Each cell uploads its own copies (and memory is reused between cells): at least this many.
        assert len(addresses) >= copies > 1, (shape, len(addresses))


def test_an_earlier_profile_lends_the_buckets_measured_alike_that_a_run_did_not_measure() -> None:
    earlier = make_profile()  # 2^12 weights: rows 1, 2, 4 and 8
    (tuning,) = earlier.kernels
    now = replace(earlier, kernels=(replace(tuning, buckets=tuning.buckets[:1]),))
    assert carry_over(now, earlier) == (earlier, 3)
    assert carry_over(replace(earlier, kernels=()), earlier) == (earlier, 4)
    assert measured_alike(earlier, now)
    assert measured_alike(replace(earlier, tune=replace(earlier.tune, mode="full")), now)  # a quick tune after a full
    assert not measured_alike(replace(earlier, engine_version="2.4.0"), now)
    assert not measured_alike(replace(earlier, device=replace(earlier.device, driver="acme driver 6")), now)
