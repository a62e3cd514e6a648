"""The host emulator: the same CUDA C kernels built by the host C++ compiler and run on the CPU.

Test equipment, not part of the engine: ``PIE_CUDA_BACKEND=emulator_api:EMULATOR`` (with this
folder on ``sys.path``, as under pytest) selects it, for CI and for debugging kernels without a GPU: "device" memory is host memory, launches run to completion, and
every CUDA thread is a fiber (see ``csrc/compat_host.cuh``), so a barrier some
threads miss is reported instead of hanging. ``PIE_CUDA_EMULATOR_WARP=64``
emulates AMD's 64-lane wavefronts. It is slow by design.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from pie_engine_cuda import backend
from pie_engine_cuda.api import BoundLaunch, DeviceFacts, GpuError, ParamLayout
from pie.enginekit.compile_cache import Artifacts
from pie.eta.render import RenderedKernel
from pie_engine_cuda.compiler import KernelCompileError
from pie_engine_cuda.sources import read_source
from pie_engine_cuda.tensor import OutOfDeviceMemory

WARP_ENV = "PIE_CUDA_EMULATOR_WARP"
TRAMPOLINE_SUFFIX = "_pie_entry"
C_TYPES = {"f32": "float", "i32": "int"}
ALIGNMENT = 256


def emulator_warp(env: Mapping[str, str] | None = None) -> int:
    env = os.environ if env is None else env
    warp = int(env.get(WARP_ENV, "32") or "32")
    if warp not in (32, 64):
        raise ValueError(f"{WARP_ENV} must be 32 or 64, not {warp}")
    return warp


def probe_emulator() -> list[DeviceFacts]:
    compiler = HostCompiler()
    warp = emulator_warp()
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        memory = 0
    return [
        DeviceFacts(
            ordinal=0,
            name=f"CUDA C emulator on the host CPU (warp {warp})",
            vendor="pie",
            architecture="host",
            compile_target=f"host-warp{warp}",
            memory_bytes=memory,
            driver=compiler.version,
            warp_size=warp,
            multiprocessors=1,
            tensor_cores=warp == 32,
            details=(("compiler", compiler.version),),
        )
    ]


class HostCompiler:
    """The host C++ compiler building the emulator's shared libraries (``$CXX``, else g++ or clang++)."""

    backend = "emulator"
    name = "host C++"

    def __init__(self, executable: str | None = None) -> None:
        found = executable or os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
        if not found:
            raise RuntimeError("the CUDA emulator needs a C++ compiler: `apt-get install g++` (or set CXX)")
        self.executable = found

    @cached_property
    def version(self) -> str:
        result = subprocess.run([self.executable, "--version"], capture_output=True, text=True, check=True)
        return result.stdout.splitlines()[0].strip()

    def options(self, arch: str) -> tuple[str, ...]:
        warp = arch.rsplit("warp", 1)[-1]
        return ("-std=c++17", "-O1", "-fPIC", "-shared", f"-DPIE_EMU_WARP={warp}")

    def compile(self, source: str, unit: str, arch: str) -> Artifacts:
        with tempfile.TemporaryDirectory(prefix="pie-emu-") as folder:
            source_path = Path(folder) / f"{unit}.cpp"
            library = Path(folder) / f"{unit}.so"
            source_path.write_text(source, encoding="utf-8")
            result = subprocess.run(
                [self.executable, *self.options(arch), "-x", "c++", str(source_path), "-o", str(library)],
                capture_output=True,
                text=True,
                check=False,
            )
            if result.returncode != 0:
                raise KernelCompileError(self.version, unit, arch, result.stderr)
            return {"so": library.read_bytes()}


class _Module:
    def __init__(self, library: ctypes.CDLL):
        self.library = library
        self.launch = library.pie_emu_launch
        self.launch.restype = ctypes.c_int
        self.launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p]
        self.error = library.pie_emu_error
        self.error.restype = ctypes.c_char_p


