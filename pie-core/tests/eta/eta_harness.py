"""Compile and run rendered eta kernels on every toolchain this machine has.

NVRTC and hiprtc compile (no GPU to run on); PoCL runs OpenCL C and lavapipe runs WGSL
through wgpu; Metal source is compiled as C++ against a small shim of the Metal types and
functions it uses (metal_shim/) and run on CPU threads. Every runner takes a batch of
kernels that share one module source, so a test pays each compiler's fixed cost once.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pie.eta import Epilogue, RenderedKernel
from pie.eta.evaluate import ArrayBackend, bind, evaluate
from pie.eta.ir import Node, Reduce, postorder
from pie.eta.render.layout import BindingLayout

# Values at the edges of the casts and roundings: half-way cases, overflow, subnormals,
# infinities, NaN, the ends of the i32 range.
EDGES = np.array(
    [
        0.0,
        -0.0,
        1.0,
        -1.5,
        0.1,
        65504.0,
        65519.0,
        65520.0,
        -65520.0,
        1e5,
        6.0e-8,
        2.0e-8,
        3.0e-8,
        6.1e-5,
        1e-30,
        3.3895e38,
        3.4e38,
        np.inf,
        -np.inf,
        np.nan,
        2147483520.0,
        2147483648.0,
        -2147483648.0,
        -3e9,
        1.00048828125,
        1.0009765625,
        1.00390625,
        1.005859375,
        257.5,
        -0.49999997,
    ],
    dtype=np.float32,
)
SHIM = Path(__file__).with_name("metal_shim")
HIPRTC_CHILD = Path(__file__).with_name("eta_hiprtc_child.py")
_ARCHS = {"sm_80": ("compute_80", "sm_80"), "sm_90": ("compute_90", "sm_90")}


@dataclass
class Case:
    """One launch: an epilogue and its numpy arguments."""

    epilogue: Epilogue
    inputs: dict[str, np.ndarray]
    params: dict[str, float | int | bool]
    shape: tuple[int, int]

    def reference(self) -> dict[str, np.ndarray]:
        return self.epilogue.numpy_fn()(**self.inputs, **self.params)


def random_case(ep: Epilogue, rows: int, cols: int, rng: np.random.Generator, scale: float = 2.0) -> Case:
    sizes = {"rows,cols": (rows, cols), "cols": (cols,), "rows": (rows,)}
    inputs = {}
    for i in ep.inputs:
        shape = sizes[i.shape.value]
        if i.dtype.value == "i32":
            inputs[i.name] = rng.integers(-50, 50, size=shape, dtype=np.int32)
        else:
            inputs[i.name] = (rng.uniform(-scale, scale, size=shape)).astype(np.float32)
    params = {}
    for p in ep.params:
        if p.dtype.value == "i32":
            params[p.name] = int(rng.integers(-20, 20))
        elif p.dtype.value == "bool":
            params[p.name] = bool(rng.integers(0, 2))
        else:
            params[p.name] = float(np.float32(rng.uniform(0.25, 2.0)))
    return Case(ep, inputs, params, (rows, cols))


def perturbed(case: Case, rng: np.random.Generator, relative: float = 1e-6) -> Case:
    """The case with every float input and param moved by about `relative`."""
    inputs = {
        k: (v * (1 + relative * rng.choice([-1.0, 1.0], size=v.shape))).astype(np.float32)
        if v.dtype == np.float32
        else v
        for k, v in case.inputs.items()
    }
    params = {k: float(np.float32(v * (1 + relative))) if isinstance(v, float) else v for k, v in case.params.items()}
    return Case(case.epilogue, inputs, params, case.shape)


def disagreement(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Elements that differ: integers exactly, floats beyond tolerance (NaN equals NaN)."""
    if want.dtype == np.int32:
        return got != want
    return ~np.isclose(got, want, rtol=rtol, atol=atol, equal_nan=True)


def ill_conditioned(case: Case, reference: dict[str, np.ndarray], rtol: float, atol: float) -> dict[str, np.ndarray]:
    """Elements whose value moves beyond tolerance when the inputs move by ~1e-6: there the
    few-ulp differences between targets' math libraries are amplified, or a comparison,
    cast or rounding sits on its threshold, so no target can be held to numpy's bits."""
    rng = np.random.default_rng(0)
    masks = {name: np.zeros(case.shape, bool) for name in reference}
    for _ in range(2):
        other = perturbed(case, rng).reference()
        for name, value in reference.items():
            masks[name] |= disagreement(other[name], value, rtol / 10, atol / 10)
    return masks


