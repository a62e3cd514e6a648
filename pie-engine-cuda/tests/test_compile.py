"""Every kernel compiles for GPUs this machine does not have: NVRTC for sm_80 and sm_90 (PTX and
CUBIN), hiprtc for gfx90a (CDNA, 64-lane wavefronts) and gfx1030 (RDNA, 32 lanes). One program per
compile unit keeps it quick."""

from __future__ import annotations

import re
import os
import subprocess
import sys
import textwrap
from functools import cache
from pathlib import Path

import pytest
from cubin_info import kernel_resources
from pie_engine_cuda import launch
from pie_engine_cuda.compiler import Hiprtc, KernelCompileError, Nvrtc
from pie_engine_cuda.launchers import UNIT_OF_KERNEL, Projection, kernel_listing
from pie_engine_cuda.runtime import BLOCK_DTYPES, DTYPE_SUFFIX, WEIGHT_SUFFIX
from pie_engine_cuda.sources import UNITS, read_source, unit_source

CUDA_ARCHS = ("sm_80", "sm_90")
HIP_ARCHS = ("gfx90a", "gfx1030")
ELF_MAGIC = b"\x7fELF"


def declared_kernels(unit: str) -> list[str]:
    return [name for file in UNITS[unit] for name in re.findall(r"PIE_KERNEL(?:_BLOCKS)?\((\w+),", read_source(file))]


@pytest.fixture(scope="module")
def nvrtc() -> Nvrtc:
    try:
        compiler = Nvrtc()
        compiler.version  # noqa: B018 - loads the library
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC is not available: {exc} (pip install cuda-python nvidia-cuda-nvrtc)")
    return compiler


@pytest.fixture(scope="module")
def hiprtc() -> Hiprtc:
    try:
        compiler = Hiprtc()
        compiler.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"hiprtc is not available: {exc} (apt-get install libamdhip64-dev)")
    return compiler


@cache
def _cuda_artifacts(arch: str, unit: str) -> dict[str, bytes]:
    return Nvrtc().compile(unit_source(unit, "cuda"), unit, arch)


@cache
def _hip_artifacts(unit: str, arch: str = HIP_ARCHS[0]) -> dict[str, bytes]:
    return Hiprtc().compile(unit_source(unit, "hip"), unit, arch)


@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_nvrtc_builds_ptx_and_cubin_with_every_kernel(nvrtc: Nvrtc, arch: str, unit: str) -> None:
    artifacts = _cuda_artifacts(arch, unit)
    ptx = artifacts["ptx"].decode()
    cubin = artifacts["cubin"]
    assert f".target {arch}" in ptx
    assert cubin.startswith(ELF_MAGIC)
    kernels = declared_kernels(unit)
    assert kernels, f"unit {unit} declares no kernel"
    for name in kernels:
        assert re.search(rf"\.entry {name}\(", ptx), f"{name} missing from the {arch} PTX"
        assert name.encode() in cubin, f"{name} missing from the {arch} CUBIN"


@pytest.mark.parametrize("unit", list(UNITS))
@pytest.mark.parametrize("arch", HIP_ARCHS)
def test_hiprtc_builds_an_amd_code_object(hiprtc: Hiprtc, arch: str, unit: str) -> None:
    code = _hip_artifacts(unit, arch)["code_object"]
    assert code.startswith(ELF_MAGIC)
    for name in declared_kernels(unit):
        present = name.encode() + b".kd" in code
        # The tensor-core GEMM is NVIDIA-only (mma.sync); everything else must be there.
        assert present != name.startswith("pie_gemm_tc_"), name


_GATHERS = tuple(f"pie_gather_{suffix}" for suffix in WEIGHT_SUFFIX.values())
_FIXED_ENTRY_POINTS = {
    "embedding": _GATHERS,
    "gather_rows": _GATHERS,
    "rms_norm": ("pie_rms_norm",),
    "rms_norm_heads": ("pie_rms_norm",),
    "add": ("pie_add",),
    "slice_columns": ("pie_slice_columns",),
    "silu_mul": ("pie_silu_mul",),
    "rope": ("pie_rope",),
    "append_kv": ("pie_append_kv",),
    "argmax": ("pie_argmax",),
    "softmax": ("pie_softmax",),
    "top_k": ("pie_top_k",),
}
_ATTENTION_ENTRY_POINTS = {
    "decode": ("pie_attention_decode",),
    "split_kv": ("pie_attention_split", "pie_attention_merge"),
    "prefill": ("pie_attention_prefill",),
}


def entry_points(kernel: str, variant: str, tensor_cores: bool) -> tuple[str, ...]:
    """The compiled kernel functions a catalogue kernel's variant may launch (for every weight type): what
    the units must declare for the launchers to bind."""
    if kernel in _FIXED_ENTRY_POINTS:
        return _FIXED_ENTRY_POINTS[kernel]
    if kernel == "epilogue":
        return ()  # generated per program
    if kernel == "attention":
        return _ATTENTION_ENTRY_POINTS[variant]
    names = tuple(f"{Projection.KERNEL_NAMES[variant]}_{suffix}" for suffix in DTYPE_SUFFIX.values())
    block = "tiled" if variant == "tc" else variant  # tc runs block types tiled
    names += tuple(f"{Projection.KERNEL_NAMES[block]}_{dtype}" for dtype in BLOCK_DTYPES)
    converts = tuple(f"pie_convert_{suffix}" for dtype, suffix in DTYPE_SUFFIX.items() if dtype != "float32")
    return names + converts


