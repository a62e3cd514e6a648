"""hiprtc, through hip-python when its loader finds the library, else straight through ctypes.

hip-python opens ``libhiprtc.so`` by that name (or under ``ROCM_PATH``). ROCm 6
and later ship that file; ROCm 5 (Debian's ``libamdhip64-dev``) has no separate
hiprtc library: the ``hiprtc*`` functions live in ``libamdhip64.so.5``. Rather
than asking for a symlink, :func:`load_hiprtc` then loads whichever library on
the system exports ``hiprtcCreateProgram``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from pathlib import Path
from typing import Protocol

SYSTEM_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class HipRtcUnavailable(RuntimeError):
    """No hiprtc library can be loaded."""


class RtcLibrary(Protocol):
    origin: str
    """Where the functions come from (for diagnostics)."""

    def version(self) -> str: ...

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[bytes | None, str]:
        """Code object (None on failure) and the compiler log."""
        ...


class HipPythonRtc:
    """hiprtc through ``hip.hiprtc`` (hip-python)."""

    def __init__(self) -> None:
        from hip import hiprtc

        self._rtc = hiprtc
        self.origin = "hip-python"

    def version(self) -> str:
        err, major, minor = self._rtc.hiprtcVersion()
        _check(err, self._rtc.hiprtcResult.HIPRTC_SUCCESS, "hiprtcVersion")
        return f"{major}.{minor}"

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[bytes | None, str]:
        rtc = self._rtc
        success = rtc.hiprtcResult.HIPRTC_SUCCESS
        err, program = rtc.hiprtcCreateProgram(source.encode(), name.encode(), 0, None, None)
        _check(err, success, "hiprtcCreateProgram")
        try:
            encoded = [option.encode() for option in options]
            (status,) = rtc.hiprtcCompileProgram(program, len(encoded), encoded)
            err, size = rtc.hiprtcGetProgramLogSize(program)
            _check(err, success, "hiprtcGetProgramLogSize")
            log = bytearray(size)
            if size:
                (err,) = rtc.hiprtcGetProgramLog(program, log)
                _check(err, success, "hiprtcGetProgramLog")
            text = bytes(log).rstrip(b"\0").decode(errors="replace")
            if status != success:
                return None, text
            err, size = rtc.hiprtcGetCodeSize(program)
            _check(err, success, "hiprtcGetCodeSize")
            code = bytearray(size)
            (err,) = rtc.hiprtcGetCode(program, code)
            _check(err, success, "hiprtcGetCode")
            return bytes(code), text
        finally:
            rtc.hiprtcDestroyProgram(program.createRef())  # takes a pointer to the handle


class CtypesRtc:
    """hiprtc from a shared library opened by path (ROCm 5 keeps it inside libamdhip64)."""

    def __init__(self, path: str):
        self._lib = ctypes.CDLL(path)
        self.origin = path
        lib = self._lib
        p = ctypes.c_void_p
        lib.hiprtcCreateProgram.argtypes = [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, p, p]
        lib.hiprtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.hiprtcGetProgramLogSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
        lib.hiprtcGetProgramLog.argtypes = [p, ctypes.c_char_p]
        lib.hiprtcGetCodeSize.argtypes = [p, ctypes.POINTER(ctypes.c_size_t)]
        lib.hiprtcGetCode.argtypes = [p, ctypes.c_char_p]
        lib.hiprtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
        lib.hiprtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]

    def version(self) -> str:
        major, minor = ctypes.c_int(), ctypes.c_int()
        _check(self._lib.hiprtcVersion(ctypes.byref(major), ctypes.byref(minor)), 0, "hiprtcVersion")
        return f"{major.value}.{minor.value}"

    def compile(self, source: str, name: str, options: tuple[str, ...]) -> tuple[bytes | None, str]:
        lib = self._lib
        program = ctypes.c_void_p()
        _check(lib.hiprtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), 0, None, None), 0,
               "hiprtcCreateProgram")
        try:
            encoded = (ctypes.c_char_p * len(options))(*(option.encode() for option in options))
            status = lib.hiprtcCompileProgram(program, len(options), encoded)
            size = ctypes.c_size_t()
            _check(lib.hiprtcGetProgramLogSize(program, ctypes.byref(size)), 0, "hiprtcGetProgramLogSize")
            log = ctypes.create_string_buffer(size.value + 1)
            _check(lib.hiprtcGetProgramLog(program, log), 0, "hiprtcGetProgramLog")
            text = log.value.decode(errors="replace")
            if status != 0:
                return None, text
            _check(lib.hiprtcGetCodeSize(program, ctypes.byref(size)), 0, "hiprtcGetCodeSize")
            code = ctypes.create_string_buffer(size.value)
            _check(lib.hiprtcGetCode(program, code), 0, "hiprtcGetCode")
            return code.raw, text
        finally:
            lib.hiprtcDestroyProgram(ctypes.byref(program))


def _check(status: object, success: object, what: str) -> None:
    if status != success:
        raise RuntimeError(f"{what} failed: {status}")


def hip_python_finds_hiprtc() -> bool:
    """Whether hip-python's own loader would open a hiprtc library."""
    try:
        from rocm.bindings.util.paths import get_library_path
    except ImportError:
        return False
    resolved = os.fsdecode(get_library_path("hiprtc"))
    if os.path.isabs(resolved):
        return os.path.exists(resolved)
    try:
        ctypes.CDLL(resolved)
    except OSError:
        return False
    return True


def candidate_libraries() -> list[str]:
    """Libraries that may export hiprtc, most specific first."""
    dirs: list[str] = []
    for variable in ("ROCM_PATH", "ROCM_HOME"):
        if os.environ.get(variable):
            dirs.append(str(Path(os.environ[variable]) / "lib"))
    dirs.append("/opt/rocm/lib")
    dirs.extend(SYSTEM_LIBRARY_DIRS)
    found: list[str] = []
    for pattern in ("libhiprtc.so", "libhiprtc.so.*", "libamdhip64.so", "libamdhip64.so.*"):
        for directory in dirs:
            found.extend(sorted(glob.glob(os.path.join(directory, pattern))))
    for short in ("hiprtc", "amdhip64"):
        name = ctypes.util.find_library(short)
        if name:
            found.append(name)
    return list(dict.fromkeys(found))


def exports_hiprtc(path: str) -> bool:
    try:
        return hasattr(ctypes.CDLL(path), "hiprtcCreateProgram")
    except OSError:
        return False


def load_hiprtc() -> RtcLibrary:
    """hip-python's hiprtc when it can open the library, else the first library exporting hiprtc."""
    try:
        import hip  # noqa: F401
    except ImportError:
        hip_python = False
    else:
        hip_python = hip_python_finds_hiprtc()
    if hip_python:
        return HipPythonRtc()
    for path in candidate_libraries():
        if exports_hiprtc(path):
            return CtypesRtc(path)
    raise HipRtcUnavailable(
        "no hiprtc library found (looked for libhiprtc.so and libamdhip64.so under $ROCM_PATH/lib, /opt/rocm/lib "
        "and the system library directories); install ROCm, e.g. `apt-get install libamdhip64-dev` on Debian/Ubuntu"
    )
