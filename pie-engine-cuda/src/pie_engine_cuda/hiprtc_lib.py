"""hiprtc through ctypes, from the library hip-python's loader finds, else from any that exports it.

hip-python opens ``libhiprtc.so`` by that name (or under ``ROCM_PATH``). ROCm 6
and later ship that file; ROCm 5 (Debian's ``libamdhip64-dev``) has no separate
hiprtc library: the ``hiprtc*`` functions live in ``libamdhip64.so.5``. Rather
than asking for a symlink, :func:`load_hiprtc` then loads whichever library on
the system exports ``hiprtcCreateProgram``. Either way the same few C calls
compile a program, so they are made through ctypes, not through two bindings.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
from pathlib import Path

SYSTEM_LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/lib")


class HipRtcUnavailable(RuntimeError):
    """No hiprtc library can be loaded."""


class CtypesRtc:
    """hiprtc from a shared library opened by path (ROCm 5 keeps it inside libamdhip64); ``origin`` says
    which, for diagnostics."""

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


def hip_python_hiprtc() -> str | None:
    """The hiprtc library hip-python's own loader would open, when hip-python is installed."""
    try:
        from rocm.bindings.util.paths import get_library_path
    except ImportError:
        return None
    return os.fsdecode(get_library_path("hiprtc"))


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


def load_hiprtc() -> CtypesRtc:
    """The library hip-python opens when it finds one, else the first library exporting hiprtc."""
    for path in (hip_python_hiprtc(), *candidate_libraries()):
        if path is not None and exports_hiprtc(path):
            return CtypesRtc(path)
    raise HipRtcUnavailable(
        "no hiprtc library found (looked for libhiprtc.so and libamdhip64.so under $ROCM_PATH/lib, /opt/rocm/lib "
        "and the system library directories); install ROCm, e.g. `apt-get install libamdhip64-dev` on Debian/Ubuntu"
    )
