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
from pie.eta import Epilogue
from pie.eta import compile as compile_eta

from pie_engine_cuda.runtime import GpuDevice
from pie_engine_cuda.tensor import DeviceTensor

_TENSOR_DTYPES = {"f32": "float32", "i32": "int32"}
class EpilogueKernel:
    """One compiled epilogue bound to a device; call it with tensors and param values by name."""

    def __init__(self, rt: GpuDevice, epilogue: Epilogue):
        rendered = epilogue.render("hip" if rt.api.backend == "hip" else "cuda")
        self.rt = rt
        self.epilogue = epilogue
        self.layout = layout = rendered.bindings
        # An API whose entry points take one packed pointer (the tests' host emulator) wraps the source.
        wrap = getattr(rt.api, "wrap_generated", None)
        source, name = wrap(rendered) if wrap is not None else (rendered.source, rendered.entry_point)
        module = rt.load_source(rendered.entry_point, source)
        self._params_bytes = 4 * len(layout.fields)  # the C struct: 4-byte fields, no padding
        fields: list[tuple[str, Any]] = [(f"b{b.slot}", ctypes.c_uint64) for b in layout.buffers]
        fields.append(("p", ctypes.c_uint8 * self._params_bytes))
        packed = type(f"{rendered.entry_point}_packed", (ctypes.Structure,), {"_fields_": fields})
        self.args = packed()
        params = tuple((getattr(packed, f).offset, ctypes.sizeof(t)) for f, t in fields)
        self._params_address = ctypes.addressof(self.args) + params[-1][0]
        self._launch = rt.api.bind(rt.api.get_function(module, name), self.args, params)

    def __call__(self, rows: int | None = None, cols: int | None = None, **values: Any) -> dict[str, DeviceTensor]:
        layout = self.layout
        inputs = [b for b in layout.buffers if b.role == "input"]
        missing = [b.name for b in inputs if b.name not in values]
        if missing:
            raise TypeError(f"epilogue {self.epilogue.entry_point} needs the tensors {', '.join(missing)}")
        rows, cols = self._shape(rows, cols, values)
        params = {f.name: values[f.name] for f in layout.fields if f.name not in ("rows", "cols")}
        outputs = {b.name: self.rt.empty((rows, cols), _TENSOR_DTYPES[b.dtype.value]) for b in layout.buffers
                   if b.role == "output"}
        for b in layout.buffers:
            tensor = values[b.name] if b.role == "input" else outputs[b.name]
            setattr(self.args, f"b{b.slot}", tensor.ptr)
        packed = layout.pack_params(rows, cols, **params)[: self._params_bytes]
        ctypes.memmove(self._params_address, packed, len(packed))
        if rows and cols:
            groups_x, groups_y = layout.groups(rows, cols)
            self._launch(groups_x, groups_y, 1, layout.workgroup_size, 1, 1, 0)
        return outputs

    def _shape(self, rows: int | None, cols: int | None, values: dict[str, Any]) -> tuple[int, int]:
        for b in self.layout.buffers:
            if b.role != "input":
                continue
            shape = values[b.name].shape
            if b.shape == "rows,cols":
                rows, cols = (shape[0], shape[1]) if rows is None or cols is None else (rows, cols)
            elif b.shape == "rows" and rows is None:
                rows = shape[0]
            elif b.shape == "cols" and cols is None:
                cols = shape[0]
        if rows is None or cols is None:
            raise TypeError("give rows and cols: no input tensor fixes the epilogue's shape")
        return int(rows), int(cols)


def make_epilogue(rt: GpuDevice, request: KernelRequest) -> Launcher:
    """The program of option ``source``, its tensors positional in declared order, params (option
    ``params``, (name, value) pairs) fixed now; returns the program's first output."""
    kernel = EpilogueKernel(rt, compile_eta(str(request.option("source"))))
    params = dict(request.option("params", ()))
    names = [spec.name for spec in kernel.epilogue.inputs]
    first = kernel.epilogue.outputs[0].name

    def epilogue(*inputs: DeviceTensor) -> DeviceTensor:
        if len(inputs) != len(names):
            raise TypeError(f"epilogue {kernel.epilogue.entry_point} takes {len(names)} tensors "
                            f"({', '.join(names)}), not {len(inputs)}")
        return kernel(**dict(zip(names, inputs)), **params)[first]

    return epilogue
