"""One Vulkan device running the shared kernels: memory, pipelines, and one command buffer per batch.

Every launch, upload and page copy is recorded, in order, into the current
command buffer; it is submitted only when the host needs a result (a download,
page reads, synchronize) or a ring runs out, and each submission is waited for.
On a software device the cost per submission dwarfs the cost per dispatch, so a
forward pass is one submission.

Memory: tensors live in device-local buffers from a recycling pool. Host data
moves through host-visible staging: uploads are copied into a staging ring and
a recorded copy moves them, downloads are copied into a readback buffer. Uniform
blocks go to a host-visible ring bound at dynamic offsets, so descriptor sets
depend only on the storage buffers and are cached across launches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import vulkan as vk
from pie.enginekit.shaders import Entry, spirv
from pie.enginekit.shaders.launch import BufferRange
from pie.enginekit.shaders.pooled import PooledBackend
from pie.enginekit.shaders.slang import runtime_spirv
from pie.enginekit.tensor import device_memory_exhausted
from pie.plugins import DeviceLost

from pie_engine_vulkan.devices import PhysicalDevice

_lib, _ffi = vk.lib, vk.ffi
_STORAGE_USAGE = (
    vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
)
_HOST = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
_ACCESS = (
    vk.VK_ACCESS_SHADER_READ_BIT
    | vk.VK_ACCESS_SHADER_WRITE_BIT
    | vk.VK_ACCESS_TRANSFER_READ_BIT
    | vk.VK_ACCESS_TRANSFER_WRITE_BIT
)
_COMPUTE = vk.VK_PIPELINE_BIND_POINT_COMPUTE
_DESCRIPTOR_TYPES = {
    "uniform": vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER_DYNAMIC,
    "read": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
    "read_write": vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
}
PARAMS_RING_BYTES = 1 << 20
STAGING_RING_BYTES = 16 << 20
DESCRIPTOR_SETS = 4096
_MAX_BINDINGS = 10
_OUT_OF_MEMORY_RESULTS = {
    vk.VkErrorOutOfDeviceMemory: "VK_ERROR_OUT_OF_DEVICE_MEMORY",
    vk.VkErrorOutOfHostMemory: "VK_ERROR_OUT_OF_HOST_MEMORY",
}
_OUT_OF_MEMORY = tuple(_OUT_OF_MEMORY_RESULTS)
_Method = TypeVar("_Method", bound=Callable[..., Any])


class VulkanDeviceLost(DeviceLost):
    """The device answered VK_ERROR_DEVICE_LOST: a fault, a hang or a driver reset left it unusable for good."""


def _reports_device_loss(method: _Method) -> _Method:
    """``method`` raising VK_ERROR_DEVICE_LOST as :class:`VulkanDeviceLost`, as the engine contract asks: pie serve
    then stops serving, saying why, instead of failing every later request with a bare ``VkErrorDeviceLost``."""

    @functools.wraps(method)
    def call(self: VulkanBackend, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except vk.VkErrorDeviceLost as error:
            raise VulkanDeviceLost(
                f"{self.physical.name} answered VK_ERROR_DEVICE_LOST: a fault or a hang left it unusable"
            ) from error

    return call  # type: ignore[return-value]


class Buffer:
    """A VkBuffer with its own memory (mapped when host-visible)."""

    __slots__ = ("handle", "mapped", "memory", "size")

    def __init__(self, handle: Any, memory: Any, size: int, mapped: memoryview | None):
        self.handle = handle
        self.memory = memory
        self.size = size
        self.mapped = mapped


class VulkanBackend(PooledBackend):
    """A logical Vulkan device with the state the shared launchers need (see :class:`pie.enginekit.shaders.launch.Backend`)."""

    def __init__(self, physical: PhysicalDevice):
        self.physical = physical
        self._family = next(
            i
            for i, family in enumerate(vk.vkGetPhysicalDeviceQueueFamilyProperties(physical.handle))
            if family.queueFlags & vk.VK_QUEUE_COMPUTE_BIT
        )
        queue_info = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self._family, queueCount=1, pQueuePriorities=[1.0])
        # Robust buffer access where the device has it: a read past a buffer (a damaged page table's page) gives
        # zeros or other values of the buffer and a write past it is dropped, instead of the device being lost.
        self.robust_buffer_access = bool(vk.vkGetPhysicalDeviceFeatures(physical.handle).robustBufferAccess)
        features = vk.VkPhysicalDeviceFeatures(robustBufferAccess=vk.VK_TRUE) if self.robust_buffer_access else None
        self.device = vk.vkCreateDevice(
            physical.handle,
            vk.VkDeviceCreateInfo(queueCreateInfoCount=1, pQueueCreateInfos=[queue_info], pEnabledFeatures=features),
            None,
        )
        self.queue = vk.vkGetDeviceQueue(self.device, self._family, 0)
        memory = vk.vkGetPhysicalDeviceMemoryProperties(physical.handle)
        self._memory_flags = [int(memory.memoryTypes[i].propertyFlags) for i in range(memory.memoryTypeCount)]

        self._command_pool = vk.vkCreateCommandPool(
            self.device,
            vk.VkCommandPoolCreateInfo(
                flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=self._family
            ),
            None,
        )
        self._command = vk.vkAllocateCommandBuffers(
            self.device,
            vk.VkCommandBufferAllocateInfo(
                commandPool=self._command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1
            ),
        )[0]
        self._fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(), None)
        self._recording = False
        self.submissions = 0
        self._barrier = _ffi.new(
            "VkMemoryBarrier*",
            {"sType": vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, "srcAccessMask": _ACCESS, "dstAccessMask": _ACCESS},
        )
        self._offset_slot = _ffi.new("uint32_t[1]")
        self._graveyard: list[Buffer] = []
        """Buffers to destroy once the commands recorded so far have run."""

        self._retired_storage = False
        super().__init__(
            physical.storage_alignment,
            physical.max_binding_bytes,
            physical.uniform_alignment,
            PARAMS_RING_BYTES,
            physical.max_allocation_bytes,
        )
        self._params_buffer = self._allocate(PARAMS_RING_BYTES, vk.VK_BUFFER_USAGE_UNIFORM_BUFFER_BIT, _HOST)
        self._staging = self._allocate(STAGING_RING_BYTES, vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT, _HOST)
        self._staging_used = 0
        self._readback: Buffer | None = None

        self._descriptor_pool = self._new_descriptor_pool()
        self._descriptor_sets: dict[tuple[Any, ...], tuple[Any, Sequence[BufferRange]]] = {}
        self._pipelines: dict[str, tuple[Any, Any, Any]] = {}

    # -- memory ------------------------------------------------------------------

    def _memory_type(self, type_bits: int, wanted: int, preferred: int = 0) -> int:
        flags = self._memory_flags
        candidates = [i for i in range(len(flags)) if type_bits & (1 << i) and flags[i] & wanted == wanted]
        if not candidates:
            raise RuntimeError(f"{self.physical.name}: no memory type with properties 0x{wanted:x}")
        best = [i for i in candidates if flags[i] & preferred == preferred]
        return (best or candidates)[0]

    @_reports_device_loss
    def _allocate(self, size: int, usage: int, properties: int, preferred: int = 0) -> Buffer:
        """A buffer with memory of its own; the kit's MemoryError where the device has no memory left for it (the
        buffer made before the memory is destroyed: a failed allocation holds nothing)."""
        try:
            handle = vk.vkCreateBuffer(
                self.device,
                vk.VkBufferCreateInfo(size=size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE),
                None,
            )
        except _OUT_OF_MEMORY as error:
            raise device_memory_exhausted(self.physical.name, size, _OUT_OF_MEMORY_RESULTS[type(error)]) from error
        try:
            requirements = vk.vkGetBufferMemoryRequirements(self.device, handle)
            memory_type = self._memory_type(requirements.memoryTypeBits, properties, preferred)
            memory = vk.vkAllocateMemory(
                self.device,
                vk.VkMemoryAllocateInfo(allocationSize=requirements.size, memoryTypeIndex=memory_type),
                None,
            )
        except BaseException as error:
            vk.vkDestroyBuffer(self.device, handle, None)
            if isinstance(error, _OUT_OF_MEMORY):
                raise device_memory_exhausted(self.physical.name, size, _OUT_OF_MEMORY_RESULTS[type(error)]) from error
            raise
        vk.vkBindBufferMemory(self.device, handle, memory, 0)
        mapped = None
        if properties & vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT:
            mapped = memoryview(vk.vkMapMemory(self.device, memory, 0, size, 0)).cast("B")
        return Buffer(handle, memory, size, mapped)

    def _create_buffer(self, capacity: int) -> Buffer:
        return self._allocate(capacity, _STORAGE_USAGE, vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT)

    def _destroy_buffer(self, buffer: Buffer) -> None:
        """Destroyed after the next wait: recorded commands may still use it."""
        self._graveyard.append(buffer)
        self._retired_storage = True

    def _destroy(self, buffer: Buffer) -> None:
        if buffer.mapped is not None:
            buffer.mapped.release()
            vk.vkUnmapMemory(self.device, buffer.memory)
        vk.vkDestroyBuffer(self.device, buffer.handle, None)
        vk.vkFreeMemory(self.device, buffer.memory, None)

    def _clear(self, buffer: Buffer, size: int) -> None:
        _lib.vkCmdFillBuffer(self._commands(), buffer.handle, 0, size, 0)
        self._barrier_after()

    # -- transfers -----------------------------------------------------------------

    def _stage(self, data: memoryview) -> tuple[Buffer, int]:
        """Host bytes placed in staging memory; (buffer, offset) to copy from."""
        size = data.nbytes
        if size > STAGING_RING_BYTES:
            staging = self._allocate(size, vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT, _HOST)
            assert staging.mapped is not None
            staging.mapped[:size] = data
            self._graveyard.append(staging)
            return staging, 0
        if self._staging_used + size > STAGING_RING_BYTES:
            self.flush()
        offset = self._staging_used
        assert self._staging.mapped is not None
        self._staging.mapped[offset : offset + size] = data
        self._staging_used = -(-(offset + size) // 16) * 16
        return self._staging, offset

    def _copy(
        self, source: Buffer, destination: Buffer, regions: Sequence[tuple[int, int, int]], barrier: bool = True
    ) -> None:
        """Record copies of (source offset, destination offset, size) regions."""
        copies = _ffi.new("VkBufferCopy[]", [{"srcOffset": s, "dstOffset": d, "size": n} for s, d, n in regions])
        _lib.vkCmdCopyBuffer(self._commands(), source.handle, destination.handle, len(regions), copies)
        if barrier:
            self._barrier_after()

    def _write(self, buffer: Buffer, offset: int, data: np.ndarray) -> None:
        staging, at = self._stage(data.data)
        self._copy(staging, buffer, [(at, offset, data.nbytes)])

    def _read(self, ranges: Sequence[tuple[Buffer, int, int]]) -> np.ndarray:
        """Copy buffer ranges, concatenated, to the host (submits everything recorded and waits)."""
        total = sum(size for _, _, size in ranges)
        if self._readback is None or self._readback.size < total:
            # the new one first: where it does not fit, the old one stays (retired, it was destroyed at the next
            # flush while still kept here, and destroyed again when retired the next time: a double free)
            readback = self._allocate(
                max(total, 1 << 16), vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT, _HOST, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
            )
            if self._readback is not None:
                self._graveyard.append(self._readback)
            self._readback = readback
        at = 0
        for buffer, offset, size in ranges:
            self._copy(buffer, self._readback, [(offset, at, size)], barrier=False)
            at += size
        self._barrier_after()
        self.flush()
        assert self._readback.mapped is not None
        return np.frombuffer(self._readback.mapped[:total], dtype=np.uint8).copy()

    def _write_regions(self, buffer: Buffer, regions: list[tuple[int, int]], host: np.ndarray) -> None:
        staging, offset = self._stage(host.data)
        copies, at = [], offset
        for destination, size in regions:
            copies.append((at, destination, size))
            at += size
        self._copy(staging, buffer, copies)
        self.flush()

    def _copy_within(self, buffer: Buffer, copies: list[tuple[int, int, int]]) -> None:
        self._copy(buffer, buffer, copies)  # Vulkan copies within a buffer where the regions do not overlap

    # -- pipelines and dispatch --------------------------------------------------------

    def _pipeline(self, entry: Entry) -> tuple[Any, Any, Any]:
        found = self._pipelines.get(entry.name)
        if found is None:
            code = runtime_spirv(entry.code, entry.name) if entry.code else spirv(entry.name)
            module = vk.vkCreateShaderModule(
                self.device, vk.VkShaderModuleCreateInfo(codeSize=len(code), pCode=code), None
            )
            bindings = [
                vk.VkDescriptorSetLayoutBinding(
                    binding=index,
                    descriptorType=_DESCRIPTOR_TYPES[kind],
                    descriptorCount=1,
                    stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                )
                for index, kind in entry.bindings
            ]
            set_layout = vk.vkCreateDescriptorSetLayout(
                self.device, vk.VkDescriptorSetLayoutCreateInfo(bindingCount=len(bindings), pBindings=bindings), None
            )
            layout = vk.vkCreatePipelineLayout(
                self.device, vk.VkPipelineLayoutCreateInfo(setLayoutCount=1, pSetLayouts=[set_layout]), None
            )
            name = entry.name  # kept alive until the pipeline exists (cffi frees temporaries)
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT, module=module, pName=name)
            pipeline = vk.vkCreateComputePipelines(
                self.device, None, 1, [vk.VkComputePipelineCreateInfo(stage=stage, layout=layout)], None
            )[0]
            vk.vkDestroyShaderModule(self.device, module, None)
            found = self._pipelines[entry.name] = (pipeline, layout, set_layout)
        return found

    def _new_descriptor_pool(self) -> Any:
        sizes = [
            vk.VkDescriptorPoolSize(
                type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=DESCRIPTOR_SETS * _MAX_BINDINGS
            ),
            vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_UNIFORM_BUFFER_DYNAMIC, descriptorCount=DESCRIPTOR_SETS),
        ]
        return vk.vkCreateDescriptorPool(
            self.device,
            vk.VkDescriptorPoolCreateInfo(maxSets=DESCRIPTOR_SETS, poolSizeCount=len(sizes), pPoolSizes=sizes),
            None,
        )

    def _descriptor_set(self, entry: Entry, set_layout: Any, bindings: Sequence[BufferRange]) -> Any:
        key = (entry.name, *((id(buffer), offset, size) for buffer, offset, size in bindings))
        cached = self._descriptor_sets.get(key)
        if cached is not None:
            return cached[0]
        if len(self._descriptor_sets) >= DESCRIPTOR_SETS:
            self.flush()  # no recorded command may still use a set when the pool resets
            vk.vkResetDescriptorPool(self.device, self._descriptor_pool, 0)
            self._descriptor_sets.clear()
        handle = vk.vkAllocateDescriptorSets(
            self.device,
            vk.VkDescriptorSetAllocateInfo(
                descriptorPool=self._descriptor_pool, descriptorSetCount=1, pSetLayouts=[set_layout]
            ),
        )[0]
        infos = [(entry.uniform_binding, _DESCRIPTOR_TYPES["uniform"], self._params_buffer.handle, 0, entry.params_size)]
        for (index, kind), (buffer, offset, size) in zip(entry.storage_bindings, bindings, strict=True):
            infos.append((index, _DESCRIPTOR_TYPES[kind], buffer.handle, offset, size))
        writes = [
            vk.VkWriteDescriptorSet(
                dstSet=handle,
                dstBinding=index,
                descriptorCount=1,
                descriptorType=kind,
                pBufferInfo=[vk.VkDescriptorBufferInfo(buffer=buffer, offset=offset, range=size)],
            )
            for index, kind, buffer, offset, size in infos
        ]
        vk.vkUpdateDescriptorSets(self.device, len(writes), writes, 0, None)
        pointer = _ffi.new("VkDescriptorSet[1]", [handle])
        # The bindings stay referenced so their ids stay unique while the key is cached.
        self._descriptor_sets[key] = (pointer, tuple(bindings))
        return pointer

    def dispatch(
        self, entry: Entry, params: bytes, bindings: Sequence[BufferRange], groups: tuple[int, int, int]
    ) -> None:
        pipeline, layout, set_layout = self._pipeline(entry)
        descriptor_set = self._descriptor_set(entry, set_layout, bindings)
        self._offset_slot[0] = self._place_params(params)
        command = self._commands()
        _lib.vkCmdBindPipeline(command, _COMPUTE, pipeline)
        _lib.vkCmdBindDescriptorSets(command, _COMPUTE, layout, 0, 1, descriptor_set, 1, self._offset_slot)
        _lib.vkCmdDispatch(command, *groups)
        self._barrier_after()

    # -- submission ------------------------------------------------------------------

    def _commands(self) -> Any:
        if not self._recording:
            begin = vk.VkCommandBufferBeginInfo(flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
            vk.vkBeginCommandBuffer(self._command, begin)
            self._recording = True
        return self._command

    def _barrier_after(self) -> None:
        """Order everything recorded so far before whatever is recorded next."""
        _lib.vkCmdPipelineBarrier(self._command, _STAGES, _STAGES, 0, 1, self._barrier, 0, _ffi.NULL, 0, _ffi.NULL)

    @_reports_device_loss
    def flush(self) -> None:
        """Submit everything recorded and wait for it; then reset the rings and free retired buffers."""
        params = self._take_params()
        assert self._params_buffer.mapped is not None
        self._params_buffer.mapped[: len(params)] = params
        if self._recording:
            vk.vkEndCommandBuffer(self._command)
            self._recording = False
            submit = vk.VkSubmitInfo(commandBufferCount=1, pCommandBuffers=[self._command])
            vk.vkQueueSubmit(self.queue, 1, [submit], self._fence)
            self.submissions += 1
            vk.vkWaitForFences(self.device, 1, [self._fence], vk.VK_TRUE, 0xFFFFFFFFFFFFFFFF)
            vk.vkResetFences(self.device, 1, [self._fence])
            vk.vkResetCommandBuffer(self._command, 0)
        self._staging_used = 0
        graveyard, self._graveyard[:] = list(self._graveyard), []
        for buffer in graveyard:
            self._destroy(buffer)
        if self._retired_storage:
            # Cached descriptor sets may name the destroyed buffers.
            self._retired_storage = False
            vk.vkResetDescriptorPool(self.device, self._descriptor_pool, 0)
            self._descriptor_sets.clear()

    def synchronize(self) -> None:
        self.flush()
