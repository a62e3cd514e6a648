"""What the engine needs from a GPU API, implemented for CUDA, HIP and the host emulator.

Everything runs on one stream per device: uploads and launches are queued,
downloads and :meth:`GpuApi.synchronize` wait. A bound launch is the hot path:
:meth:`GpuApi.bind` returns a closure over the function, the stream and the
address of the argument struct, so a launch is one driver call.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pie.enginekit.compile_cache import Artifacts

BoundLaunch = Callable[[int, int, int, int, int, int, int], None]
"""launch(grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes)."""

SYNC_UPLOAD_BYTES = 1 << 20
"""Uploads this large wait for their copy: a model load must not keep every host weight alive."""

ParamLayout = tuple[tuple[int, int], ...]
"""(offset in the argument struct, size) of each kernel parameter, in order."""


class GpuError(RuntimeError):
    """A driver call failed."""


@dataclass(frozen=True)
class DeviceFacts:
    """What a probe learns about one device."""

    ordinal: int
    name: str
    vendor: str
    architecture: str
    """Compute target family: ``sm_90``, ``gfx90a``, ``host``."""
    compile_target: str
    """What the compiler is asked for: ``sm_90``, ``compute_120``, ``gfx90a:sramecc+:xnack-``, ``host-warp32``."""
    memory_bytes: int
    driver: str
    warp_size: int
    multiprocessors: int
    integrated: bool = False
    tensor_cores: bool = False
    """mma.sync (sm_80+) is available to the tensor-core GEMM."""
    details: tuple[tuple[str, str], ...] = ()


class GpuApi(Protocol):
    """One device of a backend. An API whose entry points take their parameters packed behind one pointer
    also has ``wrap_generated(rendered) -> (source, entry point)`` for generated (eta) kernels."""

    backend: str
    facts: DeviceFacts

    def mem_alloc(self, nbytes: int) -> int: ...

    def mem_free(self, ptr: int) -> None: ...

    def memset_zero(self, ptr: int, nbytes: int) -> None: ...

    def copy_to_device(self, ptr: int, host: np.ndarray) -> None:
        """Queue a copy of a C-contiguous host array; the array is kept alive until it is done."""
        ...

    def copy_to_host(self, host: np.ndarray, ptr: int) -> None:
        """Copy into a C-contiguous host array after all queued work, and wait."""
        ...

    def synchronize(self) -> None: ...

    def load_module(self, artifacts: Artifacts) -> Any: ...

    def get_function(self, module: Any, name: str) -> Any: ...

    def bind(self, function: Any, args: ctypes.Structure, layout: ParamLayout | None = None) -> BoundLaunch:
        """A launch reading its arguments from ``args``: by default the kernel takes that one struct;
        ``layout`` says where each of several kernel parameters lies in it instead."""
        ...


def kernel_params(args: ctypes.Structure, layout: ParamLayout | None = None) -> tuple[int, ctypes.Array]:
    """The ``void*[]`` kernelParams (one pointer per kernel parameter into ``args``) and its address."""
    base = ctypes.addressof(args)
    offsets = [0] if layout is None else [offset for offset, _ in layout]
    array = (ctypes.c_void_p * len(offsets))(*(base + offset for offset in offsets))
    return ctypes.addressof(array), array


def params_size(args: ctypes.Structure, layout: ParamLayout | None) -> int:
    """Bytes of the kernel's parameter buffer (the struct, or up to the end of the last parameter)."""
    if layout is None:
        return ctypes.sizeof(args)
    offset, size = layout[-1]
    return offset + size
