"""One wgpu device running the shared kernels: buffers, pipelines, and batched command recording.

Dispatches are recorded into one command encoder (one compute pass) and
submitted only when results are needed (a download, page reads, synchronize) or
before a host write, so a forward pass is one submission. Uniform blocks of a
submission share one buffer at dynamic offsets, so bind groups depend only on the
storage buffers and are cached: a decode loop that recycles the same buffers
creates none after its first step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import wgpu
from pie.enginekit.shaders import Entry, wgsl
from pie.enginekit.shaders.launch import BufferRange
from pie.enginekit.shaders.pooled import PooledBackend
from pie.enginekit.tensor import device_memory_exhausted
from pie.plugins import DeviceLost

_STORAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
_BINDING_TYPES = {"read": "read-only-storage", "read_write": "storage"}
_PARAMS_CAPACITY = 1 << 20
_MAX_BIND_GROUPS = 8192
_LOST = "device is lost"
"""What wgpu's errors say once the device is lost (wgpu-core's "Parent device is lost", wgpu-hal's "Device is
lost"); wgpu-py 0.32 has no other sign of it (its device's ``lost`` promise is not implemented)."""
_NO_MEMORY = "not enough memory"
"""What wgpu-core says where the device has no memory left for a buffer ("Not enough memory left"), which wgpu-py
0.32 raises as a validation error."""
_Method = TypeVar("_Method", bound=Callable[..., Any])


class WgpuDeviceLost(DeviceLost):
    """wgpu lost the device (destroyed, or a fault, a hang or a driver reset): every later call on it fails."""


