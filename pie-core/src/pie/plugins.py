"""Engine discovery and the typed facade the runtime calls.

Engines register under the entry-point group ``pie.engines``. Each one gets a
plugin manager of its own, so a failing engine cannot disturb another and a
hook call reaches exactly one engine. Nothing outside this module touches pluggy.

An installed engine is first imported and probed in a child process of its own,
all of them side by side, under a timeout (``PIE_PROBE_TIMEOUT`` seconds), so one
that crashes or hangs is listed as broken with what happened and tells nothing
about the others; only an engine that passed is imported into this process, and
only when it is used. What the children found goes into the probe cache
(:mod:`pie.probe_cache`), so a warm `pie engines` starts none.

An engine named by the caller (``--engine``) is used whatever ``PIE_ENGINES``
says. Else ``PIE_ENGINES=cpu,vulkan`` selects and orders engines (like
``JAX_PLATFORMS``): only those are probed, every one of them must start, and the
first is used. Without either, the highest-priority working engine that can run
a model is used, unless an engine that would have outranked it (or the CPU engine)
cannot read a setting the user gave it (``EngineSettingError``): that is an error
naming the setting, never a reason to run another engine. ``PIE_DISABLE_PLUGIN_AUTOLOAD=1`` (or true, yes, on; or
``EngineRegistry(autoload=False)``) skips entry points, for tests that register
engines in-process (those are examined in-process).
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import functools
import inspect
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import IO, TYPE_CHECKING, Any, get_args

import numpy as np
import pluggy

from pie import hookspecs, kernels
from pie.contract import (
    CONTRACT_VERSION,
    MAX_MEMORY_BYTES,
    MAX_PRIORITY,
    DeviceInfo,
    DeviceKind,
    Diagnosis,
    EngineInfo,
    EngineStatus,
    KernelRequest,
    Launcher,
    PageLayout,
    PassPlan,
    RegionRequest,
)
from pie.probe_cache import (
    Probe,
    ProbeCache,
    cache_key,
    info_from_record,
    info_record,
    probe_from_record,
    probe_record,
)

if TYPE_CHECKING:
    from pie.runtime.replicated import ProcessGroup

ENTRY_POINT_GROUP = "pie.engines"
ENGINES_ENV = "PIE_ENGINES"
AUTOLOAD_ENV = "PIE_DISABLE_PLUGIN_AUTOLOAD"
PROBE_TIMEOUT_ENV = "PIE_PROBE_TIMEOUT"
DEFAULT_PROBE_TIMEOUT_S = 30.0
"""Seconds an engine's import and device probe may take in its child before it is listed as timed out."""
HOST_ENGINE = "cpu"
"""The engine that holds the host page pool and runs the CPU fallback."""


class EngineError(RuntimeError):
    """An engine cannot be used; the message says which and why."""


class EngineSelectionError(EngineError):
    """The engine the user asked for cannot start (never silently replaced)."""


class EngineSettingError(EngineError):
    """An engine cannot read a setting of its own that the user gave it (an environment variable such as
    ``PIE_CPU_ACTIVATIONS``); the message names the setting, its value and what it may be.

    Part of the engine contract (see :mod:`pie.hookspecs`): an engine raises it, from import or any probing
    hook, for the user's mistake rather than its own. The engine is then listed as broken with a fix about the
    setting, its probe is not remembered, and automatic selection stops with this message instead of running
    an engine the user would not have got otherwise.
    """


class DeviceLost(EngineError):
    """The engine's device is gone for good (a browser page closed, a GPU context poisoned by a fault): every later
    call on it fails too; the message says what happened.

    Part of the engine contract (see :mod:`pie.hookspecs`): an engine raises it, from any hook or launcher, where
    no call on the device can succeed again, and a plain exception where only this call failed. ``pie serve`` then
    stops serving (its /health says ``failed`` with the reason, so a supervisor or the Ray ingress restarts it)
    instead of failing request after request. It may reach the runtime wrapped (a kernel's failure keeps it as
    ``__cause__``).
    """


def lost_device(error: BaseException) -> bool:
    """Whether ``error`` is a :class:`DeviceLost` or was raised from one (a kernel's failure keeps the engine's
    exception as its cause)."""
    seen: set[int] = set()  # a chain that loops back is read once
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, DeviceLost):
            return True
        seen.add(id(cause))
        cause = cause.__cause__
    return False


def requested_engines(env: Mapping[str, str] | None = None) -> list[str] | None:
    """Engine names from ``PIE_ENGINES``, in order, or None when unset."""
    raw = (env if env is not None else os.environ).get(ENGINES_ENV, "").strip()
    if not raw:
        return None
    names = [part.strip() for part in raw.split(",") if part.strip()]
    if not names:  # set, but to separators only: not the same as unset
        raise EngineSelectionError(f"{ENGINES_ENV} is {raw!r}, which names no engine: unset it, or name engines "
                                   "(for example cpu,vulkan)")
    return names


_YES = ("1", "true", "yes", "on")
_NO = ("", "0", "false", "no", "off")


def autoload_disabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether ``PIE_DISABLE_PLUGIN_AUTOLOAD`` turns engine entry points off: 1, true, yes or on (any case)
    do; 0, false, no, off or unset do not; EngineSelectionError naming the variable for anything else."""
    raw = (env if env is not None else os.environ).get(AUTOLOAD_ENV, "")
    if raw.strip().lower() in _YES:
        return True
    if raw.strip().lower() in _NO:
        return False
    raise EngineSelectionError(f"{AUTOLOAD_ENV} is {raw!r}: set it to 1 (or true, yes, on) to load no installed "
                               "engine, or to 0 (or false, no, off), or unset it, to load them")


def env_seconds(env: Mapping[str, str], variable: str, default: float) -> float:
    """Seconds from ``env[variable]`` (``default`` where unset); ValueError when it is no number above 0."""
    raw = env.get(variable, "").strip()
    if not raw:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{variable}={raw!r} is not a number of seconds above 0")
    return seconds


def probe_timeout(env: Mapping[str, str] | None = None) -> float:
    """Seconds from ``PIE_PROBE_TIMEOUT`` (default DEFAULT_PROBE_TIMEOUT_S); EngineError when it is no such number."""
    try:
        return env_seconds(os.environ if env is None else env, PROBE_TIMEOUT_ENV, DEFAULT_PROBE_TIMEOUT_S)
    except ValueError as exc:
        raise EngineError(str(exc)) from None


class Engine:
    """One loaded engine plugin."""

    def __init__(
        self,
        name: str,
        distribution: str,
        version: str,
        manager: pluggy.PluginManager,
        registry: EngineRegistry | None = None,
    ):
        self.name = name
        self.distribution = distribution
        self.version = version
        self.registry = registry
        """The registry that loaded it, which also holds the host device (see ``Device.host_device``)."""
        self._hook = manager.hook
        self._manager = manager
        self.info: EngineInfo = self._hook.pie_engine_info()
        self._devices: list[DeviceInfo] | None = None

    def has_hook(self, hook_name: str) -> bool:
        return bool(getattr(self._hook, hook_name).get_hookimpls())

    def probe_devices(self) -> list[DeviceInfo]:
        """Devices of this engine (probed once, then remembered)."""
        if self._devices is None:
            with _printing_to_stderr():
                devices = list(self._hook.pie_probe_devices() or ())
            for number, device in enumerate(devices):
                problem = _device_problem(self.name, device, devices[:number])
                if problem:
                    raise EngineError(f"engine {self.name!r}: pie_probe_devices returned {problem}")
            self._devices = devices
        return self._devices

    def diagnose(self) -> list[Diagnosis]:
        if not self.has_hook("pie_diagnose"):
            return []
        return list(self._hook.pie_diagnose() or ())

    def profiles(self) -> list[str]:
        """The TOML texts of the profiles the engine ships; EngineError when it gives anything else."""
        if not self.has_hook("pie_device_profiles"):
            return []
        texts = self._hook.pie_device_profiles() or ()
        if isinstance(texts, str) or not isinstance(texts, Sequence):
            raise EngineError(f"engine {self.name!r} gave its profiles as {type(texts).__name__!r}, not a list of "
                              "TOML texts")
        for text in texts:
            if not isinstance(text, str):
                raise EngineError(f"engine {self.name!r} gave {type(text).__name__!r} among its profiles, not TOML text")
        return list(texts)

    def join_process_group(
        self, coordinator: str | None, num_processes: int | None, process_id: int | None
    ) -> ProcessGroup:
        """Join the engine's multi-process runtime (``pie_join_process_group``): before :meth:`probe_devices`."""
        if not self.has_hook("pie_join_process_group"):
            raise EngineError(f"engine {self.name!r} runs in one process: it has no pie_join_process_group")
        return self._hook.pie_join_process_group(
            coordinator=coordinator, num_processes=num_processes, process_id=process_id
        )

    def leave_process_group(self) -> None:
        self._hook.pie_leave_process_group()

    def open(self, device: DeviceInfo | int = 0) -> Device:
        """Bind this engine to one of its devices."""
        devices = self.probe_devices()
        if isinstance(device, int):
            if not devices:
                raise EngineError(f"engine {self.name!r} found no device")
            if not 0 <= device < len(devices):
                raise EngineError(f"engine {self.name!r} has {len(devices)} device(s); index {device} is out of range")
            device = devices[device]
        return Device(self, device)


