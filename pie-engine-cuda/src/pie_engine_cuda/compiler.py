"""Run-time compilers: NVRTC (CUDA) and hiprtc (HIP).

Each compiles one unit for one architecture of the local device, never a fat
binary, and returns named artifacts: NVRTC gives ``ptx`` and, for a real ``sm_XX``
target, ``cubin``; hiprtc gives a ``code_object``. :func:`compile_source` puts the on-disk cache in front of them.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any, Protocol

from pie.enginekit.compile_cache import Artifacts, CompileCache, cache_key

from pie_engine_cuda.driver_api import check


class KernelCompileError(RuntimeError):
    """A compile unit did not compile; the message carries the compiler's log."""

    def __init__(self, compiler: str, unit: str, arch: str, log: str):
        lines = log.strip().splitlines()
        shown = "\n".join(lines[:60]) + (f"\n... ({len(lines) - 60} more lines)" if len(lines) > 60 else "")
        super().__init__(f"{compiler} failed to compile {unit!r} for {arch}:\n{shown}")
        self.log = log


class Compiler(Protocol):
    backend: str
    name: str

    @property
    def version(self) -> str: ...

    def options(self, arch: str) -> tuple[str, ...]: ...

    def compile(self, source: str, unit: str, arch: str) -> Artifacts: ...


class Nvrtc:
    """NVRTC through ``cuda.bindings.nvrtc``."""

    backend = "cuda"
    name = "NVRTC"

    def __init__(self) -> None:
        from cuda.bindings import nvrtc

        self._nvrtc = nvrtc

    def _check(self, result: tuple, what: str) -> Any:
        """The values of an ``(error, *values)`` result, as for the driver's calls."""
        return check(self._nvrtc, result, what, self._nvrtc.nvrtcResult.NVRTC_SUCCESS)

    @cached_property
    def version(self) -> str:
        major, minor = self._check(self._nvrtc.nvrtcVersion(), "nvrtcVersion")
        return f"{major}.{minor}"

    @cached_property
    def supported_archs(self) -> tuple[int, ...]:
        """Compute capabilities this NVRTC can emit code for (e.g. 75, 80, ..., 120)."""
        archs = self._check(self._nvrtc.nvrtcGetSupportedArchs(), "nvrtcGetSupportedArchs")
        return tuple(int(a) for a in archs)

    def target(self, compute_capability: int) -> str:
        """``sm_XX`` (a CUBIN for this GPU) when NVRTC knows the GPU, else PTX for the newest
        architecture below it, which the driver compiles when loading."""
        if compute_capability in self.supported_archs:
            return f"sm_{compute_capability}"
        older = [a for a in self.supported_archs if a < compute_capability]
        if not older:
            lowest = min(self.supported_archs)
            raise RuntimeError(
                f"NVRTC {self.version} cannot compile for compute capability {compute_capability / 10:.1f} "
                f"(oldest supported: {lowest / 10:.1f}); install an older CUDA NVRTC, e.g. "
                "`pip install 'pie-engine-cuda[cu12]'`"
            )
        return f"compute_{max(older)}"

    def options(self, arch: str) -> tuple[str, ...]:
        return (f"--gpu-architecture={arch}", "-std=c++17")

    def compile(self, source: str, unit: str, arch: str) -> Artifacts:
        nvrtc = self._nvrtc
        program = self._check(nvrtc.nvrtcCreateProgram(source.encode(), f"{unit}.cu".encode(), 0, [], []),
                              "nvrtcCreateProgram")
        try:
            options = [option.encode() for option in self.options(arch)]
            (status,) = nvrtc.nvrtcCompileProgram(program, len(options), options)
            size = self._check(nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize")
            log = bytearray(size)  # not b" " * size: for size 1 that is the interpreter's shared b" ", written over
            self._check(nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog")
            if status != nvrtc.nvrtcResult.NVRTC_SUCCESS:
                raise KernelCompileError(f"NVRTC {self.version}", unit, arch, bytes(log).rstrip(b"\0").decode(errors="replace"))
            size = self._check(nvrtc.nvrtcGetPTXSize(program), "nvrtcGetPTXSize")
            ptx = bytearray(size)
            self._check(nvrtc.nvrtcGetPTX(program, ptx), "nvrtcGetPTX")
            artifacts = {"ptx": bytes(ptx)}
            if arch.startswith("sm_"):
                size = self._check(nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize")
                cubin = bytearray(size)
                self._check(nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
                artifacts["cubin"] = bytes(cubin)
            return artifacts
        finally:
            nvrtc.nvrtcDestroyProgram(program)


class Hiprtc:
    """hiprtc (see :mod:`pie_engine_cuda.hiprtc_lib` for how the library is found)."""

    backend = "hip"
    name = "hiprtc"

    def __init__(self) -> None:
        from pie_engine_cuda.hiprtc_lib import load_hiprtc

        self._rtc = load_hiprtc()

    @property
    def origin(self) -> str:
        return self._rtc.origin

    @cached_property
    def version(self) -> str:
        return self._rtc.version()

    def options(self, arch: str) -> tuple[str, ...]:
        return (f"--offload-arch={arch}", "-O3", "-std=c++17", f"-DPIE_WARP_SIZE={wavefront_size(arch)}")

    def compile(self, source: str, unit: str, arch: str) -> Artifacts:
        code, log = self._rtc.compile(source, f"{unit}.cu", self.options(arch))
        if code is None:
            raise KernelCompileError(f"hiprtc {self.version}", unit, arch, log)
        return {"code_object": code}


def wavefront_size(arch: str) -> int:
    """Lanes per wavefront hiprtc compiles for: 64 on GCN and CDNA (gfx8, gfx9), 32 on RDNA (gfx10+)."""
    return 64 if arch.startswith(("gfx8", "gfx9")) else 32


def compile_source(compiler: Compiler, name: str, source: str, arch: str, cache: CompileCache) -> Artifacts:
    """Any complete source (a unit, a rendered eta epilogue) through the cache."""
    key = cache_key(
        source=source,
        compiler=f"{compiler.backend}/{compiler.name}",
        compiler_version=compiler.version,
        arch=arch,
        options=compiler.options(arch),
    )
    return cache.get_or_compile(key, lambda: compiler.compile(source, name, arch))
