"""Optional OpenCL JIT for eta epilogues: the CPU engine's fused elementwise path.

numpy evaluates an epilogue one operation at a time, each a pass over memory; the OpenCL
rendering fuses them into one kernel that PoCL runs on all cores. Whether that wins depends
on the epilogue and the size: measure with benchmarks/eta_opencl_crossover.py. (Measured
with PoCL 3.1: the bounds check every elementwise kernel needs keeps PoCL from vectorizing
it, so numpy's SIMD loops win for light epilogues such as silu_mul.) Needs the `opencl`
extra; pyopencl is imported only when a runner is made or `available()` is asked.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np
from pie.eta import Epilogue, RenderedKernel
from pie.eta.evaluate import bind

if TYPE_CHECKING:
    import pyopencl as cl

_POCL = "Portable Computing Language"
_PROBE = "__kernel void probe(__global float* x) { x[0] = 1.0f; }"


def available() -> bool:
    """Whether pyopencl imports and finds a device that can build kernels."""
    try:
        default_device()
    except Exception:  # no module, no ICD loader, no platform or no working compiler
        return False
    return True


@cache
def default_device() -> cl.Device:
    """The first device that builds a kernel, trying PoCL's and other CPU devices first.

    Building is the real test: the PoCL inside pyopencl's wheel, for one, lists a device
    on CPUs its LLVM cannot target ("unknown target CPU 'generic'").
    """
    import pyopencl as cl

    devices = [d for p in cl.get_platforms() for d in p.get_devices()]
    devices.sort(key=lambda d: (d.platform.name != _POCL, not d.type & cl.device_type.CPU))
    for device in devices:
        try:
            cl.Program(cl.Context([device]), _PROBE).build()
        except cl.RuntimeError:
            continue
        return device
    raise RuntimeError("no OpenCL device can build kernels; install PoCL (Debian: pocl-opencl-icd) or another driver")


class OpenCLEpilogues:
    """Runs eta epilogues with OpenCL, building each rendered module once (by sha256).

    Not thread-safe: kernels are cached and their arguments set per call.
    """

    def __init__(self, device: cl.Device | None = None) -> None:
        import pyopencl as cl

        self._cl = cl
        self.device = device or default_device()
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self._rendered: dict[str, RenderedKernel] = {}
        self._programs: dict[str, cl.Program] = {}
        self._kernels: dict[tuple[str, str], cl.Kernel] = {}

    @property
    def programs_built(self) -> int:
        return len(self._programs)

    def kernel(self, rendered: RenderedKernel) -> cl.Kernel:
        """The built kernel for an OpenCL rendering; builds its module on first use."""
        key = (rendered.sha256, rendered.entry_point)
        if key not in self._kernels:
            if rendered.sha256 not in self._programs:
                self._programs[rendered.sha256] = self._cl.Program(self.context, rendered.source).build()
            self._kernels[key] = self._cl.Kernel(self._programs[rendered.sha256], rendered.entry_point)
        return self._kernels[key]

    def run(self, epilogue: Epilogue, /, **inputs_and_params: Any) -> dict[str, np.ndarray]:
        """Like `epilogue.numpy_fn()(**inputs_and_params)`, computed by the OpenCL device."""
        if epilogue.key not in self._rendered:
            self._rendered[epilogue.key] = epilogue.render("opencl")
        rendered = self._rendered[epilogue.key]
        values, (rows, cols) = bind(epilogue, inputs_and_params, np)
        outputs = {
            o.name: np.empty((rows, cols), np.float32 if o.dtype.value == "f32" else np.int32) for o in epilogue.outputs
        }
        if rows * cols == 0:
            return outputs
        cl, flags, layout = self._cl, self._cl.mem_flags, rendered.bindings
        # Buffers over the numpy arrays themselves: a CPU device reads and writes in place.
        buffers = [
            cl.Buffer(self.context, flags.READ_ONLY | flags.USE_HOST_PTR, hostbuf=np.ascontiguousarray(values[b.name]))
            if b.role == "input"
            else cl.Buffer(self.context, flags.WRITE_ONLY | flags.USE_HOST_PTR, hostbuf=outputs[b.name])
            for b in layout.buffers
        ]
        kernel = self.kernel(rendered)
        kernel.set_args(
            *buffers, layout.pack_params(rows, cols, **{p.name: values[p.name].item() for p in epilogue.params})
        )
        (gx, gy), size = layout.groups(rows, cols), layout.workgroup_size
        cl.enqueue_nd_range_kernel(self.queue, kernel, (gx * size, gy), (size, 1))
        for b, buffer in zip(layout.buffers, buffers, strict=True):
            if b.role == "output":  # mapping makes the results visible in the host array
                mapped, _ = cl.enqueue_map_buffer(
                    self.queue, buffer, cl.map_flags.READ, 0, (rows, cols), outputs[b.name].dtype
                )
                mapped.base.release(self.queue)
        self.queue.finish()
        return outputs
