"""Default profiles: an engine's choices per row count, written by hand, beneath whatever measured profile applies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from pie.profiles import ProfileError, resolve, variant_chooser
from pie.profiles.loader import parse_profile
from pie.profiles.schema import ANY, ProfileBuckets, ProfileChooser
from pie.profiles.writer import dump_profile
from profile_fakes import FAKE_DEVICE, VERSION, FakeEngine, make_profile, open_fake


def default_text(kind: str = "gpu", name: str = "fake-default", rows_variant: str = "rows") -> str:
    device = f'kind = "{kind}"\n' if kind else ""
    return f"""schema = 1
name = "{name}"
engine = "fake"
engine_version = "{VERSION}"

[device]
{device}
[tools]

[tune]
mode = "default"
workload = "rows for one row"

[[kernels.linear.buckets]]
rows = 1
variant = "{rows_variant}"

[[kernels.linear.buckets]]
size = 4096
variant = "rows"
"""


def test_a_default_profile_needs_no_device_times_or_sizes() -> None:
    profile = parse_profile(default_text(), "d.toml")
    assert profile.is_default and profile.device.kind == "gpu" and profile.device.name == ""
    [linear] = profile.kernels
    assert linear.default == "" and linear.variants == ("rows",)
    assert [(b.size, b.rows, b.variant, b.times) for b in linear.buckets] == [(ANY, 1, "rows", ()), (4096, ANY, "rows", ())]
    assert parse_profile(dump_profile(profile), "again.toml") == profile



def test_a_default_profile_reads_back_as_written_whatever_the_order_of_its_buckets() -> None:
    # The variants a default profile leaves out are those its buckets name, in the order they are kept (by size,
    # then rows): in file order, a profile whose catch-all bucket comes last (as the shipped wgpu and vulkan
    # defaults do) read back from its export with its variants in another order, and not as the same profile.
    text = default_text().replace('size = 4096\nvariant = "rows"', 'variant = "tiles"')
    profile = parse_profile(text, "d.toml")
    assert profile.kernels[0].variants == ("tiles", "rows")
    assert parse_profile(dump_profile(profile), "again.toml") == profile

@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ('mode = "default"', 'mode = "quick"', "missing key 'measured_at'"),
        ('kind = "gpu"', 'kind = "toaster"', "'toaster' is not one of"),
        ('size = 4096\n', 'shapes = [[64, 64]]\n', "shapes need the size bucket"),
        ("rows = 1\n", "rows = 3\n", "3 is not a power of two"),
    ],
)
def test_what_a_default_profile_may_not_leave_out_or_get_wrong(old: str, new: str, message: str) -> None:
    with pytest.raises(ProfileError, match=message):
        parse_profile(default_text().replace(old, new, 1), "d.toml")


def test_a_measured_profile_still_needs_its_sizes_and_times() -> None:
    text = dump_profile(make_profile())
    without_size = text.replace("size = 4096\n", "", 1)
    with pytest.raises(ProfileError, match="missing key 'size'"):
        parse_profile(without_size, "m.toml")


def test_the_default_profile_applies_alone_where_nothing_was_measured(profile_dir: Path) -> None:
    device = open_fake(FakeEngine(profiles=(default_text(),)))
    resolution = resolve(device)
    assert resolution.profile is None and resolution.base is not None and resolution.base.name == "fake-default"
    assert "default profile 'fake-default' for gpu devices applies" in resolution.reason
    chooser, _ = variant_chooser(device)
    assert chooser is not None
    buckets = chooser("linear")
    assert isinstance(buckets, ProfileBuckets)
    restricted = buckets.restricted(device.kernels()["linear"])
    assert restricted.rows_for(100)[1] == "rows" and restricted.rows_for(100).get(2) is None
    assert all(restricted.rows_for(4096)[1 << bit] == "rows" for bit in range(64))
    assert restricted.describe() == "rows at 1 rows (any size), any rows (size 2^12)"


def test_kind_decides_and_the_kind_specific_default_wins(profile_dir: Path) -> None:
    for_cpu = default_text("cpu", "fake-default-cpu")
    for_any = default_text("", "fake-default-any")
    resolution = resolve(open_fake(FakeEngine(profiles=(for_cpu,))))
    assert resolution.base is None and "for another device (cpu devices)" in [s for _, s in resolution.considered]
    gpu = resolve(open_fake(FakeEngine(profiles=(for_any, default_text()))))
    assert gpu.base is not None and gpu.base.name == "fake-default"
    cpu = resolve(open_fake(FakeEngine(profiles=(for_any, for_cpu), info=replace(FAKE_DEVICE, kind="cpu"))))
    assert cpu.base is not None and cpu.base.name == "fake-default-cpu"


def test_a_measured_profile_lies_over_the_default_one(profile_dir: Path) -> None:
    # Measured at size 4096: rows at 1, 2 and 4 rows, blas (the default) at 8. The default profile
    # says rows for every row count at that size: measured buckets hide it, its choice fills the rest.
    device = open_fake(FakeEngine(profiles=(dump_profile(make_profile()), default_text())))
    resolution = resolve(device)
    assert resolution.profile is not None and resolution.base is not None
    assert "beneath it, the engine's default profile" in resolution.reason
    assert [s for _, s in resolution.considered] == ["applies", "applies"]
    chooser, _ = variant_chooser(device)
    assert chooser is not None
    table = chooser("linear").restricted(device.kernels()["linear"]).rows_for(4096)  # type: ignore[union-attr]
    assert [table[r] for r in (1, 2, 4, 8, 16, 1 << 40)] == ["rows", "rows", "rows", "blas", "rows", "rows"]
    assert repr(chooser) == "<ProfileChooser 'fake-acme' over 'fake-default': linear>"


def test_buckets_that_all_keep_the_default_need_no_dispatcher() -> None:
    profile = parse_profile(default_text(rows_variant="blas").replace('size = 4096\nvariant = "rows"', "rows = 2\nvariant = \"blas\""))
    chooser = ProfileChooser(None, profile)
    buckets = chooser("linear")
    assert buckets is not None and buckets.restricted(("blas", "rows")).entries == ()


def test_the_plan_names_the_variants_and_each_launch_runs_its_own() -> None:
    import numpy as np
    from pie.poem.graph import Graph
    from pie.poem.lower import lower

    chooser = ProfileChooser(None, parse_profile(default_text()))
    # A step's weight never changes: one plan per weight size (64 x 64 is the 2^12 size bucket).
    for width, expected in ((32, {1: "rows", 3: "blas"}), (64, {1: "rows", 3: "rows", 300: "rows"})):
        engine = FakeEngine()
        graph = Graph()
        graph.add("linear", ("in.x", "w.w", None), "logits", "head")
        plan = lower(graph, open_fake(engine), choose_variant=chooser)
        assert "-> linear[default; rows at 1 rows (any size), any rows (size 2^12)]" in plan.describe()
        for rows, variant in expected.items():
            env = plan.new_env()
            plan.bind(env, "in.x", np.ones((rows, width), np.float32))
            plan.bind(env, "w.w", np.ones((width, width), np.float32))
            plan.run(env)
            assert engine.launches[-1] == ("linear", variant, rows), (rows, width)
