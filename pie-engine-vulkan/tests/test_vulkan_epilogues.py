"""eta epilogues on the Vulkan engine: rendered as Slang, compiled to SPIR-V at run time, run on lavapipe,
against eta's numpy evaluation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from pie import eta
from pie.contract import KernelRequest
from pie.enginekit.shaders.slang import LIBRARY_ENV, runtime_spirv
from pie.eta import stdlib
from pie.plugins import Device, EngineRegistry

PROGRAMS = {
    "exp": "in x: f32; out y = exp(x) + exp2(x)",
    "log": "in x: f32; out y = log(abs(x) + 0.5) + log2(abs(x) + 0.5)",
    "roots": "in x: f32; out y = sqrt(abs(x)) + rsqrt(abs(x) + 0.1)",
    "trig": "in x: f32; out y = tanh(x * 20.0) + sin(x) + cos(x)",
    "erf": "in x: f32; out y = erf(x)",
    "rounding": "in x: f32; out y = floor(x) + ceil(x) * 10.0 + round(x * 2.0) * 100.0",
    "activations": "in x: f32; out y = sigmoid(x) + silu(x) + gelu(x) + gelu_tanh(x) + clamp(x, -1, 1)",
    "min_max": "in x: f32; in z: f32; out y = min(x, z) * 3.0 + max(x, z) + abs(x)",
    "logic": "in x: f32; in z: f32; out y = select(x > z && !(x < 0.0) || x == z, x, z) + f32(x != z)",
    "f16": "in x: f32; out y = f32(f16(x * 1000.0))",
    "bf16": "in x: f32; out y = f32(bf16(x * 1000.0))",
    "to_int": "in x: f32; out y: i32 = i32(x * 1e9)",
    "int_wraps": "in n: i32; in m: i32; out y: i32 = n * m + 2147483647 - abs(n) + min(n, m) - max(n, m)",
    "int_sum": "in n: i32; in m: i32; out y: i32 = row_sum(n * m) + row_max(n) - row_min(m)",
    "shapes": "in x: f32; in b: f32[cols]; in s: f32[rows]; param k: i32\n"
    "out y = x + b * s + f32(row * 1000 + col) + f32(rows - cols + k)",
    "params": "in x: f32; param h: f16; param bf: bf16; param on: bool; param n: i32\n"
    "out y = f32(f16(x) * h) + f32(bf16(x) + bf) + select(on, 1.0, 0.0) + f32(n)",
    "layer_norm": "in x: f32; in w: f32[cols]; in b: f32[cols]; param eps: f32\n"
    "let mu = row_mean(x); let d = x - mu; out y = d * rsqrt(row_mean(d * d) + eps) * w + b",
    "causal_softmax": "in x: f32; let masked = select(col > row, -inf, x)\n"
    "let e = exp(masked - row_max(masked)); out y = e / row_sum(e)",
    **stdlib.SOURCES,
}
SHAPES = [(3, 300), (2, 5), (1, 1000)]


@pytest.fixture(scope="module")
def device() -> Device:
    return EngineRegistry().engine("vulkan").open(0)


def arguments(program: eta.Epilogue, rows: int, cols: int, rng: np.random.Generator) -> tuple[list, dict]:
    """Random inputs (f32 in [-2, 2], i32 in [-50, 50)) and params of ``program``, in declaration order."""
    sizes = {"rows,cols": (rows, cols), "cols": (cols,), "rows": (rows,)}
    inputs = []
    for spec in program.inputs:
        shape = sizes[spec.shape.value]
        if spec.dtype.value == "i32":
            inputs.append(rng.integers(-50, 50, size=shape, dtype=np.int32))
        else:
            inputs.append(rng.uniform(-2.0, 2.0, size=shape).astype(np.float32))
    kinds = {"i32": lambda: int(rng.integers(-20, 20)), "bool": lambda: bool(rng.integers(0, 2))}
    params = {
        p.name: kinds.get(p.dtype.value, lambda: float(np.float32(rng.uniform(0.25, 2.0))))() for p in program.params
    }
    return inputs, params


def run(device: Device, program: eta.Epilogue, inputs: list[np.ndarray], params: dict) -> np.ndarray:
    launch = device.compile("epilogue", source=program.source, params=tuple(params.items()))
    out = device.download(launch(*(device.upload(x) for x in inputs)))
    device.synchronize()
    return out


def assert_agrees(got: np.ndarray, want: np.ndarray, name: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, got.dtype)
    if want.dtype == np.int32:
        np.testing.assert_array_equal(got, want, err_msg=name)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6, err_msg=name)


def test_the_engine_lists_epilogues(device: Device) -> None:
    assert device.supports("epilogue", "eta")


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_epilogue_agrees_with_numpy(device: Device, name: str) -> None:
    program = eta.compile(PROGRAMS[name])
    rng = np.random.default_rng(len(name))
    for rows, cols in SHAPES:
        inputs, params = arguments(program, rows, cols, rng)
        want = program.numpy_fn()(**{s.name: x for s, x in zip(program.inputs, inputs, strict=True)}, **params)
        assert_agrees(run(device, program, inputs, params), want[program.outputs[0].name], f"{name} {rows}x{cols}")


def test_halves_round_to_even_and_casts_saturate(device: Device) -> None:
    program = eta.compile("in x: f32; out y = round(x) + f32(i32(x * 1e10)) * 0.0 + f32(f16(x * 1e4)) * 1e-9")
    x = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 3.49, 65519.0, -7.75]], np.float32)
    want = program.numpy_fn()(x=x)["y"]
    assert_agrees(run(device, program, [x], {}), want, "halves")
    assert run(device, eta.compile("in x: f32; out y = round(x)"), [x], {})[0, :5].tolist() == [0, 2, 2, -0, -2]


EDGES = np.array(
    [0.0, -0.0, 1.0, -1.5, 0.1, 65504.0, 65519.0, 65520.0, -65520.0, 1e5, 6.0e-8, 2.0e-8, 3.0e-8, 6.1e-5, 1e-30,
     3.3895e38, 3.4e38, np.inf, -np.inf, np.nan, 2147483520.0, 2147483648.0, -2147483648.0, -3e9, 1.00048828125,
     1.0009765625, 1.00390625, 1.005859375, 257.5, -0.49999997],
    dtype=np.float32,
)  # fmt: skip
"""Halfway cases, f16 overflow and subnormals, infinities, NaN, the ends of the i32 range."""
EDGE_PROGRAMS = [
    "in x: f32; out y = f32(f16(x))",
    "in x: f32; out y = f32(bf16(x))",
    "in x: f32; out y: i32 = i32(x)",
    "in x: f32; out y = f32(bool(x)) + f32(x == x)",
    "in x: f32; out y = min(x, 1.0) + max(x, -1.0)",
    "in x: f32; out y = exp(x) + erf(x) + round(x)",
]


@pytest.mark.parametrize("source", EDGE_PROGRAMS)
def test_edge_values_through_casts_and_min_max(device: Device, source: str) -> None:
    """eta's own helpers (f16/bf16 rounding, saturating i32 casts, NaN-propagating min/max) hold at the edges."""
    program = eta.compile(source)
    x = np.tile(EDGES, (2, 1))
    want = program.numpy_fn()(x=x)["y"]
    got = run(device, program, [x], {})
    if want.dtype == np.int32:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-6, equal_nan=True)


