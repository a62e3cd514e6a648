"""Plain records exchanged between pie-core and engines.

Everything an engine returns through a hook is one of these types (or a numpy
array), so the runtime never depends on an engine's own classes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pie.runtime.pass_plan import PassPlan as PassPlan  # re-exported: what ``pie_begin_pass`` hands engines

CONTRACT_VERSION = 1
"""Version of the hook contract. An engine declares the version it implements;
pie-core refuses an engine whose version differs (the engine is listed as broken). A new optional
hook keeps the version, since an engine without it still works; changing a hook's arguments or
meaning, removing one or making one required raises it."""

KvDtype = Literal["float32", "float16", "bfloat16"]
"""The element types a KV page pool may hold (``PageLayout.dtype``; engines list theirs in ``pie_kv_dtypes``)."""
KV_DTYPES: tuple[str, ...] = get_args(KvDtype)


def kv_host_dtype(dtype: str) -> Any:
    """The numpy dtype of host copies of a pool of ``dtype`` (``pie_read_pages``): ``numpy.float32``,
    ``numpy.float16`` or ``ml_dtypes.bfloat16``."""
    if dtype not in KV_DTYPES:
        raise ValueError(f"KV pages hold {', '.join(KV_DTYPES)}, not {dtype!r}")
    import numpy as np

    if dtype == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(dtype)


DeviceKind = Literal["cpu", "gpu", "integrated-gpu", "virtual-gpu", "tpu", "npu", "other"]


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, answered without importing its backend library."""

    name: str
    contract_version: int
    priority: int
    """Higher wins when no engine is asked for: GPU engines ~100, CPU 0."""
    kernel_languages: tuple[str, ...]
    description: str = ""


@dataclass(frozen=True)
class DeviceInfo:
    """One device an engine can run on."""

    engine: str
    index: int
    name: str
    vendor: str
    architecture: str
    kind: DeviceKind
    memory_bytes: int
    driver: str = ""
    extra: tuple[tuple[str, str], ...] = ()

    @property
    def key(self) -> str:
        return f"{self.engine}:{self.index}"


@dataclass(frozen=True)
class Diagnosis:
    """One finding of `pie doctor` for an engine."""

    ok: bool
    what: str
    """The library, driver or system package checked."""
    detail: str
    fix: str = ""
    """The exact command that fixes it (empty when ok)."""


@dataclass(frozen=True)
class PageLayout:
    """Shape of a KV page pool: ``[num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]``.

    Index 0 of the third axis holds keys, index 1 values.
    """

    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, self.num_pages, 2, self.page_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}[self.dtype]
        return self.num_layers * 2 * self.page_size * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class KernelRequest:
    """Ask an engine to compile one catalogue kernel for a device.

    ``variant`` picks one of the implementations the engine lists for the kernel
    (None: the engine's default). ``options`` carries compile-time constants such
    as an eta epilogue's source.
    """

    name: str
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, key: str, default: Any = None) -> Any:
        return dict(self.options).get(key, default)


@dataclass(frozen=True)
class RegionOp:
    """One op of a region: a catalogue kernel applied to named values."""

    kernel: str
    inputs: tuple[str | None, ...]
    output: str | None
    options: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class RegionRequest:
    """A whole Poem region offered to an engine that compiles regions as one unit (e.g. XLA).

    The launcher takes the values named in ``inputs`` positionally (weights,
    batch tensors, the page pool, activations from earlier regions) and returns
    a tuple with the values named in ``outputs``. ``label`` names the region
    (``L3.mlp_in``) for diagnostics and emitted source.
    """

    label: str
    ops: tuple[RegionOp, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


Launcher = Callable[..., Any]
"""A compiled kernel bound to a device: called with device tensors and scalars."""


@dataclass
class EngineStatus:
    """Discovery result for one installed engine."""

    name: str
    distribution: str
    version: str
    status: Literal["ok", "broken", "no-device", "not-selected"]
    reason: str = ""
    info: EngineInfo | None = None
    devices: list[DeviceInfo] = field(default_factory=list)
    fix: str = ""
    """The command that fixes a broken engine, where pie knows one."""
