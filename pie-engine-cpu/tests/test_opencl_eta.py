"""The CPU engine's OpenCL JIT runs eta epilogues on PoCL and agrees with numpy."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pie.eta as eta
import pytest
from pie.eta import stdlib
from pie_engine_cpu import opencl

pytestmark = pytest.mark.filterwarnings("ignore::pyopencl.CompilerWarning")


@pytest.fixture(scope="module")
def runner() -> opencl.OpenCLEpilogues:
    assert opencl.available(), "no OpenCL device builds kernels: install pyopencl and PoCL"
    return opencl.OpenCLEpilogues()


def arguments(ep: eta.Epilogue, rows: int, cols: int) -> dict:
    rng = np.random.default_rng(0)
    sizes = {"rows,cols": (rows, cols), "cols": (cols,), "rows": (rows,)}
    values: dict = {i.name: rng.normal(size=sizes[i.shape.value]).astype(np.float32) for i in ep.inputs}
    values.update({p.name: 0.75 for p in ep.params})
    return values


@pytest.mark.parametrize("name", sorted(stdlib.SOURCES))
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (4, 300), (33, 4096)])
def test_stdlib_epilogues_agree_with_numpy(runner: opencl.OpenCLEpilogues, name: str, rows: int, cols: int) -> None:
    ep = stdlib.get(name)
    args = arguments(ep, rows, cols)
    got, want = runner.run(ep, **args), ep.numpy_fn()(**args)
    assert got.keys() == want.keys()
    for key in want:
        assert got[key].dtype == want[key].dtype and got[key].shape == (rows, cols)
        np.testing.assert_allclose(got[key], want[key], rtol=2e-5, atol=1e-6)


def test_integer_outputs_and_params(runner: opencl.OpenCLEpilogues) -> None:
    ep = eta.compile(
        "in x: f32; param k: i32; param on: bool; out n: i32 = i32(x * 100.0) + k; out y = select(on, x, -x)"
    )
    args = {"x": np.linspace(-3, 3, 40, dtype=np.float32).reshape(4, 10), "k": -7, "on": False}
    got, want = runner.run(ep, **args), ep.numpy_fn()(**args)
    np.testing.assert_array_equal(got["n"], want["n"])
    np.testing.assert_array_equal(got["y"], want["y"])


def test_programs_are_built_once_per_source(runner: opencl.OpenCLEpilogues) -> None:
    ep = eta.compile("in x: f32; param t: f32; out y = x / t + 123.0")
    args = {"x": np.ones((2, 3), np.float32), "t": 2.0}
    before = runner.programs_built
    runner.run(ep, **args)
    runner.run(eta.compile("in x: f32 ; param t: f32 ; out y = x/t + 123.0"), **args)  # same IR, same source
    assert runner.programs_built == before + 1


def test_empty_inputs(runner: opencl.OpenCLEpilogues) -> None:
    got = runner.run(stdlib.get("silu_mul"), gate=np.zeros((0, 8), np.float32), up=np.zeros((0, 8), np.float32))
    assert got["y"].shape == (0, 8)


def test_bad_arguments_are_rejected_like_numpy_fn(runner: opencl.OpenCLEpilogues) -> None:
    with pytest.raises(TypeError, match="missing"):
        runner.run(stdlib.get("bias_add"), x=np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="shape"):
        runner.run(stdlib.get("bias_add"), x=np.ones((2, 3), np.float32), bias=np.ones(2, np.float32))


def test_importing_the_module_does_not_import_pyopencl() -> None:
    code = "import sys, pie_engine_cpu.opencl; assert 'pyopencl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
