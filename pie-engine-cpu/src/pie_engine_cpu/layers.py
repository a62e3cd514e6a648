"""Decoder layers of a decode pass as one native call: the engine's ``pie_compile_block`` (one layer)
and ``pie_compile_stack`` (all of them).

The native call runs the layer its block's description (`pie.contract.DecoderLayerBlock`) states, Q/K
norms, post-norms, sliding windows, soft-capped scores and both gate activations included: at batch 1 the
Python between a layer's launches leaves the memory bus idle. Prefills, and passes of more rows than the
native projections take, are declined (``NotImplemented``) and run the layers' kernels one by one.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pie.contract import DecoderLayerBlock, RegionRequest
from pie.enginekit.blocks import described_layer, layer_roles, layer_weight_shapes, stacked_layers
from pie.kernels import attention_options
from pie.runtime.pass_plan import check_page_table_values, check_slot_values
from pie.weights import StoredWeight

from pie_engine_cpu import kernels, native

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


WEIGHTS = (
    "attn_norm", "qkv", "qkv_bias", "o", "o_bias", "mlp_norm", "gate_up", "down", "q_norm", "k_norm",
    "attn_post_norm", "mlp_post_norm",
)
"""The layer roles (`pie.contract.LAYER_WEIGHT_ROLES`) the native call takes, in the order of
``struct decoder_layer``; qkv_bias and o_bias may be absent, q_norm and k_norm are there only with
``qk_norm``, attn_post_norm and mlp_post_norm only with ``post_norms``."""
MATRICES = ("qkv", "o", "gate_up", "down")
"""The weights that may come in a stored type (``native.WEIGHT_TYPES``); the others are float32."""
GATE_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
"""The MLP gate activations the native call computes (`DecoderLayerBlock.activation`) -> ``GATE_*`` in native.c."""


class DecoderLayerArguments(ctypes.Structure):
    """``struct decoder_layer`` of native.c."""

    _fields_ = [
        *((name, _P) for name in WEIGHTS),
        *((name, _P) for name in ("inv_freq", "layer_pool")),
        *((name, _F) for name in ("attn_eps", "mlp_eps", "scale", "softcap")),
        *((name, _L) for name in ("hidden", "q_width", "kv_width", "inter", "heads", "kv_heads", "dim", "page_size")),
        *((name, _L) for name in ("window", "activation")),
        *((f"{name}_type", _L) for name in MATRICES),
        ("kv_type", _L),
    ]


PASS_INDEX_FIELDS = ("positions", "slots", "qo_indptr", "page_indices", "page_indptr", "last_lens")
"""The int32 arrays of ``struct decode_pass``, in the order of `DecoderLayerBlock.pass_inputs` (the order the
launcher receives them in) and of `kernels.PassFacts.index_addresses`."""


class DecodePassArguments(ctypes.Structure):
    """``struct decode_pass`` of native.c."""

    _fields_ = [
        *((name, _P) for name in PASS_INDEX_FIELDS),
        *((name, _L) for name in ("batch", "tokens", "num_indices", "num_pages")),
    ]


def rotary_frequencies(inv_freq: np.ndarray, head_dim: int) -> np.ndarray:
    """A layer's rotary inverse frequencies as the float32 ``[head_dim // 2]`` its struct points at."""
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"rotary inverse frequencies: expected {head_dim // 2}, got {inv_freq.shape}")
    return native.float32_rows(inv_freq)


