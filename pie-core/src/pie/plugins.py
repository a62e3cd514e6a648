"""Engine discovery and the typed facade the runtime calls.

Engines register under the entry-point group ``pie.engines``. Each one gets a
plugin manager of its own, so a failing engine cannot disturb another and a
hook call reaches exactly one engine. Nothing outside this module touches pluggy.

``PIE_ENGINES=cpu,vulkan`` selects and orders engines (like ``JAX_PLATFORMS``):
only those are loaded, every one of them must start, and the first is used.
Without it, the highest-priority engine with a working device is used.
``PIE_DISABLE_PLUGIN_AUTOLOAD=1`` (or ``EngineRegistry(autoload=False)``) skips
entry points, for tests that register engines in-process.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import numpy as np
import pluggy

from pie import hookspecs
from pie.contract import (
    CONTRACT_VERSION,
    DeviceInfo,
    Diagnosis,
    EngineInfo,
    EngineStatus,
    KernelRequest,
    Launcher,
    PageLayout,
    RegionRequest,
)
from pie.probe_cache import ProbeCache, cache_key

ENTRY_POINT_GROUP = "pie.engines"
ENGINES_ENV = "PIE_ENGINES"
AUTOLOAD_ENV = "PIE_DISABLE_PLUGIN_AUTOLOAD"


class EngineError(RuntimeError):
    """An engine cannot be used; the message says which and why."""


class EngineSelectionError(EngineError):
    """The engine the user asked for cannot start (never silently replaced)."""


def requested_engines(env: Mapping[str, str] | None = None) -> list[str] | None:
    """Engine names from ``PIE_ENGINES``, in order, or None when unset."""
    raw = (env if env is not None else os.environ).get(ENGINES_ENV, "").strip()
    if not raw:
        return None
    names = [part.strip() for part in raw.split(",") if part.strip()]
    return names or None


class Engine:
    """One loaded engine plugin."""

    def __init__(self, name: str, distribution: str, version: str, manager: pluggy.PluginManager):
        self.name = name
        self.distribution = distribution
        self.version = version
        self._hook = manager.hook
        self._manager = manager
        self.info: EngineInfo = self._hook.pie_engine_info()
        self._devices: list[DeviceInfo] | None = None

    def has_hook(self, hook_name: str) -> bool:
        return bool(getattr(self._hook, hook_name).get_hookimpls())

    def probe_devices(self) -> list[DeviceInfo]:
        """Devices of this engine (probed once, then remembered)."""
        if self._devices is None:
            devices = list(self._hook.pie_probe_devices() or ())
            for device in devices:
                if not isinstance(device, DeviceInfo):
                    raise EngineError(
                        f"engine {self.name!r}: pie_probe_devices returned {type(device).__name__}, not DeviceInfo"
                    )
            self._devices = devices
        return self._devices

    def diagnose(self) -> list[Diagnosis]:
        if not self.has_hook("pie_diagnose"):
            return []
        return list(self._hook.pie_diagnose() or ())

    def profiles(self) -> list[str]:
        if not self.has_hook("pie_device_profiles"):
            return []
        return list(self._hook.pie_device_profiles() or ())

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


def _per_call(hook: Any, info: DeviceInfo, argument: str) -> Callable[[Any], Any]:
    """A hook of the runtime's every pass, for one device: the engine's own function where it is the one
    implementation (a pluggy call costs about 1.2 us, and each decode step moves its inputs and logits
    with nine of them), else the hook."""
    implementations = hook.get_hookimpls()
    if len(implementations) == 1 and not (implementations[0].hookwrapper or implementations[0].wrapper):
        function, names = implementations[0].function, tuple(implementations[0].argnames)
        if names == ("device", argument):
            return functools.partial(function, info)
        if names == (argument,):
            return function
    return lambda value: hook(device=info, **{argument: value})


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
        self._compiled: dict[KernelRequest, Launcher] = {}
        self._upload = _per_call(self._hook.pie_upload, info, "array")
        self._download = _per_call(self._hook.pie_download, info, "tensor")

    @property
    def name(self) -> str:
        return self.engine.name

    def __repr__(self) -> str:
        return f"<Device {self.info.key} {self.info.name!r}>"

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

    def compile(self, kernel: str, variant: str | None = None, **options: Any) -> Launcher:
        """Compile a catalogue kernel once and return its launcher (cached)."""
        request = KernelRequest(kernel, variant, tuple(sorted(options.items())))
        launcher = self._compiled.get(request)
        if launcher is None:
            if not self.supports(kernel, variant):
                wanted = kernel if variant is None else f"{kernel}[{variant}]"
                raise EngineError(f"engine {self.name!r} does not implement kernel {wanted}")
            launcher = self._hook.pie_compile_kernel(device=self.info, request=request)
            if launcher is None or not callable(launcher):
                raise EngineError(f"engine {self.name!r} returned no launcher for kernel {kernel!r}")
            self._compiled[request] = launcher
        return launcher

    def compile_region(self, region: RegionRequest) -> Launcher | None:
        """A launcher for a whole region when the engine compiles regions, else None."""
        if not self.engine.has_hook("pie_compile_region"):
            return None
        return self._hook.pie_compile_region(device=self.info, region=region)

    def compile_block(self, block: RegionRequest) -> Launcher | None:
        """A launcher for a whole block (one decoder layer) when the engine compiles blocks, else None."""
        if not self.engine.has_hook("pie_compile_block"):
            return None
        return self._hook.pie_compile_block(device=self.info, block=block)

    def compile_stack(self, stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Launcher | None:
        """A launcher for a run of blocks (a model's decoder layers) when the engine compiles stacks, else None."""
        if not self.engine.has_hook("pie_compile_stack"):
            return None
        return self._hook.pie_compile_stack(device=self.info, stack=stack, blocks=blocks)

    def source(self, request: KernelRequest | RegionRequest) -> str | None:
        """Generated source of a kernel or region, when the engine can show it."""
        if not self.engine.has_hook("pie_kernel_source"):
            return None
        return self._hook.pie_kernel_source(device=self.info, request=request)

    def synchronize(self) -> None:
        self._hook.pie_synchronize(device=self.info)

    def upload(self, array: np.ndarray) -> Any:
        return self._upload(array)

    def memory_bandwidth(self, passes: int = 5) -> float | None:
        """The engine's own measurement of its memory's read bandwidth (bytes/s, the best of ``passes``
        passes), if it makes one."""
        if not self.engine.has_hook("pie_memory_bandwidth"):
            return None
        return self._hook.pie_memory_bandwidth(device=self.info, passes=passes)

    def upload_weights(self, arrays: Sequence[np.ndarray]) -> list[Any]:
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

    def allocate_pages(self, layout: PageLayout) -> Any:
        pool = self._hook.pie_allocate_pages(device=self.info, layout=layout)
        if pool is None:
            raise EngineError(f"engine {self.name!r} could not allocate a page pool of {layout}")
        return pool

    def free_pages(self, pool: Any) -> None:
        self._hook.pie_free_pages(device=self.info, pool=pool)

    def read_pages(self, pool: Any, page_ids: np.ndarray) -> np.ndarray:
        return self._hook.pie_read_pages(device=self.info, pool=pool, page_ids=page_ids)

    def write_pages(self, pool: Any, page_ids: np.ndarray, data: np.ndarray) -> None:
        self._hook.pie_write_pages(device=self.info, pool=pool, page_ids=page_ids, data=data)


@dataclass
class _Entry:
    name: str
    distribution: str
    version: str
    plugin: Any = None
    load_error: str = ""
    engine: Engine | None = None
    error: str = ""
    probed: bool = False
    devices: list[DeviceInfo] = field(default_factory=list)


class EngineRegistry:
    """All installed engines, each either usable or broken with its reason."""

    def __init__(
        self, autoload: bool | None = None, env: Mapping[str, str] | None = None, probe_cache: ProbeCache | None = None
    ):
        self._env = dict(env if env is not None else os.environ)
        self._probe_cache = probe_cache
        if autoload is None:
            autoload = self._env.get(AUTOLOAD_ENV, "") in ("", "0")
        self._entries: dict[str, _Entry] = {}
        if autoload:
            self._discover()

    # -- discovery ---------------------------------------------------------

    def _discover(self) -> None:
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            dist = ep.dist
            self._entries.setdefault(
                ep.name,
                _Entry(ep.name, dist.metadata["Name"] if dist else "?", dist.version if dist else "?", plugin=ep),
            )

    def register(self, name: str, plugin: Any, distribution: str = "(in-process)", version: str = "") -> None:
        """Register an engine plugin object directly (tests, embedding)."""
        self._entries[name] = _Entry(name, distribution, version, plugin=plugin)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def _load(self, entry: _Entry) -> None:
        if entry.engine is not None or entry.error:
            return
        plugin = entry.plugin
        if isinstance(plugin, metadata.EntryPoint):
            try:
                plugin = plugin.load()
            except Exception as exc:
                entry.error = f"import failed: {type(exc).__name__}: {exc}"
                return
        manager = pluggy.PluginManager("pie")
        manager.add_hookspecs(hookspecs)
        try:
            manager.register(plugin, name=entry.name)
            manager.check_pending()
        except Exception as exc:
            entry.error = f"invalid plugin: {exc}"
            return
        missing = [h for h in hookspecs.REQUIRED_HOOKS if not getattr(manager.hook, h).get_hookimpls()]
        if missing:
            entry.error = f"missing required hooks: {', '.join(missing)}"
            return
        try:
            engine = Engine(entry.name, entry.distribution, entry.version, manager)
        except Exception as exc:
            entry.error = f"pie_engine_info failed: {type(exc).__name__}: {exc}"
            return
        info = engine.info
        if not isinstance(info, EngineInfo):
            entry.error = "pie_engine_info did not return an EngineInfo"
            return
        if info.contract_version != CONTRACT_VERSION:
            entry.error = (
                f"contract version {info.contract_version} is not supported "
                f"(pie-core {_core_version()} speaks version {CONTRACT_VERSION})"
            )
            return
        if info.name != entry.name:
            entry.error = f"entry point {entry.name!r} describes itself as {info.name!r}"
            return
        entry.engine = engine

    def _probe(self, entry: _Entry, cached: bool = False) -> None:
        self._load(entry)
        if entry.engine is None or entry.probed:
            return
        key = cache_key(entry.name, entry.version)
        if cached and self._probe_cache is not None:
            hit = self._probe_cache.get(key)
            if hit is not None:
                entry.devices, entry.error = hit
                return
        entry.probed = True
        try:
            entry.devices = entry.engine.probe_devices()
        except Exception as exc:
            entry.error = f"device probe failed: {type(exc).__name__}: {exc}"
        if self._probe_cache is not None:
            self._probe_cache.put(key, entry.devices, entry.error)

    # -- queries -----------------------------------------------------------

    def status(self, name: str, probe: bool = True, cached: bool = False) -> EngineStatus:
        """Where ``name`` stands; ``cached`` accepts a remembered probe (see :mod:`pie.probe_cache`)."""
        entry = self._entries.get(name)
        if entry is None:
            raise EngineSelectionError(
                f"engine {name!r} is not installed (installed: {', '.join(self.names()) or 'none'})"
            )
        requested = requested_engines(self._env)
        if requested is not None and name not in requested:
            return EngineStatus(name, entry.distribution, entry.version, "not-selected", f"not in {ENGINES_ENV}")
        if probe:
            self._probe(entry, cached)
        else:
            self._load(entry)
        info = entry.engine.info if entry.engine else None
        if entry.error:
            return EngineStatus(name, entry.distribution, entry.version, "broken", entry.error, info)
        if probe and not entry.devices:
            return EngineStatus(name, entry.distribution, entry.version, "no-device", "no device found", info)
        return EngineStatus(name, entry.distribution, entry.version, "ok", "", info, list(entry.devices))

    def statuses(self, probe: bool = True, cached: bool = False) -> list[EngineStatus]:
        return [self.status(name, probe, cached) for name in self.names()]

    def engine_diagnosis(self, name: str) -> list[Diagnosis]:
        """``pie_diagnose`` of an engine that loaded, even one whose device probe failed."""
        entry = self._entries[name]
        self._load(entry)
        return entry.engine.diagnose() if entry.engine is not None else []

    def engine(self, name: str) -> Engine:
        """A loaded engine by name, or EngineSelectionError saying why it cannot start."""
        self._require(name, cached=False)
        engine = self._entries[name].engine
        assert engine is not None
        return engine

    def _require(self, name: str, cached: bool) -> None:
        status = self.status(name, cached=cached)
        if status.status != "ok":
            raise EngineSelectionError(f"engine {name!r} cannot start: {status.reason}")

    def choose(self, name: str | None = None, cached: bool = False) -> tuple[str, str]:
        """The engine that would run, and why; strict about engines the user asked for.

        ``name`` (a CLI ``--engine``) wins over ``PIE_ENGINES``.
        """
        if name is not None:
            self._require(name, cached)
            return name, f"engine {name!r} was asked for"
        requested = requested_engines(self._env)
        if requested is not None:
            for wanted in requested:
                self._require(wanted, cached)
            return requested[0], f"first of {ENGINES_ENV}={','.join(requested)}"
        statuses = self.statuses(cached=cached)
        usable = [s for s in statuses if s.status == "ok" and s.info is not None]
        if not usable:
            summary = "; ".join(f"{s.name}: {s.reason}" for s in statuses) or "no engine is installed"
            raise EngineSelectionError(f"no engine can run here ({summary}); try `pie doctor`")
        best = max(usable, key=lambda s: (s.info.priority if s.info else 0, s.name))
        return best.name, f"highest priority of the working engines ({', '.join(s.name for s in usable)})"

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


def _core_version() -> str:
    from pie import __version__

    return __version__
