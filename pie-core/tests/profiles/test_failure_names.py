"""A kernel that fails in a forward pass is named with the engine that ran it: the plan's own, or the
CPU fallback that runs a kernel the plan's engine lacks (each would be fixed in a different place)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from pie.hookspecs import hookimpl
from pie.plugins import EngineRegistry
from pie.poem.graph import Graph
from pie.poem.lower import KernelFailed, lower
from profile_fakes import FAKE_DEVICE, VERSION, FakeEngine


class FailingAdd(FakeEngine):
    @hookimpl
    def pie_compile_kernel(self, device, request):  # type: ignore[override]
        def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
            raise ValueError(f"{self.info.engine} cannot add")

        return add


def _plan(kernels_of_the_plan_engine: dict[str, tuple[str, ...]]):
    registry = EngineRegistry(autoload=False, env={})
    accelerator = FailingAdd(kernels=kernels_of_the_plan_engine)
    host = FailingAdd(info=replace(FAKE_DEVICE, engine="hostfake", kind="cpu"), kernels={"add": ("numpy",)})
    for engine in (accelerator, host):
        registry.register(engine.info.engine, engine, distribution=f"pie-engine-{engine.info.engine}", version=VERSION)
    graph = Graph()
    graph.add("add", ("in.a", "in.b"), "logits", "residual")
    plan = lower(graph, registry.engine("fake").open(0), fallback=registry.engine("hostfake").open(0))
    env = plan.new_env()
    plan.bind(env, "in.a", np.ones(4, np.float32))
    plan.bind(env, "in.b", np.ones(4, np.float32))
    return plan, env


@pytest.mark.parametrize(
    ("kernels", "engine"), [({"add": ("numpy",)}, "fake"), ({"linear": ("blas",)}, "hostfake")], ids=["own", "fallback"]
)
def test_a_failing_kernel_names_the_engine_that_ran_it(kernels: dict[str, tuple[str, ...]], engine: str) -> None:
    plan, env = _plan(kernels)
    assert [step.fallback for step in plan.steps] == [None if engine == "fake" else "hostfake"]
    with pytest.raises(KernelFailed, match=f"kernel add in residual on engine '{engine}' failed: ValueError: {engine}"):
        plan.run(env)
