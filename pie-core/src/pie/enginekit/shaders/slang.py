"""A small ctypes binding of the Slang compiler's C API: the shipped shaders' build, and eta epilogues at run time.

The compiler is the shared library inside the ``slangpy`` wheel. Building the
shipped shaders needs it (a development dependency); the shipped kernels do not.
An engine that runs SPIR-V compiles eta epilogues through :func:`runtime_spirv`
when the compiler is installed (:func:`available`), an optional extra of the
engine. Only the calls these need are bound. Quirks of this API: text targets (WGSL)
come from ``spGetEntryPointCode``; SPIR-V of one entry point comes from
``spGetTargetCodeBlob``, which needs whole-program mode with direct SPIR-V emission
(``spGetEntryPointCodeBlob`` is avoided: it crashed here). A batch of entry points
of one file (the shipped build) is compiled without whole-program mode, each entry
point's SPIR-V read with ``spGetEntryPointCode`` like WGSL.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from typing import Self

Target = Literal["spirv", "wgsl"]

LIBRARY_ENV = "PIE_SLANG_LIBRARY"
SPIRV_PROFILE = b"spirv_1_3"
"""Vulkan 1.1 consumes SPIR-V up to 1.3; lavapipe in Debian 12 is a Vulkan 1.1 device."""

_SOURCE_LANGUAGE_SLANG = 1
_STAGE_COMPUTE = 6
_TARGETS = {"spirv": 6, "wgsl": 28}
_FLAG_WHOLE_PROGRAM = 1 << 8
_FLAG_SPIRV_DIRECTLY = 1 << 10

_V = ctypes.c_void_p
_SIGNATURES: dict[str, tuple[object, list[object]]] = {
    "spCreateSession": (_V, [ctypes.c_char_p]),
    "spDestroySession": (None, [_V]),
    "spGetBuildTagString": (ctypes.c_char_p, []),
    "spCreateCompileRequest": (_V, [_V]),
    "spDestroyCompileRequest": (None, [_V]),
    "spProcessCommandLineArguments": (ctypes.c_int, [_V, ctypes.POINTER(ctypes.c_char_p), ctypes.c_int]),
    "spAddSearchPath": (None, [_V, ctypes.c_char_p]),
    "spAddCodeGenTarget": (ctypes.c_int, [_V, ctypes.c_int]),
    "spSetTargetFlags": (None, [_V, ctypes.c_int, ctypes.c_uint]),
    "spFindProfile": (ctypes.c_int, [_V, ctypes.c_char_p]),
    "spSetTargetProfile": (None, [_V, ctypes.c_int, ctypes.c_int]),
    "spAddTranslationUnit": (ctypes.c_int, [_V, ctypes.c_int, ctypes.c_char_p]),
    "spAddTranslationUnitSourceString": (None, [_V, ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]),
    "spAddEntryPoint": (ctypes.c_int, [_V, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]),
    "spCompile": (ctypes.c_int, [_V]),
    "spGetDiagnosticOutput": (ctypes.c_char_p, [_V]),
    "spGetEntryPointCode": (_V, [_V, ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "spGetTargetCodeBlob": (ctypes.c_int, [_V, ctypes.c_int, ctypes.POINTER(_V)]),
}


class SlangError(RuntimeError):
    """The Slang compiler is missing or rejected a shader."""


def find_library() -> Path:
    """The Slang compiler library: ``$PIE_SLANG_LIBRARY``, else the one in the slangpy wheel."""
    explicit = os.environ.get(LIBRARY_ENV)
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("slangpy")
    if spec is None or not spec.submodule_search_locations:
        raise SlangError("the Slang compiler is not installed: pip install slangpy (a build-time dependency)")
    folder = Path(next(iter(spec.submodule_search_locations)))
    pattern = {"win32": "slang-compiler*.dll", "darwin": "libslang-compiler*.dylib"}.get(
        sys.platform, "libslang-compiler.so*"
    )
    found = sorted(folder.glob(pattern))
    if not found:
        raise SlangError(f"no {pattern} in {folder}; set {LIBRARY_ENV} to the Slang compiler library")
    return found[0]


@cache
def available() -> bool:
    """Whether the Slang compiler library can be found (nothing is loaded)."""
    try:
        return find_library().is_file()
    except SlangError:
        return False


def _blob_bytes(blob: int) -> bytes:
    """Copy an ISlangBlob's bytes and release it (COM vtable: ..., release, getBufferPointer, getBufferSize)."""
    vtable = ctypes.cast(blob, ctypes.POINTER(ctypes.POINTER(_V)))[0]
    release = ctypes.CFUNCTYPE(ctypes.c_uint32, _V)(vtable[2])
    pointer = ctypes.CFUNCTYPE(_V, _V)(vtable[3])(blob)
    size = ctypes.CFUNCTYPE(ctypes.c_size_t, _V)(vtable[4])(blob)
    data = ctypes.string_at(pointer, size)
    release(blob)
    return data


