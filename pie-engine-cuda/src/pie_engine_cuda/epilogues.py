"""The catalogue's ``epilogue`` on this engine: an eta program (:mod:`pie.eta`) rendered to CUDA C (HIP
for AMD GPUs), compiled by the same compiler and disk cache as the kernel units, launched by one bound
driver call.

An epilogue kernel takes its buffers, then a struct of sizes and params, as separate kernel
parameters (eta's binding layout). The launcher keeps one packed ctypes struct of exactly that
layout and points the driver at each parameter inside it; an API whose entry points take one
pointer (the tests' host emulator) wraps the source in a trampoline that unpacks the same struct.
"""

from __future__ import annotations

import ctypes
from typing import Any

from pie.contract import KernelRequest, Launcher
from pie.enginekit.catalogue import EpilogueProgram

from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor


class EpilogueKernel:
    """One compiled epilogue bound to a device, its params fixed."""

    def __init__(self, rt: GpuDevice, request: KernelRequest):
        self.rt = rt
        self.program = program = EpilogueProgram(request, "hip" if rt.api.backend == "hip" else "cuda")
        rendered = program.rendered
        self.layout = layout = program.layout
        # An API whose entry points take one packed pointer (the tests' host emulator) wraps the source.
        wrap = getattr(rt.api, "wrap_generated", None)
        source, name = wrap(rendered) if wrap is not None else (rendered.source, rendered.entry_point)
        module = rt.load_source(rendered.entry_point, source)
        self._params_bytes = 4 * len(layout.fields)  # the C struct: 4-byte fields, no padding
        fields: list[tuple[str, Any]] = [(f"b{b.slot}", ctypes.c_uint64) for b in layout.buffers]
        fields.append(("p", ctypes.c_uint8 * self._params_bytes))
        packed = type(f"{rendered.entry_point}_packed", (ctypes.Structure,), {"_fields_": fields})
        self.args = packed()
        param_layout = tuple((getattr(packed, f).offset, ctypes.sizeof(t)) for f, t in fields)
        self._params_address = ctypes.addressof(self.args) + param_layout[-1][0]
        self._launch = rt.api.bind(rt.api.get_function(module, name), self.args, param_layout)

    def __call__(self, *inputs: DeviceTensor) -> list[DeviceTensor]:
        """Every output of the program, from its input tensors in declared order."""
        rows, cols, outputs = self.program.outputs(inputs, self.rt.empty)
        for binding, tensor in zip(self.layout.buffers, (*inputs, *outputs)):
            setattr(self.args, f"b{binding.slot}", tensor.ptr)
        packed = self.program.packed_params(rows, cols)[: self._params_bytes]
        ctypes.memmove(self._params_address, packed, len(packed))
        if rows and cols:
            groups_x, groups_y = self.layout.groups(rows, cols)
            self._launch(groups_x, groups_y, 1, self.layout.workgroup_size, 1, 1, 0)
        return outputs


def make_epilogue(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """The program of option ``source``, its tensors positional in declared order, params (option
    ``params``, (name, value) pairs) fixed now; returns the program's first output."""
    kernel = EpilogueKernel(rt, request)

    def epilogue(*inputs: DeviceTensor) -> DeviceTensor:
        return kernel(*inputs)[0]

    return epilogue
