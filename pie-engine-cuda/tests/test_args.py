"""Argument packing: the ctypes structs derived from args.cuh match it, and a mismatch cannot compile."""

from __future__ import annotations

import ctypes
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
from pie_engine_cuda import args as kernel_args
from pie_engine_cuda.api import kernel_params
from pie_engine_cuda.args import ARG_STRUCTS, STRUCTS, layout_asserts, parse_structs
from pie_engine_cuda.compiler import Hiprtc, KernelCompileError, Nvrtc
from pie_engine_cuda.sources import COMPAT_HEADERS, read_source

GemmArgs = STRUCTS["GemmArgs"]

C_TYPES = {ctypes.c_uint64: "pointer", ctypes.c_int64: "long long", ctypes.c_int32: "int", ctypes.c_float: "float"}


def _struct_source(backend: str, structs: tuple[type[ctypes.Structure], ...]) -> str:
    files = (COMPAT_HEADERS[backend], "common.cuh", "args.cuh")
    return "\n".join(read_source(name) for name in files) + layout_asserts(structs)


def _declared_fields(name: str) -> list[tuple[str, str]]:
    """(C type, field) of a struct in args.cuh, in order."""
    text = read_source("args.cuh")
    body = text[text.index(f"struct {name} {{") :].split("};", 1)[0].splitlines()[1:]
    fields = []
    for line in body:
        declaration = line.split("//")[0].strip().rstrip(";")
        if declaration:
            ctype, field = declaration.rsplit(" ", 1)
            fields.append(("pointer" if ctype.endswith("*") or field.startswith("*") else ctype, field.lstrip("*")))
    return fields


def _tampered() -> type[ctypes.Structure]:
    """GemmArgs with `rows` and `n` swapped: same size, different offsets."""
    fields = list(GemmArgs._fields_)
    i, j = [k for k, (name, _) in enumerate(fields) if name in ("rows", "n")]
    fields[i], fields[j] = fields[j], fields[i]
    return type("GemmArgs", (ctypes.Structure,), {"_fields_": fields})


@pytest.mark.parametrize("struct_type", ARG_STRUCTS, ids=lambda s: s.__name__)
def test_each_mirror_lists_the_c_fields_in_order_with_their_types(struct_type: type[ctypes.Structure]) -> None:
    declared = _declared_fields(struct_type.__name__)
    mirrored = [(C_TYPES[ctype], name) for name, ctype in struct_type._fields_]
    assert mirrored == [("pointer" if t.endswith("*") else t, n) for t, n in declared]
    assert ctypes.sizeof(struct_type) % 8 == 0, "structs end on an 8-byte boundary (no tail surprises)"


def test_every_struct_in_the_header_has_a_mirror() -> None:
    import re

    in_header = set(re.findall(r"^struct (\w+) \{", read_source("args.cuh"), re.MULTILINE))
    assert in_header == {s.__name__ for s in ARG_STRUCTS}
    assert set(kernel_args.STRUCTS) == in_header


def test_the_parser_reads_comments_and_spacing_and_refuses_a_field_type_it_does_not_know() -> None:
    header = "struct OkArgs {\n  const float *x;  // a pointer\n  long  long n;\n  int k; float eps;\n};\n"
    (ok,) = parse_structs(header).values()
    assert [(name, ctype) for name, ctype in ok._fields_] == [
        ("x", ctypes.c_uint64), ("n", ctypes.c_int64), ("k", ctypes.c_int32), ("eps", ctypes.c_float)]
    with pytest.raises(ValueError, match=r"BadArgs has a field this parser does not read: 'double d'"):
        parse_structs("struct BadArgs {\n  double d;\n};\n")


def test_packed_bytes_follow_the_declared_offsets() -> None:
    args = GemmArgs()
    args.x, args.w, args.out = 0x1000, 0x2000, 0x3000
    args.rows, args.n, args.k, args.paired, args.eps = 17, 160, 128, 1, 0.5
    raw = bytes(args)
    assert struct.unpack_from("<Q", raw, GemmArgs.x.offset)[0] == 0x1000
    assert struct.unpack_from("<Q", raw, GemmArgs.out.offset)[0] == 0x3000
    assert struct.unpack_from("<4if", raw, GemmArgs.rows.offset) == (17, 160, 128, 1, 0.5)
    assert GemmArgs.rows.offset == 8 * 8 and ctypes.sizeof(GemmArgs) == 8 * 8 + 5 * 4 + 4


def test_kernel_params_point_at_the_struct() -> None:
    args = GemmArgs()
    address, params = kernel_params(args)
    assert address == ctypes.addressof(params)
    assert params[0] == ctypes.addressof(args)


def test_layout_asserts_cover_every_field() -> None:
    text = layout_asserts()
    for struct_type in ARG_STRUCTS:
        assert f"sizeof({struct_type.__name__}) == {ctypes.sizeof(struct_type)}" in text
        for name, _ in struct_type._fields_:
            offset = getattr(struct_type, name).offset
            assert f"PIE_OFFSETOF({struct_type.__name__}, {name}) == {offset}" in text


def test_nvrtc_rejects_a_mirror_that_differs_from_the_header() -> None:
    try:
        nvrtc = Nvrtc()
        nvrtc.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC is not available: {exc}")
    nvrtc.compile(_struct_source("cuda", ARG_STRUCTS), "args", "sm_90")
    with pytest.raises(KernelCompileError, match=r"GemmArgs\.rows: layout differs from args\.py"):
        nvrtc.compile(_struct_source("cuda", (_tampered(),)), "args", "sm_90")


def test_hiprtc_rejects_a_mirror_that_differs_from_the_header() -> None:
    try:
        hiprtc = Hiprtc()
        hiprtc.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"hiprtc is not available: {exc}")
    with pytest.raises(KernelCompileError, match=r"GemmArgs\.rows: layout differs from args\.py"):
        hiprtc.compile(_struct_source("hip", (_tampered(),)), "args", "gfx90a")


def test_the_host_compiler_rejects_a_mirror_that_differs_from_the_header(tmp_path: Path) -> None:
    compiler = shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    for structs, ok in ((ARG_STRUCTS, True), ((_tampered(),), False)):
        source = tmp_path / "args.cpp"
        source.write_text(_struct_source("emulator", structs))
        result = subprocess.run([compiler, "-std=c++17", "-fsyntax-only", str(source)], capture_output=True, text=True, check=False)
        assert (result.returncode == 0) == ok, result.stderr
        if not ok:
            assert "GemmArgs.rows: layout differs from args.py" in result.stderr
