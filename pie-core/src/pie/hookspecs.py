"""The engine contract: every hook an engine plugin may implement.

An engine is a module (or object) registered under the entry-point group
``pie.engines``. Each engine lives in a plugin manager of its own, so a hook
call reaches exactly one engine; the runtime never calls these hooks directly
but goes through the typed facade in :mod:`pie.plugins`.

Hooks marked *required* must be implemented; the others have defaults in the
facade. An implementation is a function marked with :data:`hookimpl`, named as
its hook; pluggy passes the arguments by name, so it names them as the hook
does (it may take fewer). One that names a hook or an argument the contract
does not have is listed as broken, saying which. Heavy backend libraries (jax,
wgpu, vulkan, cuda) must be imported inside hook bodies that need a device,
never at module import time, so listing engines stays cheap.

Tensors passed to and returned from kernel hooks are the engine's own device
objects (numpy arrays for the CPU engine). The runtime only moves them between
hooks and converts them with :func:`pie_upload` / :func:`pie_download`; the
argument checks of :mod:`pie.enginekit.catalogue` read their ``shape`` (a tuple)
and ``dtype`` (equal to ``"float32"`` or ``"int32"``, as a numpy dtype is).

An engine that cannot run raises, from its import or a probing hook
(:func:`pie_engine_info`, :func:`pie_probe_devices`, :func:`pie_list_kernels`),
an exception whose message says why; it is then listed as broken with that
message. A setting of the engine's own that the user gave it and that it cannot
read, or that names nothing here (``PIE_CPU_ACTIVATIONS=xyz``,
``PIE_VULKAN_DEVICE=7`` beside one device), is the user's mistake, not the
engine's: raise :class:`pie.plugins.EngineSettingError` (or another exception
``from`` one) naming the variable, its value and what it may be. Its fix then
speaks of the setting, its probe is not remembered, and an engine chosen without
``--engine`` or ``PIE_ENGINES`` is never one the user would not have got: where
this engine would have outranked it (or is the CPU engine), the choice stops
with the setting's message.

A device that is gone for good while in use (a browser page closed, a GPU
context a fault left unusable: every later call would fail too) is not one
request's failure: raise :class:`pie.plugins.DeviceLost` (or a subclass of it)
from the hook or launcher that finds out, with what happened. ``pie serve`` then
stops serving, saying why in ``/health`` (``failed``, so a supervisor or the Ray
ingress restarts it), instead of failing every request that follows. Any other
exception fails the requests of that pass only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import pluggy

from pie.contract import (
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
)

if TYPE_CHECKING:
    from pie.runtime.replicated import ProcessGroup

hookspec = pluggy.HookspecMarker("pie")
hookimpl = pluggy.HookimplMarker("pie")

REQUIRED_HOOKS = (
    "pie_engine_info",
    "pie_probe_devices",
    "pie_list_kernels",
    "pie_compile_kernel",
    "pie_allocate_pages",
    "pie_upload",
    "pie_download",
)

PAIRED_HOOKS = (("pie_begin_pass", "pie_end_pass"), ("pie_join_process_group", "pie_leave_process_group"))
"""Optional hooks that go together: an engine implementing one of a pair implements both."""


# --------------------------------------------------------------------------
# Description and probing
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_engine_info() -> EngineInfo:
    """*Required.* Describe the engine: name, contract version, priority, kernel languages.

    Must be cheap: no backend library may be imported to answer it.
    """


@hookspec(firstresult=True)
def pie_probe_devices() -> Sequence[DeviceInfo]:
    """*Required.* List the devices this engine can run on, in preference order.

    May import the backend library. Return an empty list when the library loads
    but finds no device; raise an exception with a clear message when the library
    or driver itself is unusable (the engine is then listed as broken with that
    message), and :class:`pie.plugins.EngineSettingError` when a setting of the
    user's for this engine cannot be read (see the module's docstring). pie-core first calls it (with ``pie_engine_info`` and
    ``pie_list_kernels`` of the first device) in a child process of its own,
    under a timeout (``PIE_PROBE_TIMEOUT``), so a crash or a hang there marks
    only this engine as broken; it is called again in the process that uses the
    engine.
    """


@hookspec(firstresult=True)
def pie_diagnose() -> Sequence[Diagnosis]:
    """What this engine needs (libraries, drivers, system packages) and whether each is present.

    Used by ``pie doctor``; each failing item carries the exact command that fixes it.
    """


# --------------------------------------------------------------------------
# Kernel launch
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_list_kernels(device: DeviceInfo) -> Mapping[str, Sequence[str]]:
    """*Required.* Catalogue kernels this engine implements on ``device``, each with its variants.

    Keys are names from :data:`pie.kernels.CATALOG`; the first variant listed is
    the engine's default. The runtime asks this instead of probing with try/except:
    a region whose fused kernel is missing is lowered to primitives, a missing
    primitive runs on the CPU engine (``pie-engine-cpu``, where it is installed) with
    transfers around it, and without ``top_k`` tokens are picked on the host.
    ``append_kv`` and ``attention`` cannot move: an engine without them cannot run a model.
    Probes remember this answer (``pie engines --refresh`` asks again).
    """


@hookspec(firstresult=True)
def pie_unavailable_variants(device: DeviceInfo) -> Mapping[str, str]:
    """Variants this engine has but cannot offer on ``device`` here, each with why, in words that name
    what is missing: ``{"native": "native kernels are unavailable: no C compiler found"}``.

    Optional. :func:`pie_list_kernels` leaves these variants out; a profile measured with one of them
    does not apply, and the profile lookup says this reason instead of calling the profile wrong.
    """


@hookspec(firstresult=True)
def pie_weight_types(device: DeviceInfo) -> Mapping[str, Sequence[str]]:
    """The weight types (names of :data:`pie.weights.WEIGHT_TYPES`) each catalogue kernel reads as stored.

    Keys are catalogue kernel names, values the types that kernel takes for its weight inputs (the
    ``w.*`` values: a linear's weight, an embedding's table) besides ``f32``, which every kernel takes.
    A weight whose every reader takes its stored type reaches the engine in that type: as a
    :class:`pie.weights.StoredWeight` in :func:`pie_upload_weights` and then as the engine's tensor
    for it in launches. Any other weight is converted at load (``pie plan`` lists each conversion) to
    the nearest type all its readers take, float32 where nothing else fits. A region, block or stack
    launcher reads a weight in any type declared for every kernel of its ops that reads it. Optional:
    without it (or for a kernel not named) weights are float32 arrays, as before this hook.
    """


@hookspec(firstresult=True)
def pie_kv_dtypes(device: DeviceInfo) -> Sequence[str]:
    """The element types the engine keeps KV pages in (``PageLayout.dtype``: ``float32``, ``float16``,
    ``bfloat16``), float32 among them.

    ``--kv-dtype`` asks for one; the runtime refuses, naming the engine, a type not listed. A pool of a
    narrower type holds keys and values rounded to it (round to nearest even); ``append_kv`` rounds as it
    writes and ``attention`` reads them widened to float32 and accumulates in float32. Host copies
    (:func:`pie_read_pages`, :func:`pie_write_pages`) are arrays of the pool's type: ``numpy.float16``, or
    ``ml_dtypes.bfloat16``. Optional: without it, float32 only.
    """


@hookspec(firstresult=True)
def pie_compile_kernel(device: DeviceInfo, request: KernelRequest) -> Launcher:
    """*Required.* Compile ``request`` for ``device`` and return its launcher.

    This is the once-per-kernel step of the hot path: the runtime keeps the
    returned callable and calls it directly for every launch, so nothing of the
    plugin layer runs per launch. Scalars of the catalogue signature (after
    ``*``: eps, layer, scale...) arrive as ``request.options`` and are fixed at
    compile time (an option with a default may be absent or None: compile
    ``attention``'s with :func:`pie.kernels.attention_options`); the launcher takes
    only the device tensors, positionally (None for an absent optional one, such as
    ``linear``'s bias), and returns the output tensor (a tuple for ``top_k``, None
    for the in-place ``append_kv``). It checks its arguments before it launches
    (:func:`pie.enginekit.catalogue.checked_launcher`). It may queue work
    asynchronously.
    """


@hookspec(firstresult=True)
def pie_compile_region(device: DeviceInfo, region: RegionRequest) -> Launcher | None:
    """Compile a whole Poem region as one unit, or return None to have it lowered kernel by kernel.

    For engines whose compiler fuses better than fixed kernels (XLA). Called
    once per region when the plan is built; the launcher is then called
    directly, like a kernel launcher. A region that is exactly a decoder layer's attention input carries
    ``region.attention_input`` (`pie.contract.AttentionInputRegion`: the layer's description and the names
    of q, k and v), and one that appends k and v to the pages and attends carries ``region.attention``
    (`pie.contract.AttentionRegion`); an engine reads these instead of matching the ops.
    """


@hookspec(firstresult=True)
def pie_compile_block(device: DeviceInfo, block: RegionRequest) -> Launcher | None:
    """Compile a block, the run of regions that makes one unit of the model (a decoder layer), as
    one launch; None leaves the block to its regions.

    ``block.ops`` are its regions' ops in order and ``block.label`` names the unit (``L3``); a decoder
    layer's block carries ``block.layer`` (`pie.contract.DecoderLayerBlock`: its weights by role, its
    dimensions and options), which an engine reads instead of matching the ops. Poem offers a block
    after lowering its regions, and keeps them: the launcher returns the block's
    outputs as a tuple, or ``NotImplemented``, having changed nothing, for a pass it does not take
    (a prefill, more rows than its kernels serve), and Poem then runs the regions' kernels. For
    engines where the time between launches costs more than the launch itself (a CPU at batch 1,
    whose memory bus idles while Python runs between kernels).
    """


@hookspec(firstresult=True)
def pie_compile_stack(device: DeviceInfo, stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Launcher | None:
    """Compile a stack, two or more consecutive blocks each reading the one before's output (a
    model's decoder layers), as one launch; None leaves each block to its own launcher.

    ``blocks`` are the blocks' requests as ``pie_compile_block`` was offered them, in order; ``stack``
    is the run as one request: all their ops, what the run reads from outside (``stack.inputs``, the
    launcher's arguments) and the last block's outputs. Poem offers a stack only where the engine
    compiled every block of it, and keeps them: the launcher returns the stack's outputs as a tuple, or
    ``NotImplemented``, having changed nothing, for a pass it does not take, and Poem then runs the
    blocks' launchers. For engines where even one launch per block costs (a CPU at batch 1, where
    the Python of a launch per layer was a measurable share of a decode step).
    """


@hookspec(firstresult=True)
def pie_kernel_source(device: DeviceInfo, request: KernelRequest | RegionRequest) -> str | None:
    """The generated source of a kernel or region (CUDA C, WGSL, StableHLO...), for ``pie plan --emit``."""


@hookspec(firstresult=True)
def pie_synchronize(device: DeviceInfo) -> None:
    """Wait until every launch queued on ``device`` has finished. Optional: without it nothing waits (launches
    that run as they are called need none)."""


# --------------------------------------------------------------------------
# Passes
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_begin_pass(device: DeviceInfo, plan: PassPlan) -> None:
    """A forward pass on ``device`` starts: its launches follow, then :func:`pie_end_pass`.

    ``plan`` (:class:`pie.contract.PassPlan`) describes the pass from host memory: its index arrays
    (what the pass's batch tensors were uploaded from), each sequence's query and KV lengths, their
    maxima, whether it is a decode pass, and the attention work items for a tile or chunk size. Until
    ``pie_end_pass`` every launch that takes batch tensors takes this pass's, so a launcher may use the
    plan instead of reading its arguments back or recomputing what the plan holds; the engine uploads
    what it needs of it at most once per pass. Passes on one device run one at a time. Launches made
    outside a pass (a kernel test, ``pie tune``) come without a plan: launchers work from their
    arguments then. Optional: an engine without it sees only its launches.
    """


@hookspec(firstresult=True)
def pie_end_pass(device: DeviceInfo) -> None:
    """The pass begun by :func:`pie_begin_pass` is over (its last launch is queued, or it failed):
    forget its plan and whatever was made from it. Optional; an engine implementing
    ``pie_begin_pass`` implements this too."""


# --------------------------------------------------------------------------
# Page allocation and buffers
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_allocate_pages(device: DeviceInfo, layout: PageLayout) -> Any:
    """*Required.* Allocate a KV page pool of ``layout`` in device memory, zero-filled, of element type
    ``layout.dtype`` (float32, or a type :func:`pie_kv_dtypes` lists).

    Returns the engine's pool handle, passed back to ``append_kv`` and
    ``attention`` launches and to the page hooks below; the argument checks of
    :mod:`pie.enginekit.catalogue` read its ``shape`` (``layout.shape``). Which pages
    are in use is the runtime's business; the engine only owns the memory. An engine
    that implements :func:`pie_max_page_pool_layer_bytes` refuses a layout whose one
    layer is larger than that with an :class:`pie.plugins.EngineError` naming both
    sizes (``pie.enginekit.engine.DeviceEngine`` does).
    """


@hookspec(firstresult=True)
def pie_max_page_pool_layer_bytes(device: DeviceInfo) -> int | None:
    """The most bytes one layer of a page pool (``PageLayout.layer_bytes``) may take on ``device``, or None
    where nothing bounds it.

    For engines whose ``append_kv`` and ``attention`` bind one layer's pages as one buffer range, which the
    device bounds (Vulkan's ``maxStorageBufferRange``, WebGPU's ``maxStorageBufferBindingSize``: 128 MiB
    unless the adapter offers more). The runtime sizes the KV cache it chooses so that a layer fits, and
    says so; a size the user asks for (``--kv-tokens``) that does not fit is refused before the model
    loads, naming the most that does. Optional: without it, no bound.
    """


@hookspec(firstresult=True)
def pie_max_page_pool_bytes(device: DeviceInfo) -> int | None:
    """The most bytes a whole page pool (``PageLayout.num_pages * page_bytes``) may take on ``device``, or None where
    nothing bounds it.

    For engines that hold a pool in one allocation, which the device bounds (Vulkan's ``maxMemoryAllocationSize``,
    WebGPU's ``maxBufferSize``: 256 MiB unless the adapter offers more). As with
    :func:`pie_max_page_pool_layer_bytes`, the runtime sizes the KV cache it chooses so that the pool fits, and says
    so; a size the user asks for (``--kv-tokens``) that does not fit is refused before the model loads, naming the
    most that does. Optional: without it, no bound.
    """


@hookspec(firstresult=True)
def pie_free_pages(device: DeviceInfo, pool: Any) -> None:
    """Release a page pool's device memory. Optional: without it the runtime only drops its handle."""


@hookspec(firstresult=True)
def pie_read_pages(device: DeviceInfo, pool: Any, page_ids: np.ndarray) -> np.ndarray:
    """Copy pages to host memory: returns ``[num_layers, len(page_ids), 2, page_size, heads, dim]``.

    Needed, with :func:`pie_write_pages`, to fork a sequence (copy-on-write) and to swap
    it to the host page pool; without them those are an error naming the hook.
    """


@hookspec(firstresult=True)
def pie_write_pages(device: DeviceInfo, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
    """Copy host data (as returned by :func:`pie_read_pages`) into the pages ``page_ids``."""


@hookspec(firstresult=True)
def pie_copy_pages(device: DeviceInfo, pool: Any, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
    """Copy pages ``source_ids`` onto pages ``destination_ids`` of the same pool, every layer, on the device.

    Copy-on-write: a forked sequence gets a private copy of the page it shares before it appends to it.
    The two id arrays have equal lengths and no page appears in both. Optional: without it the runtime
    copies through host memory (:func:`pie_read_pages`, then :func:`pie_write_pages`).
    """


@hookspec(firstresult=True)
def pie_upload(device: DeviceInfo, array: np.ndarray) -> Any:
    """*Required.* Copy a host array to a new device tensor (weights, indices)."""


@hookspec(firstresult=True)
def pie_memory_bandwidth(device: DeviceInfo, passes: int) -> float | None:
    """Read bandwidth of the device's memory in bytes/s, measured with the engine's fastest way of
    streaming a buffer far larger than the caches: the best of ``passes`` passes. ``pie bench`` asks
    for one pass after each timed decode step (the bandwidth of that moment), so a call should cost
    little beyond its passes (the CPU engine keeps its buffer; the CUDA engine's comes from its caching
    allocator). Optional: the decode roofline of ``pie bench`` uses it, else a host BLAS GEMV."""


@hookspec(firstresult=True)
def pie_upload_weights(device: DeviceInfo, arrays: Sequence[Any]) -> Sequence[Any] | None:
    """Copy a group of weights (a layer's) to new device tensors that stay for the model's life,
    returned in order. Each is a float32 array or, only in a type the engine declared for its readers
    (:func:`pie_weight_types`), a :class:`pie.weights.StoredWeight`, whose data may be a read-only
    view of the model file: the engine copies what it keeps. Optional: an engine may place the group
    in one allocation (the CPU engine puts it on huge pages); without this hook each array goes
    through :func:`pie_upload` (so an engine that declares weight types implements this hook)."""


@hookspec(firstresult=True)
def pie_download(device: DeviceInfo, tensor: Any) -> np.ndarray:
    """*Required.* Copy a device tensor to a new row-major (C-contiguous) host array, waiting for
    pending work. Kernels may keep tensors in any strides; what reaches the host is row-major."""


# --------------------------------------------------------------------------
# Process groups
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_join_process_group(
    coordinator: str | None, num_processes: int | None, process_id: int | None
) -> ProcessGroup:
    """Join the engine's multi-process runtime, so that this process's devices and the others' form one
    mesh: called first, before any device of the engine is probed in this process (``pie serve
    --process-group``). ``coordinator`` (host:port of process 0), ``num_processes`` and ``process_id``
    are what the user gave; the engine finds what is missing its own way (environment variables, a
    TPU pod's metadata) and raises ValueError for what it cannot use. Returns this process's place
    (:class:`pie.runtime.replicated.ProcessGroup`); with one process it joins nothing. Every process
    then builds the same runner; rank 0 leads it and the others follow (:mod:`pie.runtime.replicated`).
    Optional: an engine without it runs in one process."""


@hookspec(firstresult=True)
def pie_leave_process_group() -> None:
    """Leave the runtime joined by :func:`pie_join_process_group` (after the runner is closed). Optional;
    an engine implementing ``pie_join_process_group`` implements this too."""


# --------------------------------------------------------------------------
# Profile lookup
# --------------------------------------------------------------------------


@hookspec(firstresult=True)
def pie_device_profiles() -> Sequence[str]:
    """TOML texts of the device profiles this engine ships (see :mod:`pie.profiles`)."""