class EmulatorApi:
    backend = "emulator"

    def __init__(self, facts: DeviceFacts):
        self.facts = facts
        libc = ctypes.CDLL(None)
        self._aligned_alloc = libc.aligned_alloc
        self._aligned_alloc.restype = ctypes.c_void_p
        self._aligned_alloc.argtypes = [ctypes.c_size_t, ctypes.c_size_t]
        self._free = libc.free
        self._free.argtypes = [ctypes.c_void_p]

    def mem_alloc(self, nbytes: int) -> int:
        ptr = self._aligned_alloc(ALIGNMENT, -(-nbytes // ALIGNMENT) * ALIGNMENT)
        if not ptr:
            raise OutOfDeviceMemory(f"host allocation of {nbytes} bytes failed")
        return int(ptr)

    def mem_free(self, ptr: int) -> None:
        self._free(ptr)

    def memset_zero(self, ptr: int, nbytes: int) -> None:
        ctypes.memset(ptr, 0, nbytes)

    def copy_to_device(self, ptr: int, host: np.ndarray) -> None:
        ctypes.memmove(ptr, host.ctypes.data, host.nbytes)

    def copy_to_host(self, host: np.ndarray, ptr: int) -> None:
        ctypes.memmove(host.ctypes.data, ptr, host.nbytes)

    def synchronize(self) -> None:
        return None

    def load_module(self, artifacts: Artifacts) -> Any:
        handle, path = tempfile.mkstemp(prefix="pie-emu-", suffix=".so")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(artifacts["so"])
            return _Module(ctypes.CDLL(path))
        finally:
            os.unlink(path)

    def get_function(self, module: _Module, name: str) -> Any:
        try:
            symbol = getattr(module.library, name)
        except AttributeError as exc:
            raise GpuError(f"kernel {name!r} is not in the module") from exc
        return module, ctypes.cast(symbol, ctypes.c_void_p).value

    def wrap_generated(self, rendered: RenderedKernel) -> tuple[str, str]:
        """An eta kernel's rendered CUDA source for the emulator, with a trampoline taking its parameters
        packed behind one pointer as every emulated entry point does, and the trampoline's name."""
        layout, entry = rendered.bindings, rendered.entry_point
        fields = [
            f"  {'const ' if b.role == 'input' else ''}{C_TYPES[b.dtype.value]}* b{b.slot};" for b in layout.buffers
        ]
        call = ", ".join([f"a.b{b.slot}" for b in layout.buffers] + ["a.p"])
        trampoline = "\n".join(
            [
                f"struct {entry}_packed {{",
                *fields,
                f"  {entry}_params p;",
                "};",
                f'extern "C" void {entry}{TRAMPOLINE_SUFFIX}(const void* packed) {{',
                f"  const {entry}_packed& a = *static_cast<const {entry}_packed*>(packed);",
                f"  {entry}({call});",
                "}",
            ]
        )
        source = f"{read_source('compat_host.cuh')}\n{rendered.source}\n{trampoline}\n"
        return source, entry + TRAMPOLINE_SUFFIX

    def bind(self, function: tuple[_Module, int], args: ctypes.Structure, layout: ParamLayout | None = None) -> BoundLaunch:
        """Every emulated entry point takes the address of its packed arguments (kernels with several
        parameters get a trampoline that unpacks them), so ``layout`` is not needed here."""
        module, address = function
        launch_grid, error = module.launch, module.error
        args_address = ctypes.addressof(args)

        def launch(gx: int, gy: int, gz: int, bx: int, by: int, bz: int, shared: int, _keep: object = args) -> None:
            if launch_grid(address, gx, gy, gz, bx, by, bz, shared, args_address) != 0:
                raise GpuError(f"emulated launch (grid={(gx, gy, gz)}, block={(bx, by, bz)}) failed: "
                               f"{error().decode()}")

        return launch


EMULATOR = backend.Backend("emulator", probe_emulator, EmulatorApi, HostCompiler)
SELECTED = "emulator_api:EMULATOR"
"""The ``PIE_CUDA_BACKEND`` value that selects the emulator."""