def _reports_device_loss(method: _Method) -> _Method:
    """``method`` raising wgpu's error for a lost device as :class:`WgpuDeviceLost`, as the engine contract asks:
    pie serve then stops serving, saying why, instead of failing every later request with a validation error."""

    @functools.wraps(method)
    def call(self: WgpuBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except wgpu.GPUError as error:
            if _LOST not in str(error).lower():
                raise
            said = " ".join(str(error).split())
            raise WgpuDeviceLost(f"{self.name}: wgpu says the device is lost ({said})") from error

    return call  # type: ignore[return-value]


class WgpuBackend(PooledBackend):
    """A wgpu device with the state the shared launchers need (see :class:`pie.enginekit.shaders.launch.Backend`)."""

    def __init__(self, adapter: Any):
        self.name = str(adapter.info.get("device", "?"))
        limits = adapter.limits
        wanted = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage")
        self.device = adapter.request_device_sync(required_limits={name: limits[name] for name in wanted})
        self.queue = self.device.queue
        self._params_buffer = self.device.create_buffer(
            size=_PARAMS_CAPACITY, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        )
        self._pipelines: dict[str, tuple[Any, Any]] = {}
        self._bind_groups: dict[tuple[Any, ...], tuple[Any, Sequence[BufferRange]]] = {}
        self._encoder: Any = None
        self._pass: Any = None
        self.submissions = 0
        device_limits = self.device.limits
        super().__init__(
            int(device_limits["min-storage-buffer-offset-alignment"]),
            int(device_limits["max-storage-buffer-binding-size"]),
            int(device_limits["min-uniform-buffer-offset-alignment"]),
            _PARAMS_CAPACITY,
            int(device_limits["max-buffer-size"]),
        )

    # -- buffers -------------------------------------------------------------------

    @_reports_device_loss
    def _create_buffer(self, capacity: int) -> Any:
        try:
            return self.device.create_buffer(size=capacity, usage=_STORAGE)
        except wgpu.GPUError as error:
            said = str(error).strip().splitlines()[-1].strip()  # wgpu-core's cause, below its context
            if not isinstance(error, wgpu.GPUOutOfMemoryError) and _NO_MEMORY not in said.lower():
                raise
            raise device_memory_exhausted(self.name, capacity, f"wgpu says {said!r}") from error

    def _destroy_buffer(self, buffer: Any) -> None:
        # Recorded commands may still use it: drop our references and let wgpu free it
        # once they are done (an explicit destroy() would invalidate them).
        self._bind_groups.clear()

    @_reports_device_loss
    def _clear(self, buffer: Any, size: int) -> None:
        self._copy_encoder().clear_buffer(buffer, 0, size)

    @_reports_device_loss
    def _write(self, buffer: Any, offset: int, data: np.ndarray) -> None:
        self.flush()  # earlier recorded work must run before this write lands
        self.queue.write_buffer(buffer, offset, data)

    @_reports_device_loss
    def _read(self, ranges: list[tuple[Any, int, int]]) -> np.ndarray:
        """Copy buffer ranges, concatenated, to the host (submits everything recorded and waits)."""
        total = sum(size for _, _, size in ranges)
        staging = self.device.create_buffer(size=total, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        encoder = self._copy_encoder()
        at = 0
        for buffer, offset, size in ranges:
            encoder.copy_buffer_to_buffer(buffer, offset, staging, at, size)
            at += size
        self.flush()
        staging.map_sync(wgpu.MapMode.READ)
        try:
            return np.frombuffer(staging.read_mapped(copy=True), dtype=np.uint8)
        finally:
            staging.unmap()
            staging.destroy()

    @_reports_device_loss
    def _copy_within(self, buffer: Any, copies: list[tuple[int, int, int]]) -> None:
        """Through a scratch buffer on the device: WebGPU does not copy a buffer onto itself."""
        total = sum(size for _, _, size in copies)
        scratch = self.device.create_buffer(size=total, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
        encoder = self._copy_encoder()
        at = 0
        for source, _, size in copies:
            encoder.copy_buffer_to_buffer(buffer, source, scratch, at, size)
            at += size
        at = 0
        for _, destination, size in copies:
            encoder.copy_buffer_to_buffer(scratch, at, buffer, destination, size)
            at += size
        self.flush()
        scratch.destroy()

    # -- pipelines and dispatch ------------------------------------------------------

    def _pipeline(self, entry: Entry) -> tuple[Any, Any]:
        found = self._pipelines.get(entry.name)
        if found is None:
            entries = []
            for index, kind in entry.bindings:
                if kind == "uniform":
                    layout = {"type": "uniform", "has_dynamic_offset": True, "min_binding_size": entry.params_size}
                else:
                    layout = {"type": _BINDING_TYPES[kind]}
                entries.append({"binding": index, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": layout})
            group_layout = self.device.create_bind_group_layout(entries=entries)
            module = self.device.create_shader_module(label=entry.name, code=entry.code or wgsl(entry.name))
            pipeline = self.device.create_compute_pipeline(
                label=entry.name,
                layout=self.device.create_pipeline_layout(bind_group_layouts=[group_layout]),
                compute={"module": module, "entry_point": entry.name},
            )
            found = self._pipelines[entry.name] = (pipeline, group_layout)
        return found

    def _bind_group(self, entry: Entry, layout: Any, bindings: Sequence[BufferRange]) -> Any:
        key = (entry.name, *((id(buffer), offset, size) for buffer, offset, size in bindings))
        cached = self._bind_groups.get(key)
        if cached is not None:
            return cached[0]
        params = {"buffer": self._params_buffer, "offset": 0, "size": entry.params_size}
        resources = [{"binding": entry.uniform_binding, "resource": params}]
        for (index, _), (buffer, offset, size) in zip(entry.storage_bindings, bindings, strict=True):
            resources.append({"binding": index, "resource": {"buffer": buffer, "offset": offset, "size": size}})
        group = self.device.create_bind_group(layout=layout, entries=resources)
        if len(self._bind_groups) >= _MAX_BIND_GROUPS:
            self._bind_groups.clear()
        # Keeping the bindings alive keeps their ids unique while the key is cached.
        self._bind_groups[key] = (group, tuple(bindings))
        return group

    @_reports_device_loss
    def dispatch(
        self, entry: Entry, params: bytes, bindings: Sequence[BufferRange], groups: tuple[int, int, int]
    ) -> None:
        pipeline, layout = self._pipeline(entry)
        group = self._bind_group(entry, layout, bindings)
        offset = self._place_params(params)
        compute = self._compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, group, [offset])
        compute.dispatch_workgroups(*groups)

    def _compute_pass(self) -> Any:
        if self._pass is None:
            if self._encoder is None:
                self._encoder = self.device.create_command_encoder()
            self._pass = self._encoder.begin_compute_pass()
        return self._pass

    def _copy_encoder(self) -> Any:
        """The current encoder outside any compute pass (copies and clears go between passes)."""
        if self._pass is not None:
            self._pass.end()
            self._pass = None
        if self._encoder is None:
            self._encoder = self.device.create_command_encoder()
        return self._encoder

    @_reports_device_loss
    def flush(self) -> None:
        """Submit everything recorded so far (without waiting)."""
        if self._encoder is None:
            return
        encoder = self._copy_encoder()
        self._encoder = None
        params = self._take_params()
        if params:
            self.queue.write_buffer(self._params_buffer, 0, params)
        self.queue.submit([encoder.finish()])
        self.submissions += 1

    def synchronize(self) -> None:
        # Reading a few bytes back waits for every earlier submission (queue order). wgpu-py 0.32's
        # on_submitted_work_done_sync() fails against its own native library (a callback type mismatch).
        self.flush()
        self._read([(self.placeholder[0], 0, 4)])
