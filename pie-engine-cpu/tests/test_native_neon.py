"""The native kernels' ARM paths, run where no ARM machine is: native.c cross-built for aarch64 with and without
sdot (``-march=armv8.2-a+dotprod`` and ``-march=armv8-a``), linked with ``neon_driver.c`` and run under
qemu-user. Each stored weight type on every activation path, against the `gguf` library's dequantization times
the activations, with the shapes and tolerances of the x86 tests of the same kernels (test_stored_weights.py,
test_k_quants.py); and each type's rows dequantized exactly."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import test_k_quants
import test_stored_weights
from pie.testing.kquants import random_blocks
from pie.weights import StoredWeight
from pie_engine_cpu import native
from test_stored_weights import _integer_activations, _reference_dequantized

SYSROOT = Path("/usr/aarch64-linux-gnu")
"""Debian's aarch64 libraries (libc6-arm64-cross), where qemu-user finds the driver's loader."""
BUILDS = {"sdot": "armv8.2-a+dotprod", "neon": "armv8-a"}
"""Each build's -march: the second has NEON but no dot-product instructions (the vmull_s8 path)."""
DRIVER = Path(__file__).with_name("neon_driver.c")
ACTIVATIONS = ("float", "int8", "int16")


@dataclass(frozen=True)
class Case:
    weight_type: str
    activations: str
    rows: int
    cols: int
    tokens: int
    scalar: bool = False
    """The portable loops, forced as the x86 tests force them (pie_quant_config's ``scalar``)."""


# Each module's types and shapes (odd row counts, odd block counts, 1-4 tokens as the integer paths' constant
# token counts, more than MAX_TOKENS), and 2 and 4 tokens besides; the portable loops at one shape.
FLOAT_TYPES = ("f16", "bf16")
CONVERTED_TYPES = ("q8_0", "q4_0", "q4_1")
RANDOM_BLOCK_TYPES = ("q5_0", "q4_k", "q5_k", "q6_k")
CONVERTED_SHAPES = (*test_stored_weights.SHAPES, (11, 64, 2), (6, 128, 4))
RANDOM_BLOCK_SHAPES = (*test_k_quants.SHAPES, (11, 256, 2), (6, 512, 4))
CASES = [
    *(Case(t, "float", *s) for t in FLOAT_TYPES for s in CONVERTED_SHAPES),
    *(Case(t, a, *s) for t in CONVERTED_TYPES for a in ACTIVATIONS for s in CONVERTED_SHAPES),
    *(Case(t, a, *s) for t in RANDOM_BLOCK_TYPES for a in ACTIVATIONS for s in RANDOM_BLOCK_SHAPES),
    *(Case(t, a, *CONVERTED_SHAPES[1], scalar=True) for t in CONVERTED_TYPES for a in ACTIVATIONS[1:]),
    *(Case(t, a, *RANDOM_BLOCK_SHAPES[1], scalar=True) for t in RANDOM_BLOCK_TYPES for a in ACTIVATIONS[1:]),
]


def _weight(case: Case, rng: np.random.Generator) -> StoredWeight:
    """Weights as the x86 tests of the same type make them: quantized from floats, or random valid blocks."""
    if case.weight_type in RANDOM_BLOCK_TYPES:
        return random_blocks(rng, case.weight_type, case.rows, case.cols)
    return test_stored_weights._weight(rng, case.weight_type, case.rows, case.cols)


def _inputs(case: Case) -> tuple[StoredWeight, np.ndarray]:
    rng = np.random.default_rng(case.rows * case.cols + case.tokens + ACTIVATIONS.index(case.activations))
    return _weight(case, rng), rng.standard_normal((case.tokens, case.cols)).astype(np.float32)


@dataclass(frozen=True)
class Toolchain:
    compiler: str
    objdump: str
    runner: tuple[str, ...]
    """What runs an aarch64 program here: qemu-user with the sysroot."""


def _toolchain() -> Toolchain:
    """Debian's aarch64 cross toolchain and qemu-user, or a skip saying what is missing. (On an ARM machine the
    native build's own tests, test_stored_weights.py and test_k_quants.py, run these kernels too.)"""
    compiler = shutil.which("aarch64-linux-gnu-gcc")
    objdump, qemu = shutil.which("aarch64-linux-gnu-objdump"), shutil.which("qemu-aarch64")
    missing = [name for name, found in (
        ("aarch64-linux-gnu-gcc (gcc-aarch64-linux-gnu)", compiler),
        ("aarch64-linux-gnu-objdump (binutils-aarch64-linux-gnu)", objdump),
        ("qemu-aarch64 (qemu-user)", qemu),
        (f"{SYSROOT}/include (libc6-dev-arm64-cross)", (SYSROOT / "include" / "stdio.h").exists() or None),
    ) if not found]
    if missing:
        pytest.skip(f"the ARM NEON kernels cannot be built and run here: missing {', '.join(missing)} "
                    "(noxfile.py SYSTEM_PACKAGES installs them in CI)")
    assert compiler and objdump and qemu
    return Toolchain(compiler, objdump, (qemu, "-L", str(SYSROOT)))