def _device_problem(engine: str, device: object, before: Sequence[object]) -> str:
    """What makes ``device`` impossible as ``engine``'s device after those ``before`` it, or "" where nothing does."""
    if not isinstance(device, DeviceInfo):
        return f"{type(device).__name__}, not DeviceInfo"
    what = f"device {device.name!r}"
    if device.engine != engine:
        return f"{what} of engine {device.engine!r}"
    if not _counts(device.index):
        return f"{what} with index {device.index!r} (indices count from 0)"
    if device.index in (d.index for d in before if isinstance(d, DeviceInfo)):
        return f"{what} with index {device.index}, which another of its devices has"
    if not (_counts(device.memory_bytes) and device.memory_bytes <= MAX_MEMORY_BYTES):
        return f"{what} with {device.memory_bytes!r} bytes of memory (0 where unknown, at most 2**60)"
    if device.kind not in get_args(DeviceKind):
        return f"{what} of kind {device.kind!r}, not one of {', '.join(get_args(DeviceKind))}"
    return ""


def _counts(value: object) -> bool:
    """Whether ``value`` is an integer from 0 (a bool is not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def what_raised(exc: BaseException) -> str:
    """What engine code raised, in words: ``Type: message``, or the sys.exit it called (which must not end pie
    as if pie had exited: engine code runs in pie's process)."""
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    return f"{type(exc).__name__}: {exc}"


@contextlib.contextmanager
def _printing_to_stderr() -> Iterator[None]:
    """Send what engine code prints to stderr while it is imported, described and probed in this process, both
    Python's writes and those to file descriptor 1 (a C library's): stdout carries only the command's output, such
    as `pie bench --json` or `pie profile export`. (A C library's own buffer, flushed later, is out of reach.)"""
    sys.stdout.flush()
    saved = None
    with contextlib.suppress(OSError):  # a closed stdout or stderr: Python's writes are still sent
        saved = os.dup(1)
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _per_call(hook: Any, info: DeviceInfo, *arguments: str) -> Callable[..., Any]:
    """A hook of the runtime's every pass, for one device, taking ``arguments`` positionally: the
    engine's own function where it is the one implementation (a pluggy call costs more than a direct
    one, and each decode step moves its inputs and logits with nine of them), else the hook."""
    implementations = hook.get_hookimpls()
    if len(implementations) == 1 and not (implementations[0].hookwrapper or implementations[0].wrapper):
        function, names = implementations[0].function, tuple(implementations[0].argnames)
        if names == ("device", *arguments):
            return functools.partial(function, info)
        if names == arguments:
            return function
    return lambda *values: hook(device=info, **dict(zip(arguments, values, strict=True)))


class Device:
    """An engine bound to one device: the surface the runtime uses.

    ``compile`` is the only kernel call that crosses the plugin layer; it returns
    the engine's own launcher, which the runtime calls directly afterwards.
    """

    def __init__(self, engine: Engine, info: DeviceInfo):
        self.engine = engine
        self.info = info
        self._hook = engine._hook
        self._kernels: dict[str, tuple[str, ...]] | None = None
        self._weight_types: dict[str, tuple[str, ...]] | None = None
        self._kv_dtypes: tuple[str, ...] | None = None
        self._compiled: dict[KernelRequest, Launcher] = {}
        self._upload = _per_call(self._hook.pie_upload, info, "array")
        self._download = _per_call(self._hook.pie_download, info, "tensor")
        self._begin_pass: Callable[[PassPlan], None] | None = None
        self._end_pass: Callable[[], None] | None = None
        if engine.has_hook("pie_begin_pass"):
            self._begin_pass = _per_call(self._hook.pie_begin_pass, info, "plan")
            self._end_pass = _per_call(self._hook.pie_end_pass, info)

    @property
    def name(self) -> str:
        return self.engine.name

    def __repr__(self) -> str:
        return f"<Device {self.info.key} {self.info.name!r}>"

    def host_device(self) -> Device:
        """The CPU engine's device of the registry this device came from: where the host page pool lives."""
        if self.name == HOST_ENGINE:
            return self
        if self.engine.registry is None:
            raise EngineError(f"engine {self.name!r} was loaded outside a registry and has no host device")
        return self.engine.registry.host_device()

    def kernels(self) -> dict[str, tuple[str, ...]]:
        if self._kernels is None:
            listed = self._hook.pie_list_kernels(device=self.info) or {}
            self._kernels = {name: tuple(variants) for name, variants in listed.items()}
        return self._kernels

    def supports(self, kernel: str, variant: str | None = None) -> bool:
        variants = self.kernels().get(kernel)
        if variants is None:
            return False
        return variant is None or variant in variants

    def unavailable_variants(self) -> dict[str, str]:
        """Variant -> why the engine cannot offer it here (``pie_unavailable_variants``; empty without it)."""
        if not self.engine.has_hook("pie_unavailable_variants"):
            return {}
        listed = self._hook.pie_unavailable_variants(device=self.info) or {}
        return {str(variant): str(reason) for variant, reason in listed.items()}

    def weight_types(self) -> dict[str, tuple[str, ...]]:
        """Kernel -> the weight types it reads as stored besides f32 (``pie_weight_types``; empty without it)."""
        if self._weight_types is None:
            listed = self._hook.pie_weight_types(device=self.info) if self.engine.has_hook("pie_weight_types") else {}
            self._weight_types = {name: tuple(types) for name, types in (listed or {}).items()}
        return self._weight_types

    def kv_dtypes(self) -> tuple[str, ...]:
        """The element types the engine keeps KV pages in (``pie_kv_dtypes``; float32 only without it)."""
        if self._kv_dtypes is None:
            listed = self._hook.pie_kv_dtypes(device=self.info) if self.engine.has_hook("pie_kv_dtypes") else None
            self._kv_dtypes = tuple(listed or ("float32",))
        return self._kv_dtypes

    def compile(self, kernel: str, variant: str | None = None, **options: Any) -> Launcher:
        """Compile a catalogue kernel once and return its launcher (cached)."""
        request = KernelRequest(kernel, variant, tuple(sorted(options.items())))
        launcher = self._compiled.get(request)
        if launcher is None:
            wanted = kernel if variant is None else f"{kernel}[{variant}]"
            if not self.supports(kernel, variant):
                raise EngineError(f"engine {self.name!r} does not implement kernel {wanted}")
            with self._engine_code(f"compiling kernel {wanted}"):
                launcher = self._hook.pie_compile_kernel(device=self.info, request=request)
            if launcher is None or not callable(launcher):
                raise EngineError(f"engine {self.name!r} returned no launcher for kernel {wanted}")
            self._compiled[request] = launcher
        return launcher

    def compile_region(self, region: RegionRequest) -> Launcher | None:
        """A launcher for a whole region when the engine compiles regions, else None."""
        if not self.engine.has_hook("pie_compile_region"):
            return None
        with self._engine_code(f"compiling region {region.label}"):
            return self._hook.pie_compile_region(device=self.info, region=region)

    def compile_block(self, block: RegionRequest) -> Launcher | None:
        """A launcher for a whole block (one decoder layer) when the engine compiles blocks, else None."""
        if not self.engine.has_hook("pie_compile_block"):
            return None
        with self._engine_code(f"compiling block {block.label}"):
            return self._hook.pie_compile_block(device=self.info, block=block)

    def compile_stack(self, stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Launcher | None:
        """A launcher for a run of blocks (a model's decoder layers) when the engine compiles stacks, else None."""
        if not self.engine.has_hook("pie_compile_stack"):
            return None
        with self._engine_code(f"compiling stack {stack.label}"):
            return self._hook.pie_compile_stack(device=self.info, stack=stack, blocks=blocks)

    @contextlib.contextmanager
    def _engine_code(self, doing: str) -> Iterator[None]:
        """Run the engine's code: what it raises, or its sys.exit, becomes an EngineError naming the engine, what it
        was ``doing`` and what it raised; an EngineError passes as it is, and so does a MemoryError (the machine's
        limit)."""
        try:
            yield
        except (EngineError, MemoryError):
            raise
        except (Exception, SystemExit) as exc:
            raise EngineError(f"engine {self.name!r}: {doing} failed: {what_raised(exc)}") from exc

    def source(self, request: KernelRequest | RegionRequest) -> str | None:
        """Generated source of a kernel or region, when the engine can show it."""
        if not self.engine.has_hook("pie_kernel_source"):
            return None
        return self._hook.pie_kernel_source(device=self.info, request=request)

    def synchronize(self) -> None:
        self._hook.pie_synchronize(device=self.info)

    def upload(self, array: np.ndarray) -> Any:
        return self._upload(array)

    def begin_pass(self, plan: PassPlan) -> None:
        """Hand the engine the plan of the pass whose launches follow (``pie_begin_pass``; nothing
        without it). Every begin is followed by :meth:`end_pass`, also when the pass fails."""
        if self._begin_pass is not None:
            self._begin_pass(plan)

    def end_pass(self) -> None:
        """The pass begun by :meth:`begin_pass` is over."""
        if self._end_pass is not None:
            self._end_pass()

    def memory_bandwidth(self, passes: int = 5) -> float | None:
        """The engine's own measurement of its memory's read bandwidth (bytes/s, the best of ``passes``
        passes), if it makes one."""
        if not self.engine.has_hook("pie_memory_bandwidth"):
            return None
        return self._hook.pie_memory_bandwidth(device=self.info, passes=passes)

    def upload_weights(self, arrays: Sequence[Any]) -> list[Any]:
        """Upload a group of weights that live as long as the model (see ``pie_upload_weights``)."""
        if self.engine.has_hook("pie_upload_weights"):
            tensors = self._hook.pie_upload_weights(device=self.info, arrays=arrays)
            if tensors is not None:
                tensors = list(tensors)
                if len(tensors) != len(arrays):
                    raise EngineError(
                        f"engine {self.name!r} returned {len(tensors)} tensors for {len(arrays)} uploaded weights"
                    )
                return tensors
        return [self.upload(array) for array in arrays]

    def download(self, tensor: Any) -> np.ndarray:
        return self._download(tensor)

    def top_tokens(self, logits: Any, k: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Each row's ``k`` most likely tokens of device ``logits`` ``[B, V]``, on the device where the
        engine can: indices ``[B, k]`` int32 (the lower index first on ties) and their logits ``[B, k]``.

        ``k == 1`` launches ``argmax`` and downloads only the indices (values None). An engine without
        the kernel has the whole logits downloaded and selected by the CPU engine (by the catalogue's
        reference outside a registry), with the same result.
        """
        kernel = "argmax" if k == 1 else "top_k"
        options: dict[str, Any] = {} if k == 1 else {"k": k}
        if self.supports(kernel):
            device, on_device = self, logits
        else:
            on_device = self._download(logits)
            try:
                device = self.host_device()
            except EngineError:
                if k == 1:
                    return np.asarray(kernels.argmax(on_device))[:, None], None
                values, indices = kernels.top_k(on_device, k=k)
                return indices, values
        found = device.compile(kernel, **options)(on_device)
        if k == 1:
            return device.download(found)[:, None], None
        return device.download(found[1]), device.download(found[0])

    def allocate_pages(self, layout: PageLayout) -> Any:
        pool = self._hook.pie_allocate_pages(device=self.info, layout=layout)
        if pool is None:
            raise EngineError(f"engine {self.name!r} could not allocate a page pool of {layout}")
        return pool

    def max_page_pool_layer_bytes(self) -> int | None:
        """The most bytes one layer of a page pool may take here (``pie_max_page_pool_layer_bytes``); None where
        nothing bounds it, as without the hook. EngineError when the engine answers anything but bytes above 0."""
        return self._byte_bound("pie_max_page_pool_layer_bytes", "the largest layer of a page pool")

    def max_page_pool_bytes(self) -> int | None:
        """The most bytes a whole page pool may take here (``pie_max_page_pool_bytes``); None where nothing bounds
        it, as without the hook. EngineError when the engine answers anything but bytes above 0."""
        return self._byte_bound("pie_max_page_pool_bytes", "the largest page pool")

    def _byte_bound(self, hook: str, what: str) -> int | None:
        if not self.engine.has_hook(hook):
            return None
        with self._engine_code(f"telling {what}"):
            limit = getattr(self._hook, hook)(device=self.info)
        if limit is not None and not (_counts(limit) and limit > 0):
            raise EngineError(f"engine {self.name!r}: {hook} returned {limit!r}, "
                              "not a number of bytes above 0 (or None: no bound)")
        return limit

    def free_pages(self, pool: Any) -> None:
        self._hook.pie_free_pages(device=self.info, pool=pool)

    def read_pages(self, pool: Any, page_ids: np.ndarray) -> np.ndarray:
        self._require_hook("pie_read_pages", "copy KV pages to host memory")
        return self._hook.pie_read_pages(device=self.info, pool=pool, page_ids=page_ids)

    def write_pages(self, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
        self._require_hook("pie_write_pages", "copy KV pages from host memory")
        self._hook.pie_write_pages(device=self.info, pool=pool, page_ids=page_ids, data=data)

    def copy_pages(self, pool: Any, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        """Copy pages within a pool: on the device where the engine can, else through host memory."""
        if self.engine.has_hook("pie_copy_pages"):
            self._hook.pie_copy_pages(
                device=self.info, pool=pool, source_ids=source_ids, destination_ids=destination_ids
            )
        else:
            self.write_pages(pool, destination_ids, self.read_pages(pool, source_ids))

    def _require_hook(self, hook_name: str, needed_to: str) -> None:
        if not self.engine.has_hook(hook_name):
            raise EngineError(f"engine {self.name!r} does not implement {hook_name}, needed to {needed_to}")


@dataclass
class _Entry:
    """One installed engine: an entry point (examined in a child first) or an object registered in-process."""

    name: str
    distribution: str
    version: str
    plugin: Any = None
    probe: Probe | None = None
    """What examining it found (in a child, from the probe cache, or in-process)."""
    findings: list[Diagnosis] | None = None
    """Its ``pie_diagnose`` answer, once asked for."""
    engine: Engine | None = None
    """The engine loaded in this process, once used."""
    error: str = ""
    """Why it cannot start here: a name conflict, or what failed when it was loaded in this process."""
    transient: bool = False
    """``error`` came of this process running short of memory, files or processes (``Probe.transient``)."""
    setting: bool = False
    """``error`` came of a setting of the user's that the engine cannot read (``Probe.setting``)."""
    fix: str = ""

    @property
    def in_child(self) -> bool:
        return isinstance(self.plugin, metadata.EntryPoint)


class EngineRegistry:
    """All installed engines, each either usable or broken with its reason."""

    def __init__(
        self, autoload: bool | None = None, env: Mapping[str, str] | None = None, probe_cache: ProbeCache | None = None
    ):
        self._env = dict(env if env is not None else os.environ)
        self._probe_cache = probe_cache
        self._setting_error: EngineSelectionError | None = None
        """A setting that cannot be read, raised by every query (as a bad ``PIE_ENGINES`` is)."""
        self.unloaded = ""
        """Why no installed engine is loaded where ``PIE_DISABLE_PLUGIN_AUTOLOAD`` says so, with the fix; else empty.
        Without it, "no engine is installed: pip install pie-engine-cpu" sent the user to install what is."""
        if autoload is None:
            try:
                autoload = not autoload_disabled(self._env)
            except EngineSelectionError as exc:
                self._setting_error, autoload = exc, False
            else:
                if not autoload:
                    self.unloaded = (f"{AUTOLOAD_ENV}={self._env[AUTOLOAD_ENV]} loads no installed engine: unset it to "
                                     "load them")
        self._entries: dict[str, _Entry] = {}
        self._rejected: list[_Entry] = []
        """Distributions that cannot be engines here: a name another one owns, or unreadable metadata."""
        self._host: Device | None = None
        if autoload:
            self._discover()

    # -- discovery ---------------------------------------------------------

    def _discover(self) -> None:
        found: dict[str, list[_Entry]] = {}
        for ep, distribution, version in _engine_entry_points(self._rejected):
            found.setdefault(ep.name, []).append(_Entry(ep.name, distribution, version, plugin=ep))
        for name, candidates in found.items():
            # The distribution named after the engine owns the name (pie-engine-cpu owns cpu); else the first on sys.path.
            owner = next((c for c in candidates if _canonical(c.distribution) == f"pie-engine-{name}"), candidates[0])
            self._entries[name] = owner
            for other in candidates:
                if other is not owner:
                    other.error = (
                        f"engine name {name!r} is registered by both {owner.distribution} {owner.version} and "
                        f"{other.distribution} {other.version}; {owner.distribution} keeps it, "
                        f"{other.distribution} is not loaded"
                    )
                    other.fix = f"pip uninstall {other.distribution}"
                    self._rejected.append(other)

    def register(self, name: str, plugin: Any, distribution: str = "(in-process)", version: str = "") -> None:
        """Register an engine plugin object directly (tests, embedding), replacing one of that name."""
        self._entries[name] = _Entry(name, distribution, version, plugin=plugin)

    def names(self) -> list[str]:
        if self._setting_error is not None:
            raise self._setting_error
        return sorted(self._entries)

    def _load(self, entry: _Entry) -> None:
        """Import and check the plugin in this process: ``entry.engine``, or ``entry.error`` saying why not."""
        if entry.engine is not None or entry.error:
            return
        plugin = entry.plugin
        if isinstance(plugin, metadata.EntryPoint):
            if metadata.EntryPoint.pattern.match(plugin.value) is None:
                entry.error = f"its entry point {plugin.value!r} is not `module` or `module:attribute`"
                return
            try:
                with _printing_to_stderr():
                    plugin = plugin.load()
            except Exception as exc:
                entry.error, entry.transient = f"import failed: {type(exc).__name__}: {exc}", _short_of_resources(exc)
                entry.setting = _a_setting_error(exc)
                return
        manager = pluggy.PluginManager("pie")
        manager.add_hookspecs(hookspecs)
        faults = _hook_faults(manager, plugin)
        if faults:
            entry.error = CONTRACT_BREACH + "; ".join(faults)
            return
        try:
            manager.register(plugin, name=entry.name)
            manager.check_pending()
        except Exception as exc:
            entry.error = f"{CONTRACT_BREACH}invalid plugin: {' '.join(str(exc).split())}"
            return
        missing = [h for h in hookspecs.REQUIRED_HOOKS if not getattr(manager.hook, h).get_hookimpls()]
        if missing:
            unmarked = [h for h in missing if callable(getattr(plugin, h, None))]
            note = f" ({', '.join(unmarked)} defined without @pie.hookspecs.hookimpl)" if unmarked else ""
            entry.error = f"{CONTRACT_BREACH}missing required hooks: {', '.join(missing)}{note}"
            return
        implemented = {h for pair in hookspecs.PAIRED_HOOKS for h in pair if getattr(manager.hook, h).get_hookimpls()}
        unpaired = [f"{a} without {b}" for pair in hookspecs.PAIRED_HOOKS for a in pair for b in pair
                    if a in implemented and b not in implemented]
        if unpaired:
            entry.error = f"{CONTRACT_BREACH}unpaired hooks: {', '.join(unpaired)} (the hooks of a pair go together)"
            return
        try:
            with _printing_to_stderr():
                engine = Engine(entry.name, entry.distribution, entry.version, manager, self)
        except Exception as exc:
            entry.error, entry.setting = f"pie_engine_info failed: {type(exc).__name__}: {exc}", _a_setting_error(exc)
            return
        info = engine.info
        if not isinstance(info, EngineInfo):
            entry.error = (f"{CONTRACT_BREACH}pie_engine_info returned {type(info).__name__}, "
                           "not a pie.contract.EngineInfo")
            return
        if isinstance(info.priority, bool) or not isinstance(info.priority, int) or abs(info.priority) > MAX_PRIORITY:
            entry.error = (f"{CONTRACT_BREACH}pie_engine_info gave priority {info.priority!r}, not an integer "
                           f"within +-{MAX_PRIORITY}")
            return
        if info.contract_version != CONTRACT_VERSION:
            entry.error = (
                f"{CONTRACT_BREACH}contract version {info.contract_version} is not supported "
                f"(pie-core {_core_version()} speaks version {CONTRACT_VERSION})"
            )
            return
        if info.name != entry.name:
            entry.error = (f"{CONTRACT_BREACH}entry point {entry.name!r} describes itself as {info.name!r} "
                           "(EngineInfo.name is the entry point's name)")
            return
        entry.engine = engine

    # -- examination: import, describe, probe (and diagnose) ---------------

    def _examine(self, entries: Sequence[_Entry], cached: bool, diagnose: bool = False) -> None:
        """Give every entry a probe (and its findings when ``diagnose``): remembered ones when ``cached``
        allows, the rest run now, entry points each in a child of its own, side by side."""
        due = [
            e
            for e in entries
            if not e.error
            and (e.probe is None or (e.probe.remembered and not cached) or (diagnose and e.findings is None))
        ]
        if cached and not diagnose and self._probe_cache is not None:
            for entry in [e for e in due if e.in_child]:
                remembered = self._probe_cache.get(self._cache_key(entry))
                if remembered is not None:
                    entry.probe = remembered
                    due.remove(entry)
        for entry in [e for e in due if not e.in_child]:
            found = dict(self._examine_here(entry, diagnose))
            entry.probe, entry.findings = found["probe"], found.get("diagnosis")
        children = [e for e in due if e.in_child]
        if children:
            _examine_in_children(children, diagnose, probe_timeout(self._env))
            for entry in children:
                self._remember(entry)

    def _examine_here(self, entry: _Entry, diagnose: bool) -> Iterator[tuple[str, Any]]:
        """Load, describe and probe an engine in this process (and diagnose it when asked), yielding
        ("phase", what) before each step and ("info" | "probe" | "diagnosis", finding) after."""
        yield "phase", "loading the plugin"
        self._load(entry)
        engine = entry.engine
        if engine is None:
            yield "probe", Probe(None, error=entry.error, transient=entry.transient, setting=entry.setting)
            return
        yield "info", engine.info
        yield "phase", "probing devices"
        devices: list[DeviceInfo] = []
        listed: tuple[str, ...] = ()
        error = ""
        transient = setting = False
        try:
            devices = engine.probe_devices()
        except Exception as exc:
            error, transient = f"device probe failed: {type(exc).__name__}: {exc}", _short_of_resources(exc)
            setting = _a_setting_error(exc)
        if devices:
            yield "phase", "listing kernels"
            try:
                listed = tuple(str(name) for name in engine.open(devices[0]).kernels())
            except Exception as exc:
                error, transient = f"pie_list_kernels failed: {type(exc).__name__}: {exc}", _short_of_resources(exc)
                setting = _a_setting_error(exc)
        yield "probe", Probe(engine.info, tuple(devices), listed, error, transient=transient, setting=setting)
        if diagnose:
            yield "phase", "diagnosing"
            try:
                findings = engine.diagnose()
                if not all(isinstance(d, Diagnosis) for d in findings):
                    raise EngineError("pie_diagnose returned something other than Diagnosis records")
            except Exception as exc:
                findings = [Diagnosis(False, "pie_diagnose", f"failed: {type(exc).__name__}: {exc}")]
            yield "diagnosis", findings

    def _cache_key(self, entry: _Entry) -> str:
        return cache_key(entry.name, entry.distribution, entry.version)

    def _remember(self, entry: _Entry) -> None:
        if self._probe_cache is not None and entry.in_child and entry.probe is not None:
            self._probe_cache.put(self._cache_key(entry), entry.probe)

    def _start(self, entry: _Entry) -> Engine:
        """The engine loaded and probed in this process (its probe in a child, or remembered, passed)."""
        self._load(entry)
        if entry.engine is not None and not entry.error:
            try:
                if not entry.engine.probe_devices():
                    entry.error = "no device found"
            except Exception as exc:
                entry.error = f"device probe failed: {type(exc).__name__}: {exc}"
                entry.transient, entry.setting = _short_of_resources(exc), _a_setting_error(exc)
        if entry.error or entry.engine is None:
            entry.probe = Probe(entry.probe.info if entry.probe else None, error=entry.error, transient=entry.transient,
                                setting=entry.setting)
            self._remember(entry)  # what this process found, for the next `pie engines`
            raise EngineSelectionError(f"engine {entry.name!r} cannot start: {entry.error}")
        return entry.engine

    # -- queries -----------------------------------------------------------

    def status(self, name: str, cached: bool = False) -> EngineStatus:
        """Where ``name`` stands; ``cached`` accepts a remembered probe (see :mod:`pie.probe_cache`)."""
        entry = self._entry(name)
        requested = requested_engines(self._env)
        if requested is not None and name not in requested:
            return EngineStatus(name, entry.distribution, entry.version, "not-selected", f"not in {ENGINES_ENV}")
        self._examine([entry], cached)
        return _status(entry)

    def statuses(self, cached: bool = False) -> list[EngineStatus]:
        """Every installed engine, and every distribution that cannot be one here, examined side by side."""
        requested = requested_engines(self._env)
        self._examine([e for e in self._entries.values() if requested is None or e.name in requested], cached)
        found = [self.status(name, cached) for name in self.names()] + [_status(e) for e in self._rejected]
        return sorted(found, key=lambda s: s.name)  # stable: an engine's owner before a distribution it rejected

    def diagnoses(self, names: Sequence[str] | None = None) -> dict[str, list[Diagnosis]]:
        """``pie_diagnose`` of the engines ``names`` (default: every installed one), even one whose device
        probe failed, each examined afresh (entry points in children, side by side); a diagnosis that
        fails is one failing finding."""
        entries = [self._entry(name) for name in (self.names() if names is None else names)]
        self._examine(entries, cached=False, diagnose=True)
        return {e.name: list(e.findings or ()) for e in entries}

    def engine(self, name: str) -> Engine:
        """The engine ``name`` loaded in this process, whatever ``PIE_ENGINES`` selects, or
        EngineSelectionError saying why it cannot start. A remembered probe that passed will do; the
        engine then probes its devices in this process."""
        return self._start(self._require(name, cached=True))

    def loaded(self, name: str) -> Engine:
        """The engine ``name`` imported and checked in this process, its devices not probed yet (for what
        comes first: :meth:`Engine.join_process_group`), or EngineSelectionError saying why it cannot load."""
        entry = self._entry(name)
        self._load(entry)
        if entry.engine is None:
            raise EngineSelectionError(f"engine {name!r} cannot start: {entry.error}")
        return entry.engine

    def host_device(self) -> Device:
        """The CPU engine's device: where pie-core keeps what lives in host memory (the host page pool,
        the CPU fallback). It is infrastructure, not a user's choice, so ``PIE_ENGINES`` does not limit it."""
        if self._host is None:
            try:
                self._host = self.engine(HOST_ENGINE).open(0)
            except EngineSelectionError as exc:
                fix = "see `pie doctor`" if HOST_ENGINE in self._entries else "pip install pie-engine-cpu"
                raise EngineSelectionError(
                    f"{exc} (the CPU engine holds the host page pool and the CPU fallback: {fix})"
                ) from exc
        return self._host

    def fallback_for(self, device: Device) -> Device | None:
        """The device for the kernels ``device`` lacks: the host device, or None where nothing can need
        it (``device`` is the CPU engine's, or lists every primitive kernel). EngineSelectionError when
        it is needed and the CPU engine cannot start."""
        if device.name == HOST_ENGINE or all(device.supports(kernel) for kernel in kernels.PRIMITIVES):
            return None
        return self.host_device()

    def _entry(self, name: str) -> _Entry:
        if self._setting_error is not None:
            raise self._setting_error
        entry = self._entries.get(name)
        if entry is None:
            if self.unloaded:
                raise EngineSelectionError(f"engine {name!r} is not loaded: {self.unloaded}")
            raise EngineSelectionError(
                f"engine {name!r} is not installed (installed: {', '.join(self.names()) or 'none'})"
            )
        return entry

    def _require(self, name: str, cached: bool) -> _Entry:
        """The entry of an engine that was asked for and passed its probe; a failure remembered from an
        earlier probe is probed again, since the user may have fixed it since."""
        entry = self._entry(name)
        self._examine([entry], cached)
        if _status(entry).status != "ok" and entry.probe is not None and entry.probe.remembered:
            self._examine([entry], cached=False)
        status = _status(entry)
        if status.status != "ok":
            raise EngineSelectionError(f"engine {name!r} cannot start: {status.reason}")
        return entry

    def choose(self, name: str | None = None, cached: bool = False) -> tuple[str, str]:
        """The engine that would run, and why; strict about engines the user asked for.

        ``name`` (a CLI ``--engine``) wins over ``PIE_ENGINES``, which then plays no part. Else every
        engine of ``PIE_ENGINES`` must start and the first is used. Else the highest-priority working
        engine that can run a model is used; one that cannot is passed over, and the reason says so.
        """
        requested = requested_engines(self._env)
        if name is not None:
            entry = self._require(name, cached)
            why = f"engine {name!r} was asked for"
            if requested is not None and requested != [name]:
                why += f", which wins over {ENGINES_ENV}={','.join(requested)}"
            return name, why + self._rejection_note(entry)
        if requested is not None:
            self._examine([self._entries[n] for n in requested if n in self._entries], cached)
            entries = [self._require(wanted, cached) for wanted in requested]
            return requested[0], f"first of {ENGINES_ENV}={','.join(requested)}" + self._rejection_note(entries[0])
        statuses = self.statuses(cached=cached)
        working = sorted(
            (s for s in statuses if s.status == "ok" and s.info is not None),
            key=lambda s: (s.info.priority if s.info else 0, s.name),
            reverse=True,
        )
        passed_over = []
        chosen = None
        partial: tuple[EngineStatus, list[str]] | None = None  # the first that runs only the models needing less
        for candidate in working:
            gap, some_models_need = self._model_gap(self._entries[candidate.name], cached)
            if gap:
                passed_over.append(f"{candidate.name} cannot run a model: {gap}")
            elif some_models_need:
                partial = partial or (candidate, some_models_need)
            else:
                chosen = candidate
                break
        if partial is not None:
            lacking = ", ".join(partial[1])
            if chosen is None:
                chosen = partial[0]
                passed_over.append(f"it lacks {lacking} (no CPU engine to run them): a model or option that needs "
                                   "one of them will not run")
            else:
                passed_over.append(f"{partial[0].name} runs only models that need none of {lacking} (no CPU engine "
                                   "to run them)")
        unread = self._unread_settings(chosen)
        if chosen is None:
            summary = "; ".join([*(f"{s.name}: {s.reason}" for s in statuses if s.status != "ok"), *passed_over])
            if not summary and self.unloaded:
                raise EngineSelectionError(f"no engine is loaded: {self.unloaded}")
            raise EngineSelectionError(f"no engine can run here ({summary or 'no engine is installed'}); try `pie doctor`")
        why = f"highest priority of the working engines ({', '.join(sorted(s.name for s in working))})"
        # The CPU engine runs wherever Python does: when it is broken, that is news (others lack their hardware).
        broken_host = [f"{s.name} is broken: {s.reason}" for s in statuses if s.name == HOST_ENGINE and s.status != "ok"]
        return chosen.name, "; ".join([why, *passed_over, *broken_host, *unread]) + self._rejection_note(
            self._entries[chosen.name])

    def _unread_settings(self, chosen: EngineStatus | None) -> list[str]:
        """The examined engines that cannot read a setting of the user's (``Probe.setting``), each in a clause,
        when the choice without ``--engine`` or ``PIE_ENGINES`` fell on ``chosen`` (None: on no engine).
        EngineSelectionError naming the setting where one of them would have outranked ``chosen`` or is the CPU
        engine: the user's setting is theirs to correct, not a reason to run an engine they would not have got."""
        unread = [e for e in self._entries.values() if e.probe is not None and e.probe.setting]
        rank = (chosen.info.priority, chosen.name) if chosen is not None and chosen.info is not None else None
        outranking = [e for e in unread if rank is None or e.probe is None or e.probe.info is None
                      or (e.probe.info.priority, e.name) > rank]
        stopping = outranking + [e for e in unread if e.name == HOST_ENGINE and e not in outranking]
        if stopping:
            reasons = "; ".join(f"engine {e.name!r} cannot start: {_status(e).reason}" for e in stopping)
            if chosen is not None and outranking:
                consequence = f"pie does not run another engine for it ({chosen.name} would run instead)"
            elif outranking:
                consequence = "no other engine can run here either"
            else:  # the CPU engine, below the one chosen
                consequence = "the CPU engine holds the host page pool and the CPU fallback, whichever engine runs"
            raise EngineSelectionError(
                f"{reasons}. That is a setting of yours, and {consequence}: correct or unset the setting, or name "
                f"the engine to run with --engine or {ENGINES_ENV}"
            )
        return [f"{e.name} cannot read a setting: {_status(e).reason}" for e in unread]

    def _model_gap(self, entry: _Entry, cached: bool) -> tuple[str, list[str]]:
        """Why the engine cannot run any model on its first device ("" when it can run some), and the primitives
        it lacks that some models need, with no CPU engine to run them.

        Only the kernels every model launches (``kernels.MODEL_KERNELS``) make the engine unable to run a model, as
        with ``--engine``, where the engine runs whatever model its kernels (and the CPU engine's) cover: one that
        lacks only ``epilogue``, say, runs a SiLU model, and fails on a model that needs it, naming the kernel."""
        assert entry.probe is not None
        listed = set(entry.probe.kernels)
        lacking = [k for k in kernels.POOL_KERNELS if k not in listed]
        if lacking:
            return f"it lacks {' and '.join(lacking)}, which work on its page pool and cannot run on the CPU engine", []
        lacking = [k for k in kernels.PRIMITIVES if k not in listed]
        if not lacking or entry.name == HOST_ENGINE:
            return "", []
        host = self._entries.get(HOST_ENGINE)
        if host is None:
            host_missing = (f"the CPU engine, which would run them, is not installed "
                            f"(pip install pie-engine-{HOST_ENGINE})")
        else:
            self._examine([host], cached)
            status = _status(host)
            if status.status == "ok":
                return "", []
            host_missing = f"the CPU engine, which would run them, cannot start: {status.reason}"
        every_model = [k for k in lacking if k in kernels.MODEL_KERNELS]
        if every_model:
            return f"it lacks {', '.join(every_model)}, and {host_missing}", []
        return "", lacking

    def _rejection_note(self, entry: _Entry) -> str:
        others = [r.distribution for r in self._rejected if r.name == entry.name]
        if not others:
            return ""
        return f"; {' and '.join(others)} also registers {entry.name!r} and is not loaded (see `pie engines`)"

    def select(self, name: str | None = None) -> tuple[Device, str]:
        """Open the device to run on, and say why it was chosen.

        With a probe cache the choice reads remembered probes, so only the chosen engine
        imports its backend; if that engine no longer starts and the user did not ask for
        it, the choice is made again from fresh probes.
        """
        cached = self._probe_cache is not None
        chosen, why = self.choose(name, cached=cached)
        try:
            return self.engine(chosen).open(0), why
        except EngineSelectionError:
            if not cached or name is not None or requested_engines(self._env) is not None:
                raise
        chosen, why = self.choose(None, cached=False)
        return self.engine(chosen).open(0), why


def _status(entry: _Entry) -> EngineStatus:
    """Where an examined (or rejected) entry stands."""
    probe = entry.probe
    info = probe.info if probe is not None else None
    note = ""
    if probe is not None and probe.remembered:
        note = f" (remembered from a probe {_ago(probe.at)}; `pie engines --refresh` probes again)"
    if probe is not None and probe.transient:
        fix = SHORT_OF_RESOURCES_FIX
    elif probe is not None and probe.setting:
        fix = SETTING_FIX
    elif probe is not None and probe.timed_out:
        fix = TIMED_OUT_FIX
    elif (probe is not None and probe.error.startswith(CONTRACT_BREACH)) or entry.error.startswith(CONTRACT_BREACH):
        fix = contract_breach_fix(entry.distribution, entry.version)
    else:
        fix = entry.fix or (f"pip install --force-reinstall {entry.distribution}" if info is None else "")
    if entry.error:
        return EngineStatus(entry.name, entry.distribution, entry.version, "broken", entry.error, info, fix=fix)
    if probe is None:
        raise AssertionError(f"engine {entry.name!r} was never examined")
    if probe.error:
        return EngineStatus(entry.name, entry.distribution, entry.version, "broken", probe.error + note, info, fix=fix)
    if not probe.devices:
        return EngineStatus(entry.name, entry.distribution, entry.version, "no-device", "no device found" + note, info)
    return EngineStatus(entry.name, entry.distribution, entry.version, "ok", "", info, list(probe.devices))


def _ago(at: float) -> str:
    seconds = max(time.time() - at, 0.0)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.0f} h ago"


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()


def _engine_entry_points(rejected: list[_Entry]) -> Iterator[tuple[metadata.EntryPoint, str, str]]:
    """The ``pie.engines`` entry points with their distribution's name and version. A distribution whose
    metadata cannot be read (which stops ``importlib.metadata.entry_points``) goes to ``rejected``."""
    try:
        points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    except Exception:
        points = None
    if points is not None:
        for ep in points:
            dist = ep.dist
            yield ep, (dist.metadata["Name"] or "?") if dist else "?", (dist.version or "?") if dist else "?"
        return
    seen: set[str] = set()
    for dist in metadata.distributions():
        try:
            name = dist.metadata["Name"] or "?"
        except Exception:
            name = "?"
        if _canonical(name) in seen:
            continue  # as importlib.metadata does: the first on sys.path wins
        seen.add(_canonical(name))
        try:
            mine = [ep for ep in dist.entry_points if ep.group == ENTRY_POINT_GROUP]
            version = dist.version or "?"
        except Exception as exc:
            broken = _Entry(name, name, "?", error=f"its metadata cannot be read: {type(exc).__name__}: {exc}")
            broken.fix = f"pip install --force-reinstall {name}"
            rejected.append(broken)
            continue
        for ep in mine:
            yield ep, name, version


# -- probe children -----------------------------------------------------------

_CHILD_CODE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from pie.plugins import _examine_child; _examine_child(*sys.argv[2:])"
)


def _examine_child(name: str, target: str, diagnose: str) -> None:
    """A probe child's main: examine one entry point and report each step, as a JSON line, on the
    stdout it was given; what the plugin itself prints goes to stderr. It ends without the interpreter's
    teardown, where some drivers crash or linger."""
    reports = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    registry = EngineRegistry(autoload=False, env={})
    entry = _Entry(name, "", "", plugin=metadata.EntryPoint(name, target, ENTRY_POINT_GROUP))
    for kind, value in registry._examine_here(entry, diagnose == "1"):
        reports.write(json.dumps({kind: _encode(kind, value)}) + "\n")
        reports.flush()
    sys.stderr.flush()
    os._exit(0)


def _encode(kind: str, value: Any) -> Any:
    if kind == "info":
        return info_record(value)
    if kind == "probe":
        return probe_record(value)
    if kind == "diagnosis":
        return [asdict(d) for d in value]
    return value


@dataclass
class _Child:
    entry: _Entry
    process: subprocess.Popen[bytes]
    reports: IO[bytes]
    stderr: IO[bytes]


def _examine_in_children(entries: Sequence[_Entry], diagnose: bool, timeout: float) -> None:
    """Examine each entry point in a child process of its own, all at once, each within ``timeout``
    seconds; set every entry's probe (and findings), saying how a child that gave no answer ended."""
    children: list[_Child] = []
    try:
        for entry in entries:
            assert isinstance(entry.plugin, metadata.EntryPoint)
            arguments = [json.dumps(sys.path), entry.name, entry.plugin.value, "1" if diagnose else "0"]
            files: list[IO[bytes]] = []
            try:
                files.append(reports := tempfile.TemporaryFile())
                files.append(stderr := tempfile.TemporaryFile())
                process = subprocess.Popen(
                    [sys.executable, "-c", _CHILD_CODE, *arguments],
                    stdin=subprocess.DEVNULL,
                    stdout=reports,
                    stderr=stderr,
                    start_new_session=True,  # its own process group: a timeout kills what it started too
                )
            except OSError as exc:  # this process's want (open files, memory, processes), not the engine's
                for file in files:
                    file.close()
                entry.probe = Probe(None, error=f"could not start a probe process: {exc}", transient=True)
                continue
            children.append(_Child(entry, process, reports, stderr))
        deadline = time.monotonic() + timeout
        _say_if_slow(children, deadline, timeout)
        for child in children:
            timed_out = False
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill(child.process)
            _read_child(child, diagnose, timeout if timed_out else None)
    finally:
        for child in children:
            if child.process.poll() is None:
                _kill(child.process)
            child.reports.close()
            child.stderr.close()


SLOW_PROBE_NOTE_S = 3.0
"""Seconds of probing after which a person at a terminal is told what pie is waiting for."""


def _say_if_slow(children: Sequence[_Child], deadline: float, timeout: float) -> None:
    """Wait up to SLOW_PROBE_NOTE_S for the probes; where some go on and stderr is a terminal, say which and why:
    the first probe on a machine builds kernels (the CPU engine's C kernels took 20 s on 2 busy cores), a silence a
    person would take for a hang."""
    if not sys.stderr.isatty():
        return
    until = min(time.monotonic() + SLOW_PROBE_NOTE_S, deadline)
    for child in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(timeout=max(until - time.monotonic(), 0.0))
    waiting = [child.entry.name for child in children if child.process.poll() is None]
    if waiting:
        print(f"pie: examining the engine(s) {', '.join(waiting)}: the first time on a machine an engine may build "
              f"its kernels (at most {timeout:g} s, {PROBE_TIMEOUT_ENV}); later commands remember what it found",
              file=sys.stderr, flush=True)


_OUTSIDE_SIGNALS = frozenset(
    int(getattr(signal, name)) for name in ("SIGKILL", "SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, name)
)
"""Signals that end a probe child from outside (the out-of-memory killer, a user, a shutdown), not a crash
of its own (SIGSEGV, SIGABRT...): what they end says nothing of the engine."""
_SHORT_OF_RESOURCES = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN})
SHORT_OF_RESOURCES_FIX = (
    "nothing to reinstall: the probe ran short of open files, memory or processes (see `ulimit -a`) or was "
    "killed from outside; run the command again"
)
"""The fix of a transient failure (``Probe.transient``), which is not remembered."""