def _paths(case: Case, source: Callable[[Node, np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    """Elements of each output whose computation passed through an element where ``source(node, value)`` holds
    (through a reduction, the whole row)."""
    ep = case.epilogue
    values, shape = bind(ep, {**case.inputs, **case.params}, np)
    with np.errstate(all="ignore"):
        results = evaluate(ep, ArrayBackend(np), values, shape)
        tainted: dict[int, np.ndarray] = {}
        for node in postorder(o.value for o in ep.outputs):
            value = np.broadcast_to(results[id(node)], shape)
            bad = source(node, value) if node.dtype.is_float else np.zeros(shape, bool)
            for arg in node.args:
                bad = bad | tainted[id(arg)]
            if isinstance(node, Reduce):
                bad = np.broadcast_to(bad.any(axis=1, keepdims=True), shape)
            tainted[id(node)] = bad
    return {o.name: tainted[id(o.value)] for o in ep.outputs}


def non_finite_paths(case: Case) -> dict[str, np.ndarray]:
    """Elements whose computation passed through an infinite, NaN or subnormal value
    (through a reduction, the whole row): targets without IEEE guarantees may differ there."""
    return _paths(case, lambda node, value: ~np.isfinite(value) | ((np.abs(value) < np.finfo(np.float32).tiny)
                                                                   & (value != 0)))


def signed_zero_paths(case: Case) -> dict[str, np.ndarray]:
    """Elements whose computation passed through a zero that a max or min chose: of -0 and +0, IEEE leaves which one
    to the target (C's fmax, a reduction's order), and a division or rsqrt makes the sign an infinity's."""
    return _paths(case, lambda node, value: (getattr(node, "op", None) in ("max", "min")) & (value == 0))


def output_arrays(layout: BindingLayout, rows: int, cols: int) -> dict[str, np.ndarray]:
    return {
        b.name: np.full((rows, cols), 123456, dtype=np.float32 if b.dtype.value == "f32" else np.int32)
        for b in layout.buffers
        if b.role == "output"
    }


# -- NVRTC / hiprtc ----------------------------------------------------------------------


def nvrtc_compile(source: str, arch: str, cubin: bool, options: tuple[str, ...] = ()) -> bytes:
    """PTX (`cubin=False`) or CUBIN for an sm_XX arch; raises with the compiler log."""
    from cuda.bindings import nvrtc

    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"eta.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    try:
        virtual, real = _ARCHS[arch]
        options = [
            f"--gpu-architecture={real if cubin else virtual}".encode(),
            b"--std=c++17",
            *(o.encode() for o in options),
        ]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(options), options)
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # b" " * 1 is the interpreter's shared b" ": NVRTC would write over it
        nvrtc.nvrtcGetProgramLog(prog, log)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC failed for {arch}:\n{log.decode(errors='replace')[:4000]}")
        get_size, get = (
            (nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if cubin else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX)
        )
        _, size = get_size(prog)
        code = bytearray(size)
        get(prog, code)
        return bytes(code)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def hiprtc_compile(source: str, arch: str = "gfx90a") -> bytes:
    """A code object for `arch`, compiled in a child process (see eta_hiprtc_child.py)."""
    env = dict(os.environ, ROCM_PATH=_hip_root())
    done = subprocess.run(
        [sys.executable, str(HIPRTC_CHILD), arch], input=source.encode(), capture_output=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr.decode(errors="replace")[-4000:])
    return done.stdout


@functools.cache
def _hip_root() -> str:
    """hip-python dlopens `libhiprtc.so` from $ROCM_PATH/lib; Debian's ROCm 5.2 has hiprtc
    inside libamdhip64 and no such file. Returns $ROCM_PATH if it has the library, else a
    temporary directory holding the missing link."""
    existing = os.environ.get("ROCM_PATH", "/opt/rocm")
    if Path(existing, "lib", "libhiprtc.so").exists():
        return existing
    target = next(
        (p for p in ("/usr/lib/x86_64-linux-gnu/libamdhip64.so.5", "/opt/rocm/lib/libamdhip64.so") if Path(p).exists()),
        None,
    )
    if target is None:
        raise RuntimeError("libamdhip64 not found: apt-get install libamdhip64-dev")
    root = Path(tempfile.mkdtemp(prefix="eta-rocm-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    (root / "lib").mkdir()
    (root / "lib" / "libhiprtc.so").symlink_to(target)
    return str(root)


# -- OpenCL (PoCL) -------------------------------------------------------------------------


class OpenCLRunner:
    def __init__(self) -> None:
        import pyopencl as cl

        self.cl = cl
        self.context = next(c for c in map(_context_that_builds, _pocl_devices(cl)) if c is not None)
        self.queue = cl.CommandQueue(self.context)

    def build(self, kernels: list[RenderedKernel]):
        return self.cl.Program(self.context, kernels[0].source).build()

    def run(self, program, kernel: RenderedKernel, case: Case, in_place: dict[str, str] | None = None):
        """Launch once; `in_place` maps outputs to the inputs whose buffer they write over."""
        cl, layout = self.cl, kernel.bindings
        rows, cols = case.shape
        outputs = output_arrays(layout, rows, cols)
        flags = cl.mem_flags
        named = {}
        for b in layout.buffers:
            if b.name in (in_place or {}):
                named[b.name] = named[in_place[b.name]]
                continue
            host = case.inputs[b.name] if b.role == "input" else outputs[b.name]
            named[b.name] = cl.Buffer(
                self.context, flags.READ_WRITE | flags.COPY_HOST_PTR, hostbuf=np.ascontiguousarray(host)
            )
        buffers = [named[b.name] for b in layout.buffers]
        k = cl.Kernel(program, kernel.entry_point)
        k.set_args(*buffers, layout.pack_params(rows, cols, **case.params))
        gx, gy = layout.groups(rows, cols)
        cl.enqueue_nd_range_kernel(self.queue, k, (gx * layout.workgroup_size, gy), (layout.workgroup_size, 1))
        for b, buffer in zip(layout.buffers, buffers, strict=True):
            if b.role == "output":
                cl.enqueue_copy(self.queue, outputs[b.name], buffer)
        self.queue.finish()
        return outputs


def _pocl_devices(cl) -> list:
    return [d for p in cl.get_platforms() if p.name == "Portable Computing Language" for d in p.get_devices()]


def _context_that_builds(device):
    """A context on `device` if it can build a kernel: the PoCL bundled in pyopencl's wheel
    (3.0-rc2) fails with "unknown target CPU 'generic'" on some CPUs, Debian's works."""
    import pyopencl as cl

    context = cl.Context([device])
    try:
        cl.Program(context, "__kernel void probe(__global float* x) { x[0] = 1.0f; }").build()
    except cl.RuntimeError:
        return None
    return context


# -- WGSL on lavapipe (wgpu) -----------------------------------------------------------


class WgpuRunner:
    def __init__(self) -> None:
        import wgpu

        self.wgpu = wgpu
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        self.adapter_name = adapter.info["device"]
        self.device = adapter.request_device_sync()

    def build(self, kernels: list[RenderedKernel]):
        return self.device.create_shader_module(code=kernels[0].source)

    def pipeline_layout(self, layout: BindingLayout):
        """An explicit layout of every binding: an entry point need not use them all."""
        wgpu = self.wgpu
        kinds = {"input": wgpu.BufferBindingType.read_only_storage, "output": wgpu.BufferBindingType.storage}
        entries = [
            {"binding": b.slot, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kinds[b.role]}}
            for b in layout.buffers
        ]
        entries.append(
            {
                "binding": layout.params_slot,
                "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {"type": wgpu.BufferBindingType.uniform},
            }
        )
        group = self.device.create_bind_group_layout(entries=entries)
        return self.device.create_pipeline_layout(bind_group_layouts=[group])

    def run(self, module, kernel: RenderedKernel, case: Case) -> dict[str, np.ndarray]:
        wgpu, device, layout = self.wgpu, self.device, kernel.bindings
        rows, cols = case.shape
        outputs = output_arrays(layout, rows, cols)
        usage = wgpu.BufferUsage
        pipeline = device.create_compute_pipeline(
            layout=self.pipeline_layout(layout), compute={"module": module, "entry_point": kernel.entry_point}
        )
        buffers = []
        for b in layout.buffers:
            host = case.inputs[b.name] if b.role == "input" else outputs[b.name]
            data = np.ascontiguousarray(host).tobytes() or b"\0" * 4  # zero-size bindings are invalid
            buffers.append(device.create_buffer_with_data(data=data, usage=usage.STORAGE | usage.COPY_SRC))
        params = device.create_buffer_with_data(data=layout.pack_params(rows, cols, **case.params), usage=usage.UNIFORM)
        entries = [
            {"binding": b.slot, "resource": {"buffer": buf}} for b, buf in zip(layout.buffers, buffers, strict=True)
        ]
        entries.append({"binding": layout.params_slot, "resource": {"buffer": params}})
        bind_group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=entries)
        encoder = device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, bind_group)
        compute.dispatch_workgroups(*layout.groups(rows, cols))
        compute.end()
        device.queue.submit([encoder.finish()])
        for b, buffer in zip(layout.buffers, buffers, strict=True):
            if b.role == "output" and outputs[b.name].size:
                outputs[b.name] = np.frombuffer(device.queue.read_buffer(buffer), dtype=outputs[b.name].dtype).reshape(
                    rows, cols
                )
        return outputs


# -- Metal, compiled as C++ against metal_shim/ and run on CPU threads --------------------

_METAL_DRIVER = """
static std::barrier<>* eta_group_barrier = nullptr;

void metal::threadgroup_barrier(metal::mem_flags) { eta_group_barrier->arrive_and_wait(); }

// One threadgroup: WG threads that meet at threadgroup_barrier.
static void eta_run_group(const std::function<void(uint)>& lane) {
    std::barrier<> barrier(WG);
    eta_group_barrier = &barrier;
    std::vector<std::thread> threads;
    for (uint l = 0; l < WG; ++l) threads.emplace_back(lane, l);
    for (auto& t : threads) t.join();
}
"""


class MetalCppRunner:
    """Compiles the MSL with the host C++ compiler (warnings are errors) into a shared library."""

    compiler = os.environ.get("CXX", "g++")

    def __init__(self) -> None:
        self.directory = tempfile.TemporaryDirectory(prefix="eta-metal-")

    def build(self, kernels: list[RenderedKernel]) -> ctypes.CDLL:
        size = kernels[0].bindings.workgroup_size
        wrappers = [self._wrapper(k) for k in {k.entry_point: k for k in kernels}.values()]
        # The threadgroup driver only where a kernel has row reductions: -Werror refuses it unused.
        driver = _METAL_DRIVER if any(k.bindings.per_row for k in kernels) else ""
        text = "\n".join([kernels[0].source, f"#define WG {size}u", driver, *wrappers])
        path = Path(self.directory.name, kernels[0].sha256[:16])
        path.with_suffix(".cpp").write_text(text)
        command = [
            self.compiler,
            "-std=c++20",
            "-O1",
            "-shared",
            "-fPIC",
            "-pthread",
            f"-I{SHIM}",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Wno-attributes",
            "-Wno-unused-parameter",
            "-Wno-tautological-compare",
            "-ffp-contract=off",
            "-o",
            str(path.with_suffix(".so")),
            str(path.with_suffix(".cpp")),
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{self.compiler} rejected the Metal source:\n{done.stderr[:6000]}")
        return ctypes.CDLL(str(path.with_suffix(".so")))

    def _wrapper(self, kernel: RenderedKernel) -> str:
        layout, entry = kernel.bindings, kernel.entry_point
        args = []
        for b in layout.buffers:
            ctype = "float" if b.dtype.value == "f32" else "int"
            args.append(f"({'const ' if b.role == 'input' else ''}{ctype}*)b[{b.slot}]")
        call = f"{entry}({', '.join(args)}, p, l, uint2{{gx, gy}}, uint2{{groups_x, groups_y}})"
        lanes = "eta_run_group(lane);" if layout.per_row else "for (uint l = 0; l < WG; ++l) lane(l);"
        return (
            f'extern "C" void run_{entry}(void** b, const void* params, uint groups_x, uint groups_y) {{\n'
            f"    const {entry}_params& p = *static_cast<const {entry}_params*>(params);\n"
            f"    for (uint gy = 0; gy < groups_y; ++gy) for (uint gx = 0; gx < groups_x; ++gx) {{\n"
            f"        auto lane = [&](uint l) {{ {call}; }};\n"
            f"        {lanes}\n"
            f"    }}\n"
            f"}}\n"
        )

    def run(self, library: ctypes.CDLL, kernel: RenderedKernel, case: Case) -> dict[str, np.ndarray]:
        layout = kernel.bindings
        rows, cols = case.shape
        outputs = output_arrays(layout, rows, cols)
        arrays = [
            np.ascontiguousarray(case.inputs[b.name]) if b.role == "input" else outputs[b.name] for b in layout.buffers
        ]
        pointers = (ctypes.c_void_p * len(arrays))(*(a.ctypes.data for a in arrays))
        params = ctypes.create_string_buffer(layout.pack_params(rows, cols, **case.params))
        gx, gy = layout.groups(rows, cols)
        getattr(library, f"run_{kernel.entry_point}")(pointers, params, ctypes.c_uint(gx), ctypes.c_uint(gy))
        return outputs