@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_every_catalogue_kernel_and_variant_has_its_cuda_functions(nvrtc: Nvrtc, arch: str) -> None:
    for kernel, variants in kernel_listing(tensor_cores=True).items():
        for variant in variants:
            for name in entry_points(kernel, variant, tensor_cores=True):
                units = [u for u in UNITS if name in declared_kernels(u)]
                assert units, f"{kernel}[{variant}] launches {name}, which no unit declares"
                assert re.search(rf"\.entry {name}\(", _cuda_artifacts(arch, units[0])["ptx"].decode())
        assert kernel == "epilogue" or UNIT_OF_KERNEL[kernel] in UNITS  # an epilogue's module is generated


@pytest.mark.parametrize("arch", CUDA_ARCHS)
def test_the_tensor_core_gemm_fits_two_blocks_per_multiprocessor(nvrtc: Nvrtc, arch: str) -> None:
    """65536 registers per multiprocessor hold two 256-thread blocks at 128 registers a thread. One
    more register and an H200 ran one block per multiprocessor: 4096-row GEMMs took 28% longer."""
    resources = kernel_resources(_cuda_artifacts(arch, "gemm")["cubin"])
    for suffix in ("f32", "f16", "bf16"):
        used = resources[f"pie_gemm_tc_{suffix}"]
        assert used.registers * launch.TC_THREADS * 2 <= 65536, (suffix, used)
    assert resources["pie_gemm_tc_f32"].frame_bytes == 0, "float32 tensor-core GEMM spills"
    assert 0 < resources["pie_gemv_f32"].registers <= 255


def test_every_catalogue_kernel_and_variant_has_its_hip_functions(hiprtc: Hiprtc) -> None:
    for kernel, variants in kernel_listing(tensor_cores=False).items():
        assert "tc" not in variants
        for variant in variants:
            for name in entry_points(kernel, variant, tensor_cores=False):
                unit = next(u for u in UNITS if name in declared_kernels(u))
                assert name.encode() + b".kd" in _hip_artifacts(unit)["code_object"], f"{kernel}[{variant}]: {name}"


def test_nvrtc_picks_a_cubin_for_known_gpus_and_ptx_for_newer_ones(nvrtc: Nvrtc) -> None:
    assert nvrtc.target(90) == "sm_90"
    assert nvrtc.target(80) == "sm_80"
    newest = max(nvrtc.supported_archs)
    assert nvrtc.target(newest + 1) == f"compute_{newest}"
    with pytest.raises(RuntimeError, match="cannot compile for compute capability"):
        nvrtc.target(min(nvrtc.supported_archs) - 1)


def test_a_compile_error_carries_the_log(nvrtc: Nvrtc) -> None:
    source = unit_source("core", "cuda") + "\nPIE_KERNEL(pie_broken, BinaryArgs, 256) { undefined_name(args); }\n"
    with pytest.raises(KernelCompileError, match="undefined_name") as caught:
        nvrtc.compile(source, "core", "sm_90")
    assert "sm_90" in str(caught.value)


def test_a_clean_compile_leaves_the_interpreters_bytes_alone(nvrtc: Nvrtc) -> None:
    """A compile without warnings has a log of one byte (its NUL). Read into ``b" " * 1``, that is CPython's
    one shared ``b" "``: NVRTC wrote NUL over it and every space byte in the process read as NUL after."""
    artifacts = nvrtc.compile('extern "C" __global__ void pie_empty() {}', "empty", "sm_90")
    assert artifacts["ptx"].startswith(b"//") and artifacts["cubin"].startswith(ELF_MAGIC)
    space = bytes([32])[:1]  # made at run time, so not the constant under test
    assert b" " == space and b"a b".split(b" ") == [b"a", b"b"]


def test_hiprtc_through_hip_python_when_it_finds_the_library(tmp_path: Path) -> None:
    """hip-python opens libhiprtc.so by name; with ROCm 5's libamdhip64 behind that name (the CI symlink
    some setups use) the library hip-python finds is the one loaded, and it compiles."""
    pytest.importorskip("hip", reason="hip-python is not installed (pip install 'pie-engine-cuda[rocm]')")
    from pie_engine_cuda.hiprtc_lib import candidate_libraries, exports_hiprtc

    library = next((path for path in candidate_libraries() if exports_hiprtc(path)), None)
    if library is None:
        pytest.skip("no library exporting hiprtc (apt-get install libamdhip64-dev)")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libhiprtc.so").symlink_to(library)
    script = textwrap.dedent(
        """
        from pie_engine_cuda.hiprtc_lib import load_hiprtc
        rtc = load_hiprtc()
        code, log = rtc.compile('extern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.0f; }', "k.cu",
                                ("--offload-arch=gfx90a",))
        assert code is not None and code[:4] == b"\\x7fELF", log
        print(rtc.origin)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], env={"ROCM_PATH": str(tmp_path), "PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "lib" / "libhiprtc.so")


def test_without_libhiprtc_the_library_exporting_hiprtc_is_loaded_directly() -> None:
    from pie_engine_cuda.hiprtc_lib import (
        CtypesRtc,
        exports_hiprtc,
        hip_python_hiprtc,
        load_hiprtc,
    )

    found = hip_python_hiprtc()
    if found is not None and exports_hiprtc(found):
        pytest.skip("this system has a libhiprtc.so that hip-python finds")
    try:
        rtc = load_hiprtc()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    assert isinstance(rtc, CtypesRtc)
    assert "libamdhip64" in rtc.origin or "libhiprtc" in rtc.origin