class DecodePass:
    """One launcher's ``struct decode_pass``, pointed each pass at the pass's int32 index arrays: the running
    pass plan's (`kernels.PassFacts.index_addresses`, made once a pass for every launcher), else the launch's
    own, converted; either held until the next. The native call makes the rotary tables itself."""

    def __init__(self) -> None:
        self.arguments = DecodePassArguments()
        self.address = ctypes.addressof(self.arguments)
        self.held: tuple[np.ndarray, ...] = ()

    def fill(self, positions: np.ndarray, *indices: np.ndarray) -> int:
        """Points the struct at this pass's arrays (in the order of ``PASS_INDEX_FIELDS``); returns its address."""
        arguments = self.arguments
        running = kernels.running_pass()
        if running is None:
            self.held = tuple(map(native.int32_indices, (positions, *indices)))
            addresses = tuple(array.ctypes.data for array in self.held)
        else:
            self.held, addresses = running.index_arrays, running.index_addresses
        for name, address in zip(PASS_INDEX_FIELDS, addresses, strict=True):
            setattr(arguments, name, address)
        positions, _, qo_indptr, page_indices, *_ = self.held
        arguments.batch, arguments.tokens, arguments.num_indices = len(qo_indptr) - 1, len(positions), len(page_indices)
        return self.address


@dataclass(frozen=True)
class DecoderLayer:
    """A block whose layer description the native decode call runs: the names it reads and writes."""

    description: DecoderLayerBlock
    weights: tuple[str | None, ...]
    """In the order of ``WEIGHTS``; None for an absent bias and for a role the layer's options leave out."""

    @property
    def bound(self) -> tuple[str | None, ...]:
        """What the launcher binds into the layer's struct once: its weights, then its rotary frequencies."""
        return (*self.weights, self.description.inv_freq)

    @classmethod
    def of(cls, block: RegionRequest) -> DecoderLayer | None:
        """The block's layer, when it is one the native call runs and the block reads and writes what the
        description names; else None (an option the call lacks, a weight it needs not described, or no
        description)."""
        layer = described_layer(block)
        if layer is None or layer.activation not in GATE_ACTIVATIONS:
            return None
        if {role for role, _ in layer.weights} - set(WEIGHTS):  # a role added to the contract since
            return None
        roles = layer_roles(layer)
        return cls(layer, tuple(layer.weight(role) if role in roles else None for role in WEIGHTS))


def compile_block(block: RegionRequest) -> Callable[..., Any] | None:
    """A launcher for a decoder layer block the native call runs, else None."""
    layer = DecoderLayer.of(block)
    return None if layer is None else _DecoderLayersLauncher((layer,), block.inputs)


