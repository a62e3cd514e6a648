"""Every target compiles (CUDA, HIP) or runs (OpenCL, WGSL, Metal as C++, JAX) a set of
programs that covers each operation, cast, shape and reduction, and agrees with numpy."""

from __future__ import annotations

import numpy as np
import pie.eta as eta
import pytest
from eta_harness import EDGES, Case, hiprtc_compile, nvrtc_compile, random_case
from pie.eta import stdlib

# PoCL reports clang warnings about users' own expressions (e.g. `x >= x`).
pytestmark = pytest.mark.filterwarnings("ignore::pyopencl.CompilerWarning")
COVERAGE = {
    "math": """in x: f32
        out a = exp(x); out b = exp2(x); out c = log(abs(x) + 0.5); out d = log2(abs(x) + 0.5)
        out e = sqrt(abs(x)) + rsqrt(abs(x) + 0.1); out f = tanh(x) + sin(x) + cos(x); out g = erf(x)""",
    "rounding": """in x: f32
        out a = floor(x); out b = ceil(x); out c = round(x * 2.0); out d = abs(x) + min(x, 0.25) - max(x, -0.25)
        out e = clamp(x, -1, 1); out f = sigmoid(x) + silu(x); out g = gelu(x) + gelu_tanh(x)""",
    "logic": """in x: f32; in z: f32
        out a = select(x > z && !(x < 0.0) || x == z, x, z)
        out b = f32(x != z) + f32(x >= z) * 2.0 + f32(x <= z) * 4.0; out c = f32(bool(floor(x)))""",
    "casts": """in x: f32
        out a = f32(f16(x * 1000.0)); out b = f32(bf16(x * 1000.0)); out c: i32 = i32(x * 1e9)
        out d: i32 = i32(x > 0.0); out e = f32(i32(x * 7.0)); out f = f32(f16(i32(x * 5000.0)))""",
    "edges": """in x: f32
        out a = f32(f16(x)); out b = f32(bf16(x)); out c: i32 = i32(x); out d = f32(bool(x))
        out e = min(x, 1.0) + max(x, -1.0); out f = f32(x == x)""",
    "integers": """in n: i32; in m: i32
        out a: i32 = n * m + 2147483647; out b: i32 = -n - m; out c: i32 = abs(n) + min(n, m) - max(n, m)
        out d: i32 = clamp(n, -3, 3) + select(n > m, n, m); out e: i32 = row_sum(n * m)
        out f: i32 = row_max(n) - row_min(m)""",
    "shapes": """in x: f32; in b: f32[cols]; in s: f32[rows]; param k: i32
        out a = x + b * s + f32(row * 1000 + col) + f32(rows - cols + k)""",
    "half_reductions": """in x: f32; let h = f16(x)
        out a = f32(row_sum(h)); out b = f32(row_mean(bf16(x))); out c = f32(row_max(h) - row_min(h))""",
    "layer_norm": """in x: f32; in w: f32[cols]; in b: f32[cols]; param eps: f32
        let mu = row_mean(x); let d = x - mu
        out y = d * rsqrt(row_mean(d * d) + eps) * w + b; out z = row_sum(row_max(x) - x)""",
    "params": """in x: f32; param h: f16; param bf: bf16; param on: bool; param n: i32
        out a = f32(f16(x) * h) + f32(bf16(x) + bf) + select(on, 1.0, 0.0) + f32(n)""",
    "causal_softmax": """in x: f32
        let masked = select(col > row, -inf, x)
        let e = exp(masked - row_max(masked))
        out y = e / row_sum(e); out lse = row_max(masked) + log(row_sum(e))""",
    "names": """in x: f32; in n: i32; param self: f32
        out a = x * self; out b: i32 = n + -2147483648; out c: i32 = max(n, -2147483648) - 1""",
}
EPILOGUES = [eta.compile(source) for source in COVERAGE.values()] + [stdlib.get(name) for name in stdlib.SOURCES]


def cases() -> list[Case]:
    rng = np.random.default_rng(7)
    out = []
    for ep in EPILOGUES:
        out += [random_case(ep, 3, 300, rng), random_case(ep, 2, 5, rng)]
    edges = EPILOGUES[list(COVERAGE).index("edges")]
    out.append(Case(edges, {"x": np.tile(EDGES, (2, 1))}, {}, (2, len(EDGES))))
    return out


CASES = cases()


