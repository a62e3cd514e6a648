"""The Vulkan and WebGPU engines' shipped profiles over the shared launchers' variants: the default profiles
choose, per row count and device kind, what the launchers' own ``auto`` ran before there were none."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from pie.enginekit.shaders.launch import VARIANTS
from pie.kernels import PROJECTIONS
from pie.poem.lower import bucketed_launcher
from pie.profiles.loader import check_fits, parse_profile
from pie.profiles.schema import Profile, ProfileChooser

ROOT = Path(__file__).resolve().parents[3]
ENGINES = ("vulkan", "wgpu")


def shipped(engine: str, name: str) -> Profile:
    path = ROOT / f"pie-engine-{engine}" / "src" / f"pie_engine_{engine}" / "profiles" / f"{name}.toml"
    return parse_profile(path.read_bytes(), str(path))


def old_auto(kernel: str, rows: int, software: bool) -> str:
    """What ``auto`` ran: the rows family on CPU devices, cooperative K loops then tiles on GPUs."""
    if kernel == "attention":
        return "serial" if software else "group"
    table = ((1, "rows"), (4, "rows_b4"), (1 << 30, "rows_b8")) if software else (
        (1, "gemv"), (4, "gemv_b4"), (8, "gemv_b8"), (32, "tile16"), (1 << 30, "tile64"))
    return next(variant for bound, variant in table if rows <= bound)


def chosen(chooser: ProfileChooser, kernel: str, rows: int, weight: tuple[int, int]) -> str:
    """The variant the per-bucket launcher runs, as the plan binds it (fake launchers name their variant)."""
    default = VARIANTS[kernel][0]
    buckets = chooser(kernel)
    if buckets is None or not buckets.restricted(VARIANTS[kernel]).entries:
        return default
    named = {variant: (lambda *args, v=variant: v) for variant in VARIANTS[kernel]}
    launch = bucketed_launcher(kernel, buckets.restricted(VARIANTS[kernel]), named, named[default])
    x = np.zeros((rows, weight[1]), np.float32)
    if kernel == "attention":
        return launch(x)
    args = [x, np.zeros(weight, np.float32), None]
    if kernel in ("rms_norm_linear", "rms_norm_gate_up_silu"):
        args.insert(1, np.zeros(weight[1], np.float32))
    return launch(*args)


@pytest.mark.parametrize("engine", ENGINES)
def test_every_shipped_profile_fits_the_launchers(engine: str) -> None:
    folder = ROOT / f"pie-engine-{engine}" / "src" / f"pie_engine_{engine}" / "profiles"
    names = sorted(path.stem for path in folder.glob("*.toml"))
    assert {f"{engine}-default", f"{engine}-default-cpu"} <= set(names)
    for name in names:
        check_fits(shipped(engine, name), engine, "0.1.0", VARIANTS)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("software", [True, False])
def test_the_default_profile_picks_what_auto_picked(engine: str, software: bool) -> None:
    profile = shipped(engine, f"{engine}-default-cpu" if software else f"{engine}-default")
    assert profile.is_default and profile.device.kind == ("cpu" if software else "")
    chooser = ProfileChooser(None, profile)
    for kernel in (*PROJECTIONS, "attention"):
        for weight in ((576, 576), (1536, 576), (4096, 11008)):
            for rows in (1, 2, 3, 4, 8, 16, 32, 64, 500):
                assert chosen(chooser, kernel, rows, weight) == old_auto(kernel, rows, software), (kernel, rows)


@pytest.mark.parametrize("engine", ENGINES)
def test_on_lavapipe_the_measured_profile_lies_over_the_cpu_default(engine: str) -> None:
    measured = shipped(engine, f"{engine}-mesa-llvmpipe")
    chooser = ProfileChooser(measured, shipped(engine, f"{engine}-default-cpu"))
    bucket = next(b for b in measured.kernel("rms_norm_linear").buckets if b.rows == 1)  # type: ignore[union-attr]
    measured_weight = bucket.shapes[0]
    assert chosen(chooser, "rms_norm_linear", 1, measured_weight) == bucket.variant
    assert chosen(chooser, "rms_norm_linear", 1, (8192, 8192)) == "rows", "an unmeasured size: the default profile"
    assert chosen(chooser, "rms_norm_linear", 500, (8192, 8192)) == "rows_b8"


def test_between_anchors_the_bucket_takes_its_anchors_choice() -> None:
    """Buckets cover [n, 2n): where ``auto``'s bounds fell inside one (5-7, 9-15, 33-63 rows on GPUs,
    5-7 on CPUs), the row counts there now run what ``auto`` ran at the bucket's anchor."""
    gpu = ProfileChooser(None, shipped("vulkan", "vulkan-default"))
    cpu = ProfileChooser(None, shipped("vulkan", "vulkan-default-cpu"))
    weight = (576, 576)
    assert [chosen(gpu, "linear", r, weight) for r in (5, 9, 33)] == ["gemv_b4", "gemv_b8", "tile16"]
    assert [old_auto("linear", r, False) for r in (5, 9, 33)] == ["gemv_b8", "tile16", "tile64"]
    assert chosen(cpu, "linear", 5, weight) == "rows_b4" and old_auto("linear", 5, True) == "rows_b8"
