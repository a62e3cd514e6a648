"""`EmulatedDriver`: the engine's Driver protocol on the CPU, running the real ``.metal`` sources.

Buffers are anonymous mappings whose data ends against a PROT_NONE guard page (and
starts after another), so a kernel that reads or writes past a buffer faults and
the launch reports which buffer it overran. Dispatches run when the host waits, in
order, like a Metal queue; until then a buffer holds what the host last wrote, so
a host that reads results early, or overwrites a buffer that queued work still
reads, gets wrong numbers in the tests. Every dispatch is logged with its bindings.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from msl_emulator.build import Library, load
from pie_engine_metal.driver import Pipeline, Size
from pie_engine_metal.library import Constant

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
PROT_NONE = 0

ERRORS = {
    1: "deadlock: threads wait at different barriers or collectives",
    2: "divergent threadgroup barrier: some threads returned while others wait at it",
    3: "lanes of one simdgroup called different collectives",
    4: "memory fault (out-of-bounds access)",
    5: "arithmetic trap (integer division by zero?)",
    6: "watchdog timeout",
    7: "bad launch configuration",
    8: "the bound params are smaller than the kernel's constant struct",
    9: "a collective ran in plain mode (the kernel was thought to have none)",
    10: "a simd shuffle read an inactive lane",
}
_POISON = {"uint": 0xDEADBEEF, "float": math.nan}
_CTYPE = {"bool": ctypes.c_bool, "uint": ctypes.c_uint32, "float": ctypes.c_float}


class EmulatorError(RuntimeError):
    pass


class Launch(ctypes.Structure):
    _fields_ = [
        ("groups", ctypes.c_uint32 * 3),
        ("threads", ctypes.c_uint32 * 3),
        ("simd_width", ctypes.c_uint32),
        ("plain", ctypes.c_uint32),
        ("seed", ctypes.c_uint64),
        ("timeout_s", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
    ]


class Report(ctypes.Structure):
    _fields_ = [
        ("error", ctypes.c_int32),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("thread", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("fault_address", ctypes.c_uint64),
    ]


class GuardedBuffer:
    """``nbytes`` of memory between two inaccessible pages, the data ending against the second."""

    __slots__ = ("mapping", "offset", "nbytes", "address")

    def __init__(self, nbytes: int):
        data = max(16, -(-nbytes // 16) * 16)
        span = -(-data // PAGE) * PAGE
        self.mapping = mmap.mmap(-1, span + 2 * PAGE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.mapping))
        for guard in (base, base + PAGE + span):
            if _libc.mprotect(guard, PAGE, PROT_NONE) != 0:
                raise OSError(ctypes.get_errno(), "mprotect failed")
        self.offset = PAGE + span - data
        self.nbytes = data
        self.address = base + self.offset

    def view(self, nbytes: int) -> memoryview:
        if nbytes > self.nbytes:
            raise ValueError(f"a view of {nbytes} bytes of a {self.nbytes}-byte buffer")
        return memoryview(self.mapping)[self.offset : self.offset + nbytes]

    def contains(self, address: int) -> bool:
        return self.address - PAGE <= address < self.address + self.nbytes + PAGE


@dataclass(frozen=True)
class EmulatedPipeline:
    library: Library
    function: str
    constants: tuple[tuple[Constant, bool | int | float], ...]
    plain: bool


@dataclass(frozen=True)
class Dispatch:
    """One encoded dispatch, as the tests inspect it."""

    function: str
    constants: dict[str, bool | int | float]
    buffers: tuple[tuple[Any, int], ...]
    params: bytes
    groups: Size
    threads: Size


class EmulatedDriver:
    """The Driver protocol on the CPU. ``simd_width`` is the lanes per simdgroup to emulate."""

    def __init__(self, simd_width: int = 32, *, max_threads: int = 1024, seed: int = 0, timeout_s: int = 120):
        self.simd_width = simd_width
        self.max_threads = max_threads
        self.seed = seed
        self.timeout_s = timeout_s
        self.log: list[Dispatch] = []
        self.keep_log = True
        self.libraries_compiled = 0
        self.pipelines_built = 0
        self.commits = 0
        self.executed = 0
        self._open: list[tuple[EmulatedPipeline, Dispatch]] = []
        self._submitted: list[tuple[EmulatedPipeline, Dispatch]] = []

    def new_buffer(self, nbytes: int) -> GuardedBuffer:
        return GuardedBuffer(nbytes)

    def contents(self, buffer: GuardedBuffer, nbytes: int) -> memoryview:
        return buffer.view(nbytes)

    def compile_library(self, name: str, source: str) -> Library:
        self.libraries_compiled += 1
        return load(name, source)

    def new_pipeline(
        self, library: Library, function: str, constants: Sequence[tuple[Constant, bool | int | float]]
    ) -> Pipeline:
        if function not in library.source.kernels:
            raise EmulatorError(f"{library.name}.metal has no kernel {function!r}")
        self.pipelines_built += 1
        plain = not library.source.uses_collectives(function)
        return Pipeline(EmulatedPipeline(library, function, tuple(constants), plain), self.max_threads, self.simd_width)

    def encode(
        self, pipeline: Pipeline, buffers: Sequence[tuple[Any, int]], params: bytes, groups: Size, threads: Size
    ) -> None:
        handle: EmulatedPipeline = pipeline.handle
        dispatch = Dispatch(
            handle.function,
            {constant.name: value for constant, value in handle.constants},
            tuple(buffers),
            bytes(params),
            tuple(groups),  # type: ignore[arg-type]
            tuple(threads),  # type: ignore[arg-type]
        )
        self._open.append((handle, dispatch))
        if self.keep_log:
            self.log.append(dispatch)

    def commit(self) -> None:
        if self._open:
            self._submitted.extend(self._open)
            self._open = []
            self.commits += 1

    def wait(self) -> None:
        submitted, self._submitted = self._submitted, []
        for handle, dispatch in submitted:
            self._run(handle, dispatch)

    # -- execution ----------------------------------------------------------------

    def _set_constants(self, handle: EmulatedPipeline) -> None:
        values = {constant.name: (constant.kind, value) for constant, value in handle.constants}
        for name, declared in handle.library.source.constants.items():
            kind = {"bool": "bool", "uint": "uint", "float": "float"}[declared.type]
            if name in values:
                _CTYPE[kind].in_dll(handle.library.dll, name).value = values[name][1]
            elif kind in _POISON:
                _CTYPE[kind].in_dll(handle.library.dll, name).value = _POISON[kind]

    def _run(self, handle: EmulatedPipeline, dispatch: Dispatch) -> None:
        self._set_constants(handle)
        params = GuardedBuffer(len(dispatch.params))
        params.view(len(dispatch.params))[:] = dispatch.params
        bound = [(buffer, offset) for buffer, offset in dispatch.buffers] + [(params, 0)]
        pointers = (ctypes.c_void_p * len(bound))(*(buffer.address + offset for buffer, offset in bound))
        lengths = (ctypes.c_ulonglong * len(bound))(*(buffer.nbytes - offset for buffer, offset in bound))
        lengths[-1] = len(dispatch.params)
        launch = Launch(
            (ctypes.c_uint32 * 3)(*dispatch.groups),
            (ctypes.c_uint32 * 3)(*dispatch.threads),
            self.simd_width,
            int(handle.plain),
            self.seed,
            self.timeout_s,
            0,
        )
        report = Report()
        code = handle.library.launch_function(handle.function)(
            pointers, lengths, ctypes.byref(launch), ctypes.byref(report)
        )
        self.executed += 1
        if code:
            where = ""
            if code == 4:
                hits = [i for i, (buffer, _) in enumerate(bound) if buffer.contains(report.fault_address)]
                names = handle.library.source.kernels[handle.function].buffers
                if hits:
                    i = hits[0]
                    label = names[i].name if i < len(names) else "params"
                    where = f" at byte {report.fault_address - bound[i][0].address} of buffer {i} ({label})"
            group = tuple(report.threadgroup)
            raise EmulatorError(
                f"{handle.function}: {ERRORS.get(code, code)}{where}; threadgroup {group}, thread {report.thread}, "
                f"grid {dispatch.groups} x {dispatch.threads}"
            )


def unpack_params(dispatch: Dispatch) -> tuple[int, ...]:
    return struct.unpack(f"<{len(dispatch.params) // 4}I", dispatch.params)
