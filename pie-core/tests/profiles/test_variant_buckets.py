"""Per-bucket variant choice at launch time, and no indirection where one variant applies."""

from __future__ import annotations

import numpy as np
from pie.poem.graph import Graph
from pie.poem.lower import ShapeBuckets, lower, pow2_floor
from pie.profiles import ProfileChooser
from profile_fakes import FakeEngine, make_profile, open_fake


def one_linear_plan(chooser=None, engine: FakeEngine | None = None):
    engine = engine or FakeEngine()
    device = open_fake(engine)
    graph = Graph()
    graph.add("linear", ("in.x", "w.w", None), "logits", "head")
    return engine, device, lower(graph, device, choose_variant=chooser)


def run(plan, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    env = plan.new_env()
    plan.bind(env, "in.x", x)
    plan.bind(env, "w.w", w)
    return plan.run(env)


def test_pow2_floor() -> None:
    assert [pow2_floor(n) for n in (0, 1, 2, 3, 4, 7, 8, 1000)] == [0, 1, 2, 2, 4, 4, 8, 512]


def test_without_a_profile_the_step_calls_the_engine_launcher_directly() -> None:
    _, device, plan = one_linear_plan()
    (step,) = plan.steps
    assert step.launcher is device.compile("linear") and step.buckets is None


def test_profile_keeping_defaults_adds_no_dispatch() -> None:
    chooser = ProfileChooser(make_profile(choice="blas"))
    _, device, plan = one_linear_plan(chooser)
    assert plan.steps[0].launcher is device.compile("linear")


def test_each_launch_runs_its_buckets_variant() -> None:
    engine, device, plan = one_linear_plan(ProfileChooser(make_profile()))
    (step,) = plan.steps
    assert step.buckets is not None and step.variant is None
    assert "[default; rows at 1,2,4 rows (size 2^12)]" in plan.describe()
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)  # 4096 elements: the profile's size bucket
    for rows in (1, 2, 3, 5, 7, 8, 9, 16, 100):
        x = rng.standard_normal((rows, 64)).astype(np.float32)
        np.testing.assert_allclose(run(plan, x, w), x @ w.T, rtol=1e-5)
    used = [variant for _, variant, _ in engine.launches]
    assert used == ["rows"] * 5 + ["blas"] * 4


def test_other_size_bucket_runs_the_default() -> None:
    engine, _, plan = one_linear_plan(ProfileChooser(make_profile()))
    w = np.ones((128, 64), np.float32)  # 8192 elements: not measured
    for rows in (1, 2, 4):
        run(plan, np.ones((rows, 64), np.float32), w)
    assert [variant for _, variant, _ in engine.launches] == ["blas"] * 3


def test_unsupported_variants_in_buckets_are_dropped() -> None:
    engine = FakeEngine(kernels={"linear": ("blas", "tiles"), "add": ("numpy",)})
    buckets = ShapeBuckets(((4096, 1, "rows"), (4096, 2, "blas")))
    _, device, plan = one_linear_plan(lambda kernel: buckets if kernel == "linear" else None, engine)
    assert plan.steps[0].launcher is device.compile("linear")