def test_rows_past_65535_workgroups_use_the_grid_y(device: Device) -> None:
    """One workgroup per row over 65,600 rows: the kernel folds the grid into y and finds its row again."""
    program = eta.compile("in x: f32; out y = x - row_max(x) + f32(row)")
    x = np.random.default_rng(0).uniform(-1, 1, (65_600, 2)).astype(np.float32)
    want = program.numpy_fn()(x=x)["y"]
    assert_agrees(run(device, program, [x], {}), want, "65600 rows")


def test_compiled_modules_are_cached_by_source() -> None:
    rendered = stdlib.get("rms_norm").render("slang")
    first = runtime_spirv(rendered.source, rendered.entry_point)
    assert first[:4] == b"\x03\x02\x23\x07", "SPIR-V"
    assert runtime_spirv(rendered.source, rendered.entry_point) is first


def test_kernel_source_shows_the_slang(device: Device) -> None:
    source = stdlib.SOURCES["logit_softcap"]
    shown = device.source(KernelRequest("epilogue", None, (("params", (("cap", 30.0),)), ("source", source))))
    assert shown is not None and '[shader("compute")]' in shown and eta.compile(source).entry_point in shown


def test_without_the_slang_compiler_epilogues_are_not_listed_and_doctor_says_how_to_get_them() -> None:
    code = (
        "import json; from pie.plugins import EngineRegistry; r = EngineRegistry();"
        "found = r.diagnoses(['vulkan'])['vulkan'];"
        "print(json.dumps([r.engine('vulkan').open(0).supports('epilogue'), [[d.ok, d.what, d.fix] for d in found]]))"
    )
    env = {**os.environ, LIBRARY_ENV: "/nonexistent/libslang-compiler.so"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    listed, found = json.loads(result.stdout.strip().splitlines()[-1])
    assert listed is False
    slang = [(ok, fix) for ok, what, fix in found if what == "Slang compiler"]
    assert slang == [(False, "pip install 'pie-engine-vulkan[epilogue]'")], found