def _chain(exc: BaseException, implicit: bool) -> Iterator[BaseException]:
    """``exc`` and what caused it: each one's explicit cause (``raise ... from``), else with ``implicit`` the
    exception being handled when it was raised; once each, however the chain loops."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        yield cause
        cause = cause.__cause__ or (cause.__context__ if implicit else None)


def _short_of_resources(exc: BaseException) -> bool:
    """Whether ``exc``, or what caused it, is this process running out of memory, files or processes."""
    return any(isinstance(cause, MemoryError) or (isinstance(cause, OSError) and cause.errno in _SHORT_OF_RESOURCES)
               for cause in _chain(exc, implicit=True))


CONTRACT_BREACH = "breaks the engine contract: "
"""How the reason of an engine whose code does not implement :mod:`pie.hookspecs` as it stands begins: no
reinstall of the same version helps (``contract_breach_fix``)."""


def contract_breach_fix(distribution: str, version: str) -> str:
    """The fix of an engine that breaks the contract: another version of it, since its code is at fault."""
    return (f"pip install --upgrade {distribution}  # reinstalling {version} would not help: its code breaks "
            f"pie-core {_core_version()}'s engine contract (pie/hookspecs.py says what each hook takes)")


_NAMED_POSITIONALS = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
"""The parameters pluggy passes a hook's arguments to (by name); those with defaults it leaves alone."""