def compile_stack(stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Callable[..., Any] | None:
    """A launcher for decoder layer blocks that each read the one before's output, else None. The layers
    may differ in their options and rotary frequencies (sliding-window and global layers may alternate)."""
    if stacked_layers(stack, blocks) is None:
        return None
    layers = tuple(layer for layer in map(DecoderLayer.of, blocks) if layer is not None)
    return _DecoderLayersLauncher(layers, stack.inputs) if len(layers) == len(blocks) else None


def _bind_layer(arguments: DecoderLayerArguments, layer: DecoderLayer, bound: tuple[Any, ...]) -> np.ndarray:
    """Writes one layer's weights, rotary frequencies, options and shapes into its ``struct decoder_layer``,
    checking each weight; ``bound`` holds the values of `DecoderLayer.bound`. Returns the float32
    frequencies the struct points at, for the caller to hold."""
    described, weights = layer.description, bound[:-1]
    hidden, inter = described.hidden, described.intermediate
    q_width, kv_width = described.num_heads * described.head_dim, described.num_kv_heads * described.head_dim
    shapes = layer_weight_shapes(described)
    for name, weight in zip(WEIGHTS, weights, strict=True):
        if weight is None:
            continue
        want = shapes[name]
        stored = isinstance(weight, StoredWeight)
        if weight.shape != want or (stored and name not in MATRICES) or not (stored or weight.dtype == np.float32):
            got = repr(weight) if stored else f"{weight.dtype} {weight.shape}"
            raise ValueError(
                f"decoder layer {described.layer} weight {name}: expected C-contiguous float32 {want} (or a stored "
                f"type, for {', '.join(MATRICES)}), got {got}"
            )
    frequencies = rotary_frequencies(bound[-1], described.head_dim)
    for name, weight in zip(WEIGHTS, weights, strict=True):
        pointer, code = native.weight_address(weight)
        setattr(arguments, name, pointer)
        if name in MATRICES:
            setattr(arguments, f"{name}_type", code)
    arguments.inv_freq = native.address(frequencies)
    arguments.window, arguments.softcap = attention_options(described.window, described.softcap)
    arguments.activation = GATE_ACTIVATIONS[described.activation]
    arguments.attn_eps = arguments.mlp_eps = described.eps
    arguments.scale = described.scale
    arguments.hidden, arguments.q_width, arguments.kv_width, arguments.inter = hidden, q_width, kv_width, inter
    arguments.heads, arguments.dim, arguments.kv_heads = described.num_heads, described.head_dim, described.num_kv_heads
    return frequencies


class _DecoderLayersLauncher:
    """Binds its layers' weights and pages into an array of ``struct decoder_layer`` at the first launch
    (again only if the plan ever passes other arrays) and runs them natively, in one call, for decode
    passes."""

    def __init__(self, layers: tuple[DecoderLayer, ...], inputs: tuple[str, ...]) -> None:
        position = {name: index for index, name in enumerate(inputs)}
        first = layers[0].description
        self.layers = layers
        self.decode_pass = DecodePass()
        self.x_at, self.pool_at = position[first.x], position[first.pool]
        self.bound_at = tuple(tuple(None if n is None else position[n] for n in layer.bound) for layer in layers)
        self.present_bound = operator.itemgetter(*(at for layer in self.bound_at for at in layer if at is not None))
        self.pass_arrays = operator.itemgetter(*(position[name] for name in first.pass_inputs))
        self.kernel, self.max_rows = native.load().decoder_layers, native.load().max_rows
        self.pool_addresses = tuple(native.LayerAddress(layer.description.layer) for layer in layers)
        self.pool: np.ndarray | None = None
        self.bound: tuple[Any, ...] = ()
        self.frequencies: list[np.ndarray] = []
        """The float32 rotary frequencies the structs point at."""
        self.arguments = (DecoderLayerArguments * len(layers))()
        self.arguments_address = ctypes.addressof(self.arguments)

    def _bound(self, values: tuple[Any, ...]) -> bool:
        """Whether these are the weights and frequencies bound last. A call of its own, so the tuple is gone
        before the native call: dropped after it, each weight's Python object would be a cache miss."""
        return len(values) == len(self.bound) and all(map(operator.is_, values, self.bound))

    def __call__(self, *args: Any) -> Any:
        x = args[self.x_at]
        running = kernels.running_pass()
        if x.shape[0] > self.max_rows or (running is not None and not running.plan.decode_only):
            return NotImplemented  # the native call declines a launch of its own that is no decode pass (-2)
        if not self._bound(self.present_bound(args)):
            self.frequencies = [
                _bind_layer(arguments, layer, tuple(None if at is None else args[at] for at in bound_at))
                for arguments, layer, bound_at in zip(self.arguments, self.layers, self.bound_at, strict=True)
            ]
            self.bound = self.present_bound(args)
        pool = args[self.pool_at]
        if pool is not self.pool:
            for arguments, pool_address in zip(self.arguments, self.pool_addresses, strict=True):
                arguments.layer_pool, arguments.page_size = pool_address(pool), pool.shape[3]
                arguments.kv_type = pool_address.kv_type
            self.decode_pass.arguments.num_pages = pool.shape[1]
            self.pool = pool
        pass_address = self.decode_pass.fill(*self.pass_arrays(args))
        x = native.float32_rows(x)
        out = np.empty(x.shape, dtype=np.float32)
        status = self.kernel(
            self.arguments_address, len(self.layers), pass_address, native.address(x), native.address(out)
        )
        if status == -2:
            return NotImplemented
        if status == native.OUTSIDE_POOL:  # name the value the native call refused
            positions, slots, *tables = self.decode_pass.held
            page_size, num_pages = pool.shape[3], pool.shape[1]
            check_slot_values("decoder layers", slots, page_size, num_pages)
            check_page_table_values("decoder layers", *tables, page_size, rows=len(positions), num_pages=num_pages)
        native.checked(status)
        return (out,)
