"""The slice of Metal the engine drives, as a protocol.

`pie_engine_metal.metal.MetalDriver` implements it with PyObjC on macOS. Keeping the
engine's host logic (tensors, buffer reuse, pipeline cache, dispatch planning,
command-buffer batching) on this small surface is what lets the tests run all of it
against a CPU implementation of the same protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pie_engine_metal.library import Constant

Size = tuple[int, int, int]


@dataclass(frozen=True)
class Pipeline:
    """A compute pipeline state and the limits Metal reports for it."""

    handle: Any
    max_threads: int
    """maxTotalThreadsPerThreadgroup: depends on the kernel's register use."""
    simd_width: int
    """threadExecutionWidth: 32 on Apple GPUs, 8 to 64 on Intel and AMD."""


class Driver(Protocol):
    def new_buffer(self, nbytes: int) -> Any:
        """A shared-storage buffer of at least ``nbytes`` (contents unspecified)."""

    def contents(self, buffer: Any, nbytes: int) -> memoryview:
        """Writable CPU view of the first ``nbytes`` of a shared buffer."""

    def compile_library(self, name: str, source: str) -> Any:
        """Compile MSL source; raise with the compiler's log on failure."""

    def new_pipeline(
        self, library: Any, function: str, constants: Sequence[tuple[Constant, bool | int | float]]
    ) -> Pipeline:
        """Specialise ``function`` with its function constants and build its pipeline state."""

    def encode(
        self, pipeline: Pipeline, buffers: Sequence[tuple[Any, int]], params: bytes, groups: Size, threads: Size
    ) -> None:
        """Append one dispatch to the open command buffer (opening one if needed).

        ``buffers[i]`` is bound at index i as (buffer, byte offset); ``params`` right after.
        """

    def commit(self) -> None:
        """Submit the open command buffer, if any, without waiting."""

    def wait(self) -> None:
        """Wait until every submitted command buffer has completed; raise if one failed."""