def _write_cases(path: Path) -> None:
    with path.open("wb") as out:
        for case in CASES:
            weight, x = _inputs(case)
            code = native.TYPE_CODES[case.weight_type]
            header = (code, native.ACTIVATIONS[case.activations], int(case.scalar), case.tokens, case.rows, case.cols)
            out.write(np.array(header, "<i8").tobytes() + weight.data.tobytes() + x.astype("<f4").tobytes())


@dataclass(frozen=True, repr=False)
class Result:
    vector_kernels: bool
    """pie_quant_config's answer: the build has vector integer kernels (NEON), not the portable loops only."""
    y: np.ndarray
    rows: np.ndarray


def _read_results(path: Path) -> dict[Case, Result]:
    data, at, results = path.read_bytes(), 0, {}
    for case in CASES:
        vector = int(np.frombuffer(data, "<i4", 1, at)[0])
        at += 4
        y = np.frombuffer(data, "<f4", case.tokens * case.rows, at).reshape(case.tokens, case.rows)
        at += y.nbytes
        rows = np.frombuffer(data, "<f4", case.rows * case.cols, at).reshape(case.rows, case.cols)
        at += rows.nbytes
        results[case] = Result(bool(vector), y, rows)
    assert at == len(data), f"the driver wrote {len(data) - at} bytes more than {len(CASES)} cases' results"
    return results


@dataclass(frozen=True)
class Run:
    results: dict[Case, Result] = field(repr=False)
    sdot_instructions: int


@pytest.fixture(scope="module", params=list(BUILDS))
def arm_build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """One build's results for every case: native.c with the engine's own flags (-march set, an executable
    instead of a shared library), one driver run over all cases."""
    tools = _toolchain()
    build = request.param
    folder = tmp_path_factory.mktemp(f"neon-{build}")
    flags = [f"-march={BUILDS[build]}" if f == "-march=native" else f for f in native.FLAGS if f != "-shared"]
    program = folder / "neon_driver"
    source = Path(native.__file__).with_name("native.c")
    compiled = subprocess.run([tools.compiler, *flags, str(source), str(DRIVER), "-o", str(program), "-lm"],
                              capture_output=True, text=True)
    assert compiled.returncode == 0, f"{tools.compiler} rejected native.c for {BUILDS[build]}:\n{compiled.stderr[-3000:]}"
    listing = subprocess.run([tools.objdump, "-d", str(program)], capture_output=True, text=True, check=True).stdout
    cases, results = folder / "cases.bin", folder / "results.bin"
    _write_cases(cases)
    ran = subprocess.run([*tools.runner, str(program), str(cases), str(results)], capture_output=True, text=True,
                         timeout=600)
    assert ran.returncode == 0, f"the driver failed ({ran.returncode}):\n{ran.stderr[-3000:]}"
    yield Run(_read_results(results), listing.count("\tsdot\t"))


def test_only_the_dotprod_build_has_sdot(arm_build: Run, request: pytest.FixtureRequest) -> None:
    build = request.node.callspec.params["arm_build"]
    if build == "sdot":
        assert arm_build.sdot_instructions > 0
    else:
        assert arm_build.sdot_instructions == 0
    assert all(result.vector_kernels for result in arm_build.results.values())


def _cases_of(weight_type: str) -> list[Case]:
    return [case for case in CASES if case.weight_type == weight_type]


@pytest.mark.parametrize("weight_type", (*FLOAT_TYPES, *CONVERTED_TYPES, *RANDOM_BLOCK_TYPES))
def test_projections_match_the_dequantized_weight(arm_build: Run, weight_type: str) -> None:
    for case in _cases_of(weight_type):
        weight, x = _inputs(case)
        dequantized, got = _reference_dequantized(weight), arm_build.results[case].y
        exact = x.astype(np.float64) @ dequantized.T
        scale = np.abs(exact).max()
        relative = weight_type in RANDOM_BLOCK_TYPES  # random blocks: sums in the hundreds, tolerances relative to them
        message = f"{case}"
        if case.activations == "float":
            np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-6 * scale if relative else 1e-5,
                                       err_msg=message)
            continue
        top, within = (127, 0.02) if case.activations == "int8" else (32767, 1e-4)
        np.testing.assert_allclose(got, _integer_activations(x, top) @ dequantized.T, rtol=1e-4,
                                   atol=1e-5 * scale if relative else 1e-4, err_msg=message)
        assert np.abs(got - exact).max() < within * scale, message


@pytest.mark.parametrize("weight_type", (*FLOAT_TYPES, *CONVERTED_TYPES, *RANDOM_BLOCK_TYPES))
def test_rows_dequantize_exactly(arm_build: Run, weight_type: str) -> None:
    for case in _cases_of(weight_type):
        np.testing.assert_array_equal(arm_build.results[case].rows, _reference_dequantized(_inputs(case)[0]),
                                      err_msg=f"{case}")
