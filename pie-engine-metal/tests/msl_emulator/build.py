"""Compile a ``.metal`` file with g++ against the shim, into a shared library of launch functions.

For every kernel the generated C++ adds ``pie_launch_<name>(buffers, lengths, launch, report)``,
which casts each bound buffer to the argument's type (checking that a ``constant``
struct fits in what was bound), passes the thread-position arguments the kernel
declares, and runs the grid through ``pie_emu::launch``. Libraries are cached by a hash
of everything that goes into them.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from msl_emulator.msl import GRID_ATTRIBUTES, Kernel, Source, parse

INCLUDE = Path(__file__).parent / "include"
CXX = os.environ.get("CXX", "g++")
# C++14 is the language Metal's C++ dialect is based on.
FLAGS = (
    "-std=c++14",
    "-O2",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-U_FORTIFY_SOURCE",
    "-D_FORTIFY_SOURCE=0",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-attributes",
    "-Wno-unused-parameter",
)

_THREADGROUP_ARRAY = re.compile(r"^(\s*)threadgroup(\s+[\w:]+\s+(\w+)\s*(?:\[[^\]\n]+\]\s*)+;)", re.M)


class CompileError(RuntimeError):
    pass


def shared_storage(source: str) -> str:
    """Threadgroup-scope arrays become ``static`` locals, shared by the threads of the running
    threadgroup and poisoned afresh for each threadgroup (see ``pie_emu::fresh_shared``)."""
    return _THREADGROUP_ARRAY.sub(r"\1static\2 pie_emu::fresh_shared(\3, sizeof(\3));", source)


def _argument(param_index: int, kernel: Kernel) -> tuple[str, str]:
    """(C++ expression passed for the argument, check emitted before the launch)."""
    param = kernel.params[param_index]
    index = param.buffer_index
    if index is not None:
        c_type = param.c_type
        if c_type.endswith("&"):
            base = c_type[:-1].strip()
            check = f"if (lens[{index}] < sizeof({base})) return pie_emu::params_too_small(R, {index});"
            return f"*reinterpret_cast<{base}*>(bufs[{index}])", check
        return f"reinterpret_cast<{c_type}>(bufs[{index}])", ""
    if param.attribute in GRID_ATTRIBUTES:
        return f"pie_emu::position<{param.type}>(id.{param.attribute})", ""
    return f"id.{param.attribute}", ""


def translation_unit(name: str, source: str) -> str:
    parsed = parse(source)
    lines = ["#include <metal_stdlib>", f'#line 1 "{name}.metal"', shared_storage(source), '#line 1 "launchers"']
    for kernel in parsed.kernels.values():
        arguments, checks = zip(*(_argument(i, kernel) for i in range(len(kernel.params))), strict=True)
        lines += [
            f'extern "C" int pie_launch_{kernel.name}(void* const* bufs, const unsigned long long* lens,',
            "                                 const pie_emu::Launch* L, pie_emu::Report* R) {",
            *(f"    {check}" for check in checks if check),
            "    std::function<void(const pie_emu::Ids&)> body = [&](const pie_emu::Ids& id) {",
            f"        {kernel.name}({', '.join(arguments)});",
            "    };",
            "    return pie_emu::launch(L, R, body);",
            "}",
        ]
    return "\n".join(lines) + "\n"


def _cache_dir() -> Path:
    root = os.environ.get("PIE_METAL_EMULATOR_CACHE") or os.path.join(
        tempfile.gettempdir(), f"pie-metal-emulator-{os.getuid()}"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _compiler_version() -> str:
    return subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True).stdout


def compile_library(name: str, source: str) -> Path:
    """The path of the shared library for ``source`` (compiled now unless cached)."""
    unit = translation_unit(name, source)
    digest = hashlib.sha256()
    for part in (unit, " ".join(FLAGS), _compiler_version(), *(p.read_text() for p in sorted(INCLUDE.iterdir()))):
        digest.update(part.encode())
    target = _cache_dir() / f"{name}-{digest.hexdigest()[:20]}.so"
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as scratch:
        unit_path = Path(scratch) / f"{name}.cpp"
        unit_path.write_text(unit)
        output = Path(scratch) / "out.so"
        result = subprocess.run(
            [CXX, *FLAGS, "-I", str(INCLUDE), str(unit_path), "-o", str(output)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise CompileError(f"{name}.metal does not compile as C++ against the shim:\n{result.stderr[-6000:]}")
        os.replace(output, target)  # atomic, so concurrent test runs never load half a file
    return target


@dataclass
class Library:
    name: str
    source: Source
    dll: ctypes.CDLL

    def launch_function(self, kernel: str) -> ctypes._CFuncPtr:
        function = getattr(self.dll, f"pie_launch_{kernel}")
        function.restype = ctypes.c_int
        return function


def load(name: str, source: str) -> Library:
    return Library(name, parse(source), ctypes.CDLL(str(compile_library(name, source))))