def _hook_faults(manager: pluggy.PluginManager, plugin: Any) -> list[str]:
    """What is wrong with ``plugin``'s hook implementations, each said with its fix: a name no hook has (with
    the nearest one), arguments a hook does not pass (they are passed by name)."""
    faults = []
    for name in sorted(n for n in dir(plugin) if n.startswith("pie_")):
        if manager.parse_hookimpl_opts(plugin, name) is None:
            continue
        spec = getattr(hookspecs, name, None)
        if spec is None or not hasattr(spec, "pie_spec"):
            known = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "pie_spec")]
            nearest = difflib.get_close_matches(name, known, n=1)
            guess = f" (did you mean {nearest[0]}?)" if nearest else ""
            faults.append(f"{name} is not a hook of pie.hookspecs{guess}")
            continue
        try:
            parameters = inspect.signature(getattr(plugin, name)).parameters.values()
        except (TypeError, ValueError):
            continue
        taken = [p.name for p in parameters if p.default is p.empty and p.kind in _NAMED_POSITIONALS]
        passed = list(inspect.signature(spec).parameters)
        unknown = [argument for argument in taken if argument not in passed]
        if unknown:
            faults.append(f"{name} takes {', '.join(unknown)}, which the hook does not pass: its arguments are "
                          f"({', '.join(passed)}), passed by name")
    return faults