class SlangCompiler:
    """One Slang session; compiles one source file per call, for one entry point or several."""

    def __init__(self, library: Path | None = None):
        self._lib = ctypes.CDLL(str(library or find_library()))
        for name, (restype, argtypes) in _SIGNATURES.items():
            function = getattr(self._lib, name)
            function.restype = restype
            function.argtypes = argtypes
        self._session = self._lib.spCreateSession(None)
        if not self._session:
            raise SlangError("spCreateSession failed")

    def version(self) -> str:
        return self._lib.spGetBuildTagString().decode()

    def close(self) -> None:
        if self._session:
            self._lib.spDestroySession(self._session)
            self._session = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def compile(self, source: Path, entry: str, target: Target) -> bytes:
        """SPIR-V bytes or WGSL text (UTF-8) of ``entry`` in ``source``; imports resolve beside it.

        The source is passed as a string under its bare file name, so no absolute
        path can leak into the output (which must be byte-identical on every machine).
        """
        return self.compile_text(source.name, source.read_bytes(), entry, target, source.parent)

    def compile_text(
        self, name: str, text: bytes, entry: str, target: Target, search_path: Path | None = None
    ) -> bytes:
        """As :meth:`compile`, for source text given as the file ``name``; imports resolve in ``search_path``."""
        name = Path(name).name
        compiled = self._request(name, text, [entry], target, search_path, whole_program=True)
        with compiled as (request, target_index, indices):
            if target == "wgsl":
                return self._entry_point_code(request, indices[0], name, entry, target)
            blob = _V()
            if self._lib.spGetTargetCodeBlob(request, target_index, ctypes.byref(blob)) < 0 or not blob.value:
                raise SlangError(f"{name}:{entry}: Slang returned no SPIR-V")
            return _blob_bytes(blob.value)

    def compile_entries(self, source: Path, entries: list[str], target: Target) -> dict[str, bytes]:
        """As :meth:`compile` for several entry points of one file, parsed and checked once.

        Each entry point's code is its own (``spGetEntryPointCode``, no whole-program
        mode): the same bytes as one :meth:`compile` per entry point, which the check of
        the shipped files (``python -m pie.enginekit.shaders.build --check``) confirms for every one.
        """
        name = source.name
        text = source.read_bytes()
        with self._request(name, text, entries, target, source.parent, whole_program=False) as (request, _, indices):
            return {
                entry: self._entry_point_code(request, index, name, entry, target)
                for entry, index in zip(entries, indices, strict=True)
            }

    @contextmanager
    def _request(
        self,
        name: str,
        text: bytes,
        entries: list[str],
        target: Target,
        search_path: Path | None,
        whole_program: bool,
    ) -> Iterator[tuple[int, int, list[int]]]:
        """A compiled request for ``entries`` of one source: (request, target index, entry point indices).

        Raises :class:`SlangError` on errors or warnings; the request is destroyed on exit."""
        lib = self._lib
        request = lib.spCreateCompileRequest(self._session)
        try:
            args = [b"-fvk-use-entrypoint-name"]
            lib.spProcessCommandLineArguments(request, (ctypes.c_char_p * len(args))(*args), len(args))
            if search_path is not None:
                lib.spAddSearchPath(request, str(search_path).encode())
            target_index = lib.spAddCodeGenTarget(request, _TARGETS[target])
            if target == "spirv":
                flags = _FLAG_SPIRV_DIRECTLY | (_FLAG_WHOLE_PROGRAM if whole_program else 0)
                lib.spSetTargetFlags(request, target_index, flags)
                lib.spSetTargetProfile(request, target_index, lib.spFindProfile(self._session, SPIRV_PROFILE))
            unit = lib.spAddTranslationUnit(request, _SOURCE_LANGUAGE_SLANG, None)
            lib.spAddTranslationUnitSourceString(request, unit, name.encode(), text)
            indices = [lib.spAddEntryPoint(request, unit, entry.encode(), _STAGE_COMPUTE) for entry in entries]
            status = lib.spCompile(request)
            diagnostics = (lib.spGetDiagnosticOutput(request) or b"").decode(errors="replace")
            entry = entries[0] if len(entries) == 1 else f"{len(entries)} entry points"
            if status < 0:
                raise SlangError(f"{name}:{entry} ({target}) failed to compile:\n{diagnostics}")
            if diagnostics.strip():
                raise SlangError(f"{name}:{entry} ({target}) compiled with warnings:\n{diagnostics}")
            yield request, target_index, indices
        finally:
            lib.spDestroyCompileRequest(request)

    def _entry_point_code(self, request: int, index: int, name: str, entry: str, target: Target) -> bytes:
        size = ctypes.c_size_t()
        pointer = self._lib.spGetEntryPointCode(request, index, ctypes.byref(size))
        if not pointer:
            raise SlangError(f"{name}:{entry}: Slang returned no {'WGSL' if target == 'wgsl' else 'SPIR-V'}")
        return ctypes.string_at(pointer, size.value)


_runtime_compiler: SlangCompiler | None = None
_runtime_modules: dict[str, bytes] = {}
_runtime_lock = threading.Lock()


def runtime_spirv(source: str, entry: str) -> bytes:
    """SPIR-V of ``entry`` in Slang ``source`` made at run time (an eta epilogue), compiled once per process.

    Modules are cached by the sha256 of the source and the entry point; one compiler
    session serves every call. Raises :class:`SlangError` when the compiler is missing.
    """
    global _runtime_compiler
    key = hashlib.sha256(f"{entry}\0{source}".encode()).hexdigest()
    with _runtime_lock:
        code = _runtime_modules.get(key)
        if code is None:
            if _runtime_compiler is None:
                _runtime_compiler = SlangCompiler()
            code = _runtime_modules[key] = _runtime_compiler.compile_text(
                f"{entry}.slang", source.encode(), entry, "spirv"
            )
    return code
