"""The .metal sources themselves: they compile as C++ against the shim, avoid what only C++ allows,
and match the host's binding table (pie_engine_metal.library) argument by argument."""

from __future__ import annotations

import re
import subprocess

import pytest
from msl_emulator import build, msl
from pie import kernels

from pie_engine_metal import launchers, library

LIBRARIES = tuple(library.CONSTANTS)


@pytest.mark.parametrize("name", LIBRARIES)
def test_source_compiles_as_cxx14_without_warnings(name: str, tmp_path) -> None:
    unit = tmp_path / f"{name}.cpp"
    unit.write_text(build.translation_unit(name, library.source(name)))
    flags = [f for f in build.FLAGS if f not in ("-shared", "-O2")]
    result = subprocess.run(
        [build.CXX, *flags, "-fsyntax-only", "-I", str(build.INCLUDE), str(unit)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("name", LIBRARIES)
def test_source_uses_only_metal_constructs(name: str) -> None:
    assert msl.problems(msl.parse(library.source(name))) == []


def test_lint_catches_what_cxx_would_accept() -> None:
    bad = """
    #include <metal_stdlib>
    kernel void k(device float* out [[buffer(2)]], float* raw [[buffer(0)]], uint i [[thread_position_in_grid]],
                  uint2 g [[threadgroup_position_in_grid]], uint j [[thread_index_in_quadgroup]]) {
        double d = 1.5;
        out[i] = std::exp(d);
    }
    """
    found = "\n".join(msl.problems(msl.parse(bad)))
    for expected in (
        "no double",
        "standard library",
        "without f",
        "buffer indices [0, 2]",
        "no address space",
        "mix types",
        "unknown attribute",
    ):
        assert expected in found, (expected, found)


def _parsed() -> dict[str, msl.Source]:
    return {name: msl.parse(library.source(name)) for name in LIBRARIES}


def test_every_kernel_in_the_sources_is_in_the_host_table_and_back() -> None:
    in_sources = {(name, kernel) for name, source in _parsed().items() for kernel in source.kernels}
    in_table = {(f.library, f.name) for f in library.FUNCTIONS.values()}
    assert in_sources == in_table


@pytest.mark.parametrize("function", sorted(library.FUNCTIONS))
def test_host_binding_matches_the_kernel_signature(function: str) -> None:
    spec = library.FUNCTIONS[function]
    source = _parsed()[spec.library]
    kernel = source.kernels[function]
    buffers = kernel.buffers
    # Arrays first, in the host's order, then the params struct at the next index.
    assert tuple(p.name for p in buffers[: spec.params_index]) == spec.buffers
    params = buffers[spec.params_index]
    assert len(buffers) == spec.params_index + 1
    assert params.address_space == "constant" and params.c_type.endswith("&")
    struct_name = params.c_type.rstrip("&").strip()
    fields = source.structs[struct_name]
    assert tuple(name for _, name in fields) == spec.params
    assert {kind for kind, _ in fields} == {"uint"}, "the host packs every params field as a 32-bit uint"
    assert len(spec.pack(*range(len(spec.params)))) == 4 * len(fields)
    # Outputs are the only non-const device pointers (plus the pool that append_kv writes).
    writable = {p.name for p in buffers if p.address_space == "device" and "const" not in p.type}
    assert writable == ({"pool"} if function == "append_kv" else {"out"})


@pytest.mark.parametrize("function", sorted(library.FUNCTIONS))
def test_function_constants_match(function: str) -> None:
    spec = library.FUNCTIONS[function]
    source = _parsed()[spec.library]
    declared = {c.name: (c.index, c.type) for c in source.constants.values()}
    assert declared == {c.name: (c.index, c.kind) for c in library.CONSTANTS[spec.library].values()}
    assert source.constants_used(function) == set(spec.constants)
    assert source.uses_collectives(function) == spec.collective


def test_constant_values_are_complete_and_ordered() -> None:
    spec = library.FUNCTIONS["linear_tiled"]
    values = library.constant_values(
        spec, {"weight_type": 3, "has_residual": True, "gated": False, "has_norm": True, "has_bias": False}
    )
    assert [(c.index, c.name, v) for c, v in values] == [
        (0, "has_bias", False),
        (1, "has_norm", True),
        (2, "gated", False),
        (3, "has_residual", True),
        (4, "weight_type", 3),
    ]
    with pytest.raises(ValueError, match="missing"):
        library.constant_values(spec, {"has_bias": True})
    with pytest.raises(ValueError, match="unknown"):
        library.constant_values(library.FUNCTIONS["add"], {"eps": 1.0})


# eta epilogues (the `epilogue` kernel) are not compiled for Metal yet: they run on the CPU engine.
NOT_YET_ON_METAL = {"epilogue", "top_k"}
"""``top_k`` is optional: without it the facade selects on the host (``Device.top_tokens``)."""


def test_every_catalogue_kernel_has_an_msl_implementation() -> None:
    listed = launchers.variants(simdgroup_matrices=True)
    assert set(listed) == set(kernels.CATALOG) - NOT_YET_ON_METAL
    assert listed["linear"] == ("simdgroup", "tiled", "gemv")
    assert launchers.variants(simdgroup_matrices=False)["rms_norm_linear"] == ("tiled", "gemv")


def test_threadgroup_arrays_become_shared_statics() -> None:
    text = "    threadgroup float keys[32][129];\n    threadgroup float* p = keys[0];\nf(threadgroup float* x);"
    rewritten = build.shared_storage(text)
    assert rewritten.startswith("    static float keys[32][129]; pie_emu::fresh_shared(keys, sizeof(keys));")
    assert "threadgroup float* p" in rewritten and "f(threadgroup float* x)" in rewritten


def _evaluate(expression: str, defines: dict[str, str]) -> int:
    """An array dimension: sums of products of numbers and #defines."""
    total = 0
    for term in expression.split("+"):
        product = 1
        for factor in term.split("*"):
            factor = factor.strip()
            product *= int(defines.get(factor, factor))
        total += product
    return total


def test_threadgroup_memory_fits_32_kib() -> None:
    """Metal guarantees 32 KiB of threadgroup memory; count what each kernel declares."""
    sizes = {"float": 4, "uint": 4, "int": 4}
    for name, source in _parsed().items():
        defines = dict(re.findall(r"#define\s+(\w+)\s+(\d+)", source.text))
        for kernel in source.kernels.values():
            total = 0
            for kind, dims in re.findall(r"threadgroup\s+(\w+)\s+\w+((?:\[[^\]]+\])+)\s*;", kernel.body):
                count = 1
                for dim in re.findall(r"\[([^\]]+)\]", dims):
                    count *= _evaluate(dim, defines)
                total += count * sizes[kind]
            assert total <= 32 * 1024, f"{name}.{kernel.name}: {total} bytes of threadgroup memory"