def assert_agrees(got: dict[str, np.ndarray], case: Case, finite_only: bool = False) -> None:
    """Outputs equal numpy's: integers exactly, floats to 2e-5 relative (NaN == NaN).

    finite_only: compare only columns whose inputs are finite normal numbers (WGSL makes
    no promise about NaN, infinity or subnormals)."""
    want = case.reference()
    keep = np.ones(case.shape, bool)
    if finite_only:
        for value in case.inputs.values():
            if value.dtype == np.float32 and value.ndim == 2:
                keep &= np.isfinite(value) & ((np.abs(value) >= np.finfo(np.float32).tiny) | (value == 0))
    for name, expected in want.items():
        actual = got[name]
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, name
        if expected.dtype == np.int32:
            bad = actual != expected
        else:
            bad = ~np.isclose(actual, expected, rtol=2e-5, atol=1e-6, equal_nan=True)
            if finite_only:
                bad &= np.isfinite(expected)
        bad &= keep
        assert not bad.any(), f"{case.epilogue.entry_point} {name}: got {actual[bad][:5]}, want {expected[bad][:5]}"


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("cubin", [False, True], ids=["ptx", "cubin"])
def test_cuda_compiles_with_nvrtc(arch: str, cubin: bool) -> None:
    code = nvrtc_compile(eta.render_many(EPILOGUES, "cuda")[0].source, arch, cubin)
    assert code.startswith(b"\x7fELF") if cubin else b".target " + arch.encode() in code
    assert all(ep.entry_point.encode() in code for ep in EPILOGUES)


def test_hip_compiles_with_hiprtc() -> None:
    code = hiprtc_compile(eta.render_many(EPILOGUES, "hip")[0].source, "gfx90a")
    assert code.startswith(b"\x7fELF") or code.startswith(b"__CLANG_OFFLOAD_BUNDLE__")
    assert all(ep.entry_point.encode() in code for ep in EPILOGUES)


def run_all(runner, target: str, finite_only: bool = False) -> None:
    kernels = {k.entry_point: k for k in eta.render_many(EPILOGUES, target)}
    program = runner.build(list(kernels.values()))
    for case in CASES:
        assert_agrees(runner.run(program, kernels[case.epilogue.entry_point], case), case, finite_only)


def test_opencl_runs_on_pocl(opencl) -> None:
    run_all(opencl, "opencl")


def test_wgsl_runs_on_lavapipe(webgpu) -> None:
    run_all(webgpu, "wgsl", finite_only=True)


def test_metal_compiles_and_runs_as_cpp(metal) -> None:
    run_all(metal, "metal")


def test_jax_agrees_with_numpy() -> None:
    for case in CASES[::2]:
        got = case.epilogue.jax_fn()(**case.inputs, **case.params)
        assert_agrees({k: np.asarray(v) for k, v in got.items()}, case)


def test_metal_runs_a_module_without_row_reductions(metal) -> None:
    """The suite batches every epilogue into one module; one without reductions has no threadgroups."""
    ep = eta.compile("in x: f32; out y = exp(x) * 2.0")
    kernel = ep.render("metal")
    case = random_case(ep, 3, 300, np.random.default_rng(5))
    assert_agrees(metal.run(metal.build([kernel]), kernel, case), case)


@pytest.mark.parametrize("target", ["opencl", "wgsl"])
def test_grids_past_65535_workgroups_use_y(target: str, opencl, webgpu) -> None:
    runner = {"opencl": opencl, "wgsl": webgpu}[target]
    ep = eta.compile("in x: f32; out y = x - row_max(x) + f32(row)")
    kernel = ep.render(target)
    rows = 65_600
    assert kernel.bindings.groups(rows, 2) == (65_535, 2)
    case = random_case(ep, rows, 2, np.random.default_rng(0))
    assert_agrees(runner.run(runner.build([kernel]), kernel, case), case)


@pytest.mark.parametrize("name", ["rms_norm", "silu_mul", "bias_add"])
def test_outputs_may_overwrite_their_input(name: str, opencl) -> None:
    """In place: y written over x's buffer (or gate's) gives the same result."""
    ep = stdlib.get(name)
    kernel = ep.render("opencl")
    case = random_case(ep, 3, 700, np.random.default_rng(3))
    got = opencl.run(opencl.build([kernel]), kernel, case, in_place={"y": ep.inputs[0].name})
    np.testing.assert_allclose(got["y"], case.reference()["y"], rtol=2e-5, atol=1e-6)