SETTING_FIX = (
    "nothing to reinstall: correct or unset the setting the reason names, or name the engine to run with "
    f"--engine or {ENGINES_ENV}"
)
"""The fix of a failure on a setting of the user's (``Probe.setting``), which is not remembered."""
TIMED_OUT_FIX = (
    f"if the engine only needs longer (a first probe may build its kernels, and a busy machine is slower), give it "
    f"more seconds and probe again: {PROBE_TIMEOUT_ENV}=300 pie engines --refresh"
)
"""The fix of a probe that ran past its timeout (``Probe.timed_out``), which is remembered."""


def _a_setting_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an EngineSettingError, or was raised from one (``raise ... from``): only the explicit
    cause counts, since an error raised while handling a setting's (a driver failing as it is closed) is another."""
    return any(isinstance(cause, EngineSettingError) for cause in _chain(exc, implicit=False))


def _kill(process: subprocess.Popen[bytes]) -> None:
    """Kill a probe child and what it started (its process group, where there are groups)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (AttributeError, OSError):  # no process groups (Windows), or the group is gone
        process.kill()
    process.wait()


_DECODE: dict[str, Callable[[Any], Any]] = {
    "phase": str,
    "info": info_from_record,
    "probe": probe_from_record,
    "diagnosis": lambda records: [Diagnosis(**record) for record in records],
}
"""How the parent reads each kind of line a probe child reports (see ``_encode``)."""


def _read_child(child: _Child, diagnose: bool, timed_out_after: float | None) -> None:
    found: dict[str, Any] = {"phase": "starting"}
    unreadable = ""
    child.reports.seek(0)
    for line in child.reports.read().decode("utf-8", "replace").splitlines():
        try:
            ((kind, value),) = json.loads(line).items()
            found[kind] = _DECODE[kind](value)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            unreadable = f"its report cannot be read ({type(exc).__name__}: {exc})"
    code = child.process.returncode
    killed = timed_out_after is None and -code in _OUTSIDE_SIGNALS
    if timed_out_after is not None:
        ending = f"timed out after {timed_out_after:g} s while {found['phase']}"
    elif killed:
        ending = f"was killed (signal {-code}, {signal.Signals(-code).name}) while {found['phase']}"
    elif code < 0:
        ending = f"crashed (signal {-code}) while {found['phase']}"
    elif code > 0:
        ending = f"exited with code {code} while {found['phase']}"
    else:
        ending = unreadable or f"ended without a report while {found['phase']}"
    ending += _last_words(child.stderr)
    child.entry.probe = found["probe"] if "probe" in found else Probe(
        found.get("info"), error=ending, transient=killed, timed_out=timed_out_after is not None
    )
    if diagnose:
        child.entry.findings = found["diagnosis"] if "diagnosis" in found else [Diagnosis(False, "pie_diagnose", ending)]


def _last_words(stderr: IO[bytes]) -> str:
    """The last line a child printed on stderr, as a clause (empty when it printed nothing)."""
    stderr.seek(0, os.SEEK_END)
    stderr.seek(max(stderr.tell() - 4096, 0))
    lines = [line.strip() for line in stderr.read().decode("utf-8", "replace").splitlines() if line.strip()]
    return f"; its last words: {lines[-1][:300]}" if lines else ""


def _core_version() -> str:
    from pie import __version__

    return __version__
