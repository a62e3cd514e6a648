"""The Metal driver: `pie_engine_metal.driver.Driver` over PyObjC (macOS only; imported lazily).

One command queue per device. Dispatches go into one serial compute encoder of an
open command buffer; :meth:`MetalDriver.commit` ends the encoder and submits the
buffer, :meth:`MetalDriver.wait` waits for every submitted one and reports a failed
one with Metal's error. Command buffers of one queue execute in order and Metal tracks
hazards on the (tracked, shared-storage) buffers, so nothing else orders the work.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

from pie_engine_metal.driver import Pipeline, Size
from pie_engine_metal.library import Constant

_PACK = {"bool": "<?", "uint": "<I", "float": "<f"}
_DATA_TYPE = {"bool": 53, "uint": 33, "float": 3}  # MTLDataTypeBool, MTLDataTypeUInt, MTLDataTypeFloat
_metadata_registered = False


class MetalError(RuntimeError):
    """Metal refused something (compilation, pipeline, command buffer); the message carries its log."""


def _describe_error(error: Any) -> str:
    return str(error.localizedDescription()) if error is not None else "no error detail"


def _register_metadata() -> None:
    """Tell PyObjC that ``setConstantValue:type:atIndex:`` reads a byte buffer (its headers only say ``void *``)."""
    global _metadata_registered
    if _metadata_registered:
        return
    import objc

    objc.registerMetaDataForSelector(
        b"MTLFunctionConstantValues",
        b"setConstantValue:type:atIndex:",
        {"arguments": {2: {"type_modifier": objc._C_IN, "c_array_of_variable_length": True}}},
    )
    _metadata_registered = True


class MetalDriver:
    def __init__(self, device: Any):
        import Metal

        _register_metadata()
        self._metal = Metal
        self.device = device
        self.queue = device.newCommandQueue()
        if self.queue is None:
            raise MetalError(f"{device.name()}: could not create a command queue")
        self._command_buffer: Any = None
        self._encoder: Any = None
        self._submitted: list[Any] = []

    def new_buffer(self, nbytes: int) -> Any:
        buffer = self.device.newBufferWithLength_options_(nbytes, self._metal.MTLResourceStorageModeShared)
        if buffer is None:
            raise MemoryError(f"Metal could not allocate a buffer of {nbytes} bytes on {self.device.name()}")
        return buffer

    def contents(self, buffer: Any, nbytes: int) -> memoryview:
        return buffer.contents().as_buffer(nbytes)

    def compile_library(self, name: str, source: str) -> Any:
        Metal = self._metal
        options = Metal.MTLCompileOptions.new()
        # IEEE semantics (infinities in the softmax and argmax kernels); fast math would assume none.
        if options.respondsToSelector_(b"setMathMode:"):
            options.setMathMode_(Metal.MTLMathModeSafe)
        else:
            options.setFastMathEnabled_(False)
        library, error = self.device.newLibraryWithSource_options_error_(source, options, None)
        if library is None:
            raise MetalError(f"{name}.metal did not compile: {_describe_error(error)}")
        return library

    def new_pipeline(
        self, library: Any, function: str, constants: Sequence[tuple[Constant, bool | int | float]]
    ) -> Pipeline:
        values = self._metal.MTLFunctionConstantValues.new()
        for constant, value in constants:
            data = struct.pack(_PACK[constant.kind], value)
            values.setConstantValue_type_atIndex_(data, _DATA_TYPE[constant.kind], constant.index)
        specialised, error = library.newFunctionWithName_constantValues_error_(function, values, None)
        if specialised is None:
            raise MetalError(f"{function}: {_describe_error(error)}")
        state, error = self.device.newComputePipelineStateWithFunction_error_(specialised, None)
        if state is None:
            raise MetalError(f"{function}: no pipeline state: {_describe_error(error)}")
        return Pipeline(state, int(state.maxTotalThreadsPerThreadgroup()), int(state.threadExecutionWidth()))

    def encode(
        self, pipeline: Pipeline, buffers: Sequence[tuple[Any, int]], params: bytes, groups: Size, threads: Size
    ) -> None:
        encoder = self._encoder
        if encoder is None:
            import objc

            with objc.autorelease_pool():
                self._command_buffer = self.queue.commandBuffer()
                encoder = self._encoder = self._command_buffer.computeCommandEncoder()
        encoder.setComputePipelineState_(pipeline.handle)
        for index, (buffer, offset) in enumerate(buffers):
            encoder.setBuffer_offset_atIndex_(buffer, offset, index)
        encoder.setBytes_length_atIndex_(params, len(params), len(buffers))
        make = self._metal.MTLSizeMake
        encoder.dispatchThreadgroups_threadsPerThreadgroup_(make(*groups), make(*threads))

    def commit(self) -> None:
        if self._encoder is None:
            return
        self._encoder.endEncoding()
        self._command_buffer.commit()
        self._submitted.append(self._command_buffer)
        self._encoder = self._command_buffer = None

    def wait(self) -> None:
        submitted, self._submitted = self._submitted, []
        failed = None
        for command_buffer in submitted:
            command_buffer.waitUntilCompleted()
            if failed is None and command_buffer.status() == self._metal.MTLCommandBufferStatusError:
                failed = command_buffer
        if failed is not None:
            raise MetalError(f"a command buffer failed: {_describe_error(failed.error())}")
