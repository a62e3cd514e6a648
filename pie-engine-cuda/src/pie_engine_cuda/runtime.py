"""One device at work: its GPU API, compiled modules, device blocks and tensor transfers."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from pie.contract import PassPlan
from pie.enginekit.compile_cache import CompileCache
from pie.enginekit.transfers import checked_page_ids
from pie.weights import StoredWeight

from pie_engine_cuda import launch as configs
from pie_engine_cuda.api import BoundLaunch, DeviceFacts, GpuApi
from pie_engine_cuda.args import STRUCTS
from pie_engine_cuda.attention_plan import PassWork
from pie_engine_cuda.compiler import Compiler, compile_source
from pie_engine_cuda.sources import unit_source
from pie_engine_cuda.tensor import (
    BLOCK_DTYPES,
    HOST_COPY_LIMIT,
    STORED_DTYPES,
    device_pool,
    DeviceTensor,
    itemsize,
)

WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_SUFFIX = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
WEIGHT_SUFFIX = {**DTYPE_SUFFIX, **{name: name for name in BLOCK_DTYPES}}
"""The suffix of a kernel function reading weights of each device dtype (``pie_gemv_q8_0``)."""


class GpuDevice:
    """Compiles units on first use (through the disk cache), binds launches, moves tensors."""

    def __init__(self, api: GpuApi, compiler: Compiler, cache: CompileCache, weight_dtype: str = "float32"):
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype must be one of {', '.join(WEIGHT_DTYPES)}, not {weight_dtype!r}")
        self.api = api
        self.facts: DeviceFacts = api.facts
        self.compiler = compiler
        self.cache = cache
        self.weight_dtype = weight_dtype
        """Float32 weights reaching a projection are converted to this type on the device, once."""
        self.blocks = device_pool(api.mem_alloc, api.mem_free, api.synchronize)
        self._release = self.blocks.give
        self._modules: dict[str, Any] = {}
        self._page_args = STRUCTS["PagesArgs"]()
        self._page_launch: BoundLaunch | None = None
        self._arrivals: DeviceTensor | None = None
        self._pass_plan: PassPlan | None = None
        self.pass_work: PassWork | None = None
        """The running pass's attention work, made with its :attr:`pass_plan`; None between passes."""

    @property
    def pass_plan(self) -> PassPlan | None:
        """The running pass's plan (``pie_begin_pass`` to ``pie_end_pass``), None between passes."""
        return self._pass_plan

    @pass_plan.setter
    def pass_plan(self, plan: PassPlan | None) -> None:
        self._pass_plan = plan
        self.pass_work = None if plan is None else PassWork(plan.qo_indptr, plan.q_lens, plan.kv_lens, self.upload)

    # -- kernels ----------------------------------------------------------------

    def module(self, unit: str) -> Any:
        """A compile unit's module (``sources.UNITS``), loaded once."""
        return self.load_source(unit, unit_source(unit, self.compiler.backend))

    def load_source(self, name: str, source: str) -> Any:
        """A module compiled from complete source (a unit, an eta epilogue), kept by name."""
        module = self._modules.get(name)
        if module is None:
            artifacts = compile_source(self.compiler, name, source, self.facts.compile_target, self.cache)
            module = self._modules[name] = self.api.load_module(artifacts)
        return module

    def bind(self, unit: str, name: str, args: Any) -> BoundLaunch:
        """A launch of kernel ``name`` (in compile unit ``unit``) reading its arguments from ``args``."""
        return self.api.bind(self.api.get_function(self.module(unit), name), args)

    # -- tensors ----------------------------------------------------------------

    def empty(self, shape: Sequence[int], dtype: str = "float32") -> DeviceTensor:
        """A new, uninitialized tensor (launchers pass tuples of ints; anything else is normalized)."""
        if shape.__class__ is not tuple:
            shape = tuple(int(s) for s in shape)
        nbytes = math.prod(shape) * itemsize(dtype)
        ptr, capacity = self.blocks.take(nbytes)
        return DeviceTensor(ptr, shape, dtype, capacity, self._release, None, nbytes)

    def arrivals(self, count: int) -> int:
        """The address of at least ``count`` int32 counters that are zero between launches: the blocks
        of a GEMM split along k count their arrivals per tile there, and the last one resets its own."""
        if self._arrivals is None or self._arrivals.shape[0] < count:
            self._arrivals = self.zeros((max(count, 1024),), "int32")
        return self._arrivals.ptr

    def zeros(self, shape: Sequence[int], dtype: str | np.dtype = "float32") -> DeviceTensor:
        tensor = self.empty(shape, getattr(dtype, "name", dtype))  # a page pool's dtype comes as numpy's
        if tensor.nbytes:
            self.api.memset_zero(tensor.ptr, tensor.nbytes)
        return tensor

    def upload(self, array: np.ndarray) -> DeviceTensor:
        host = np.ascontiguousarray(array)
        tensor = self.empty(host.shape, host.dtype.name)
        if host.nbytes:
            self.api.copy_to_device(tensor.ptr, host)
        if host.dtype.kind in "iu" and host.size <= HOST_COPY_LIMIT:
            tensor.host = host.copy()
        return tensor

    def upload_stored(self, weight: StoredWeight) -> DeviceTensor:
        """A stored weight's bytes as they are: a tensor of its logical shape in dtype
        ``STORED_DTYPES[weight.type]`` (the engine has checked that it reads that type)."""
        host = np.ascontiguousarray(weight.data)
        ptr, capacity = self.blocks.take(host.nbytes)
        tensor = DeviceTensor(ptr, weight.shape, STORED_DTYPES[weight.type], capacity, self._release, None, host.nbytes)
        if host.nbytes:
            self.api.copy_to_device(ptr, host)
        return tensor

    def download(self, tensor: DeviceTensor) -> np.ndarray:
        """A tensor's contents; a block-typed weight as its stored bytes ``[rows, row_bytes]``, a bfloat16
        one widened to float32."""
        if tensor.dtype in BLOCK_DTYPES:
            out = np.empty((tensor.shape[0], tensor.nbytes // max(tensor.shape[0], 1)), np.uint8)
        else:
            out = np.empty(tensor.shape, np.uint16 if tensor.dtype == "bfloat16" else np.dtype(tensor.dtype))
        if out.nbytes:
            self.api.copy_to_host(out, tensor.ptr)
        else:
            self.api.synchronize()
        return (out.astype(np.uint32) << 16).view(np.float32) if tensor.dtype == "bfloat16" else out

    def host_view(self, tensor: DeviceTensor) -> np.ndarray:
        """The host copy of a small integer tensor, read back only if it has none."""
        return tensor.host if tensor.host is not None else self.download(tensor)

    def synchronize(self) -> None:
        self.api.synchronize()

    def read_bandwidth(self, megabytes: int = 1024, passes: int = 5, sweeps: int = 4) -> float:
        """Read bandwidth in bytes/s: the best of ``passes`` timings of ``sweeps`` back-to-back read
        sweeps (16-byte loads, grid-stride, four blocks per multiprocessor) over a zeroed buffer."""
        groups = max(1, megabytes * 2**20 // 16)
        buffer, out = self.zeros((groups, 4)), self.empty((1,))
        args = STRUCTS["SweepArgs"]()
        args.x, args.sink, args.count = buffer.ptr, out.ptr, groups
        launch = self.bind("core", "pie_read_sweep", args)
        config = configs.grid_stride(groups, 4 * self.facts.multiprocessors)
        launch(*config)
        self.synchronize()
        best = math.inf
        for _ in range(passes):
            start = time.perf_counter()
            for _ in range(sweeps):
                launch(*config)
            self.synchronize()
            best = min(best, time.perf_counter() - start)
        nbytes = buffer.nbytes
        buffer.free()
        out.free()
        return sweeps * nbytes / best

    def convert_weight(self, tensor: DeviceTensor, dtype: str) -> None:
        """Retype a float32 weight in place to float16 or bfloat16 (the old buffer is released)."""
        if tensor.dtype == dtype:
            return
        if tensor.dtype != "float32" or dtype not in ("float16", "bfloat16"):
            raise ValueError(f"cannot convert a {tensor.dtype} weight to {dtype}")
        converted = self.empty(tensor.shape, dtype)
        n = tensor.size
        if n:
            args = STRUCTS["ConvertArgs"](tensor.ptr, converted.ptr, n)
            self.bind("core", f"pie_convert_{DTYPE_SUFFIX[dtype]}", args)(*configs.elementwise(n))
        tensor.adopt(converted)

    # -- pages ------------------------------------------------------------------

    def read_pages(self, pool: DeviceTensor, page_ids: np.ndarray) -> np.ndarray:
        ids = checked_page_ids(pool.shape, page_ids, np.int32)
        buffer = self.empty((pool.shape[0], ids.size, *pool.shape[2:]))
        self._move_pages(pool, ids, buffer, to_pool=False)
        return self.download(buffer)

    def write_pages(self, pool: DeviceTensor, page_ids: np.ndarray, data: np.ndarray) -> None:
        ids = checked_page_ids(pool.shape, page_ids, np.int32)
        shape = (pool.shape[0], ids.size, *pool.shape[2:])
        if tuple(data.shape) != shape:
            raise ValueError(f"page data has shape {tuple(data.shape)}, expected {shape}")
        self._move_pages(pool, ids, self.upload(np.ascontiguousarray(data, dtype=np.float32)), to_pool=True)

    def copy_pages(self, pool: DeviceTensor, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        """Pages copied within the pool (copy-on-write): gathered into a device buffer, scattered back."""
        sources = checked_page_ids(pool.shape, source_ids, np.int32)
        destinations = checked_page_ids(pool.shape, destination_ids, np.int32)
        if sources.size != destinations.size:
            raise ValueError(f"copy_pages: {sources.size} source pages for {destinations.size} destinations")
        buffer = self.empty((pool.shape[0], sources.size, *pool.shape[2:]))
        self._move_pages(pool, sources, buffer, to_pool=False)
        self._move_pages(pool, destinations, buffer, to_pool=True)

    def _move_pages(self, pool: DeviceTensor, ids: np.ndarray, buffer: DeviceTensor, to_pool: bool) -> None:
        """One launch of the page kernel: pool pages ``ids`` to ``buffer`` (layer-major), or back."""
        if not ids.size:
            return
        layers, num_pages = pool.shape[0], pool.shape[1]
        if self._page_launch is None:
            self._page_launch = self.bind("core", "pie_copy_pages", self._page_args)
        device_ids = self.upload(ids)
        args = self._page_args
        page_elems = math.prod(pool.shape[2:])
        args.pool, args.buffer, args.page_ids = pool.ptr, buffer.ptr, device_ids.ptr
        args.page_elems, args.num_pages, args.count, args.to_pool = page_elems, num_pages, ids.size, int(to_pool)
        for first, config in configs.copy_pages(page_elems, ids.size, layers):
            args.first = first
            self._page_launch(*config)
