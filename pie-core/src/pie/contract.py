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
MAX_PRIORITY = 1000
"""An engine's priority lies within -MAX_PRIORITY..MAX_PRIORITY (``EngineInfo.priority``)."""
MAX_MEMORY_BYTES = 1 << 60
"""The most memory a device may claim (``DeviceInfo.memory_bytes``, a profile's ``memory_bytes``): an exbibyte."""


@dataclass(frozen=True)
class EngineInfo:
    """What an engine is, answered without importing its backend library."""

    name: str
    contract_version: int
    priority: int
    """Higher wins when no engine is asked for: GPU engines ~100, CPU 0 (within +-MAX_PRIORITY)."""
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
    """0 where the device does not say (WebGPU), else at most MAX_MEMORY_BYTES."""
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

    Index 0 of the third axis holds keys, index 1 values. ``dtype`` is the element type (a ``KV_DTYPES`` name the
    engine lists in ``pie_kv_dtypes``; its host copies are arrays of :func:`kv_host_dtype`).
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

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's pages, keys and values of every page: what a kernel of one layer reads or writes
        (``pie_max_page_pool_layer_bytes`` bounds it)."""
        return self.num_pages * (self.page_bytes // self.num_layers)


@dataclass(frozen=True)
class KernelRequest:
    """Ask an engine to compile one catalogue kernel for a device.

    ``variant`` picks one of the implementations the engine lists for the kernel
    (None: the engine's default). ``options`` carries compile-time constants: the
    arguments after ``*`` in the kernel's catalogue signature (``eps``, ``layer``, an
    eta epilogue's source); one with a default may be absent.
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


LAYER_WEIGHT_ROLES = (
    "attn_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "o_bias", "attn_post_norm",
    "mlp_norm", "gate_up", "down", "mlp_post_norm",
)
"""The weights a decoder layer may have, by role (see `DecoderLayerBlock.weights`)."""
LayerActivation = Literal["silu", "gelu_tanh"]


@dataclass(frozen=True)
class DecoderLayerBlock:
    """A decoder layer as its model describes it, offered with its block (``RegionRequest.layer``).

    The layer computes, on the residual stream ``x`` (``[tokens, hidden]``)::

        h = rms_norm(x, attn_norm)                        # eps
        q, k, v = split(h @ qkv.T + qkv_bias)             # widths num_heads*head_dim, 2 x num_kv_heads*head_dim
        q, k = rms_norm per head (q_norm, k_norm)         # only with qk_norm
        q, k = rope(q, k, positions, inv_freq)            # rotate_half layout
        a = attention(q, paged K/V of this layer)         # scale; window and softcap when non-zero
        x = x + post_norm(a @ o.T + o_bias)               # attn_post_norm only with post_norms
        g, u = split(rms_norm(x, mlp_norm) @ gate_up.T)   # gate rows first
        x = x + post_norm((act(g) * u) @ down.T)          # activation; mlp_post_norm only with post_norms

    ``weights`` maps each role present (a name of `LAYER_WEIGHT_ROLES`) to the input naming it; the other
    fields name the pass-wide inputs the block reads and the value it writes. An engine that runs the
    layer as one unit reads this instead of the block's ops, and declines (returns None) an option it
    does not implement, so that Poem runs the layer kernel by kernel.
    """

    layer: int
    weights: tuple[tuple[str, str], ...]
    x: str
    output: str
    pool: str
    positions: str
    inv_freq: str
    slots: str
    qo_indptr: str
    kv_page_indices: str
    kv_page_indptr: str
    kv_last_page_lens: str
    hidden: int
    intermediate: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    scale: float
    qk_norm: bool = False
    window: int = 0
    """Key j is visible to query i only when ``j > i - window``; 0: every earlier key."""
    softcap: float = 0.0
    """Attention scores pass through ``softcap * tanh(s / softcap)``; 0: not capped."""
    post_norms: bool = False
    activation: LayerActivation = "silu"

    def __post_init__(self) -> None:
        unknown = [role for role, _ in self.weights if role not in LAYER_WEIGHT_ROLES]
        if unknown:
            raise ValueError(f"decoder layer {self.layer}: unknown weight roles {unknown}; known: {LAYER_WEIGHT_ROLES}")

    def weight(self, role: str) -> str | None:
        """The input holding the weight of ``role``, None where the layer has none."""
        return dict(self.weights).get(role)

    @property
    def pass_inputs(self) -> tuple[str, ...]:
        """The pass-wide inputs every layer of a pass shares: positions, slots and the four attention indices.
        The rotary frequencies (``inv_freq``) are the layer's own: Gemma 3's sliding and global layers differ."""
        return (self.positions, self.slots, self.qo_indptr, self.kv_page_indices, self.kv_page_indptr,
                self.kv_last_page_lens)


@dataclass(frozen=True)
class AttentionInputRegion:
    """A region that computes a described layer's attention input, offered with it
    (``RegionRequest.attention_input``): from ``layer.x``, the norm, the QKV projection (and bias), the
    per-head Q/K norms with ``layer.qk_norm``, and RoPE of q and k, as `DecoderLayerBlock` states them.
    ``q``, ``k`` and ``v`` name the region's outputs (q and k rotated). An engine that runs the region as
    one unit reads this instead of the region's ops."""

    layer: DecoderLayerBlock
    q: str
    k: str
    v: str


@dataclass(frozen=True)
class AttentionRegion:
    """A region that appends a described layer's k and v to its pages of ``layer.pool`` (at ``layer.slots``)
    and attends q over them, offered with it (``RegionRequest.attention``): ``layer`` states the heads, head
    dim, scale, window, soft-cap and the four index inputs, the pool its KV dtype. ``q``, ``k`` and ``v``
    name the region's inputs from the attention input, ``output`` the attention it exports. An engine that
    runs the region as one unit reads this instead of the region's ops."""

    layer: DecoderLayerBlock
    q: str
    k: str
    v: str
    output: str


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
    layer: DecoderLayerBlock | None = None
    """Set on a block that is one decoder layer: what the layer is, so that no engine matches its ops."""
    attention_input: AttentionInputRegion | None = None
    """Set on a region that is exactly a described layer's attention input: what it computes."""
    attention: AttentionRegion | None = None
    """Set on a region that is exactly a described layer's append_kv and attention: what it computes."""


Launcher = Callable[..., Any]
"""A compiled kernel bound to a device: called with its device tensors positionally (None for an absent optional
one); its scalars were fixed when it was compiled (``KernelRequest.options``)."""


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
