"""eta epilogues on the CUDA engine: rendered CUDA C and HIP compile for the GPUs CI lacks, and the
catalogue's ``epilogue`` runs on the host emulator with the same launcher a GPU uses, matching eta's
numpy evaluation."""

from __future__ import annotations

import numpy as np
import pytest
from pie.eta import compile as compile_eta
from pie.eta import render_many, stdlib
from pie.contract import KernelRequest
from pie.plugins import Device
from pie_engine_cuda.compiler import Hiprtc, Nvrtc
from pie_engine_cuda.epilogues import EpilogueKernel
from pie_engine_cuda.plugin import engine

NAMES = sorted(stdlib.SOURCES)
EXTRA = {
    "gelu_scale": "in x: f32\nparam alpha: f32\nout y = 0.5 * x * (1 + erf(x * 0.70710677)) * alpha\n",
    "clip_count": "in x: f32\nparam limit: f32\nout y = min(max(x, -limit), limit)\nout n = row_sum(select(abs(x) > limit, 1.0, 0.0))\n",
}


def _epilogues() -> list:
    return [stdlib.get(name) for name in NAMES] + [compile_eta(source) for source in EXTRA.values()]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_rendered_cuda_compiles_with_nvrtc(arch: str) -> None:
    try:
        nvrtc = Nvrtc()
        nvrtc.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC is not available: {exc}")
    epilogues = _epilogues()
    rendered = render_many(epilogues, "cuda")
    ptx = nvrtc.compile(rendered[0].source, "eta", arch)["ptx"].decode()
    for kernel in rendered:
        assert f".entry {kernel.entry_point}(" in ptx


def test_rendered_hip_compiles_with_hiprtc() -> None:
    try:
        hiprtc = Hiprtc()
        hiprtc.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"hiprtc is not available: {exc}")
    rendered = render_many(_epilogues(), "hip")
    code = hiprtc.compile(rendered[0].source, "eta", "gfx90a")["code_object"]
    for kernel in rendered:
        assert kernel.entry_point.encode() + b".kd" in code


def _inputs(name: str, rng: np.random.Generator, rows: int, cols: int) -> dict:
    epilogue = stdlib.get(name) if name in stdlib.SOURCES else compile_eta(EXTRA[name])
    values: dict = {}
    for declared in epilogue.inputs:
        shape = {"rows,cols": (rows, cols), "cols": (cols,), "rows": (rows,)}[declared.shape.value]
        values[declared.name] = rng.standard_normal(shape).astype(np.float32)
    for param in epilogue.params:
        values[param.name] = {"eps": 1e-5, "temperature": 0.7, "cap": 3.0, "alpha": 1.5, "limit": 1.0}[param.name]
    return values


@pytest.mark.parametrize("name", NAMES + sorted(EXTRA))
def test_epilogues_run_on_the_emulator_like_numpy(emulated_device: Device, name: str) -> None:
    """Through the catalogue kernel: tensors positional, params fixed at compile time, the first output."""
    rng = np.random.default_rng(len(name))
    source = stdlib.SOURCES.get(name) or EXTRA[name]
    epilogue = compile_eta(source)
    for rows, cols in ((3, 40), (2, 300)):  # 300 columns: more than one pass of a 256-thread block
        values = _inputs(name, rng, rows, cols)
        params = tuple((p.name, values[p.name]) for p in epilogue.params)
        want = epilogue.numpy_fn()(**values)[epilogue.outputs[0].name]
        launch = emulated_device.compile("epilogue", source=source, params=params)
        got = emulated_device.download(launch(*(emulated_device.upload(values[s.name]) for s in epilogue.inputs)))
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=2e-5, atol=2e-5, err_msg=name)


def test_every_output_of_a_program_is_computed(emulated_device: Device) -> None:
    epilogue = compile_eta(EXTRA["clip_count"])
    request = KernelRequest("epilogue", "eta", (("source", EXTRA["clip_count"]), ("params", (("limit", 1.0),))))
    kernel = EpilogueKernel(engine.backend(emulated_device.info), request)
    x = np.random.default_rng(5).standard_normal((3, 70)).astype(np.float32)
    outputs = dict(zip((spec.name for spec in epilogue.outputs), kernel(emulated_device.upload(x)), strict=True))
    expected = epilogue.numpy_fn()(x=x, limit=1.0)
    assert set(outputs) == set(expected) == {"y", "n"}
    for name, want in expected.items():
        got = emulated_device.download(outputs[name])
        np.testing.assert_allclose(got, np.broadcast_to(want, got.shape), rtol=2e-5, atol=2e-5, err_msg=name)


def test_a_missing_tensor_is_a_clear_error(emulated_device: Device) -> None:
    launch = emulated_device.compile("epilogue", source=stdlib.SOURCES["residual_add"], params=())
    with pytest.raises(TypeError, match=r"takes 2 tensors \(x, residual\), not 1"):
        launch(emulated_device.upload(np.zeros((2, 3), np.float32)))


def test_an_input_of_the_wrong_shape_or_type_is_refused_before_it_reaches_the_device(emulated_device: Device) -> None:
    """A weight longer than x's rows would be read past x's end on the device; one of ints, as floats."""
    launch = emulated_device.compile("epilogue", source=stdlib.SOURCES["rms_norm"], params=(("eps", 1e-6),))
    x = emulated_device.upload(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"'weight' has shape \(5,\), expected \(3,\)"):
        launch(x, emulated_device.upload(np.ones(5, np.float32)))
    with pytest.raises(ValueError, match="'weight' is int32, not float32"):
        launch(x, emulated_device.upload(np.ones(3, np.int32)))


def test_the_plan_source_of_an_epilogue_is_its_rendered_cuda(emulated_device: Device) -> None:
    source = emulated_device.source(KernelRequest("epilogue", None, (("source", stdlib.SOURCES["silu_mul"]),)))
    assert source is not None and "__global__" in source
