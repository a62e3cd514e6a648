"""Decoder layers of a decode pass as one native call: the engine's ``pie_compile_block`` (one layer)
and ``pie_compile_stack`` (all of them).

Per layer, lowering leaves five launches (the two native regions, the output projection, the gated
MLP input, the down projection). At batch 1 the Python between them — the plan loop, the launchers,
ctypes — came to a tenth of the step, with the memory bus idle all the while. One call per layer
cut that to one launch: SmolLM2's forward pass 12.52 -> 11.24 ms at batch 1, 18.80 -> 16.94 at 4,
33.40 -> 30.36 at 8 (medians, same process). The 30 launches that were left still cost 4% of a batch-1
decode step, their Python running with caches the weights had just swept; one call for the whole
stack of layers: 1.038x (median of 12 same-process rounds). Prefills, and passes of more rows than the
native projections take, are declined (``NotImplemented``) and run the layers' kernels one by one.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pie.contract import RegionRequest
from pie.poem.patterns import ATTENTION, ATTENTION_INPUT, AttentionInput, op_option
from pie.weights import StoredWeight

from pie_engine_cpu import native

MLP = ("linear", "add", "rms_norm", "linear", "silu_mul", "linear", "add")
DECODER_LAYER = ATTENTION_INPUT + ATTENTION + MLP

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


WEIGHTS = ("attn_norm", "qkv", "qkv_bias", "o", "o_bias", "mlp_norm", "gate_up", "down")
"""A decoder layer's weights in the order of ``struct decoder_layer``; qkv_bias and o_bias may be absent."""
MATRICES = ("qkv", "o", "gate_up", "down")
"""The weights that may come in a stored type (``native.WEIGHT_TYPES``); the others are float32."""


class DecoderLayerArguments(ctypes.Structure):
    """``struct decoder_layer`` of native.c."""

    _fields_ = [
        *((name, _P) for name in WEIGHTS),
        ("layer_pool", _P),
        *((name, _F) for name in ("attn_eps", "mlp_eps", "scale")),
        *((name, _L) for name in ("hidden", "q_width", "kv_width", "inter", "heads", "kv_heads", "dim", "page_size")),
        *((f"{name}_type", _L) for name in MATRICES),
        ("kv_type", _L),
    ]


class DecodePassArguments(ctypes.Structure):
    """``struct decode_pass`` of native.c."""

    _fields_ = [
        *((name, _P) for name in ("positions", "inv_freq")),
        *((name, _P) for name in ("slots", "qo_indptr", "page_indices", "page_indptr", "last_lens")),
        *((name, _L) for name in ("batch", "tokens")),
    ]


PASS_INDEX_FIELDS = ("positions", "slots", "qo_indptr", "page_indices", "page_indptr", "last_lens")
"""The int32 arrays of ``struct decode_pass``, in the order the launcher receives them (inv_freq aside)."""


class DecodePass:
    """One launcher's ``struct decode_pass``, pointed each pass into one int32 buffer it refills.

    The pass's index arrays go into the buffer with one ``concatenate`` and the struct's pointers move to
    their offsets. Converting, addressing and wrapping each array anew, and building the rotary tables
    with numpy, came to about 50 us a decode step (timed inside a decode loop): numpy's and ctypes' code
    runs with caches the weights have just swept. The native call makes the rotary tables itself."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.arguments = DecodePassArguments()
        self.address = ctypes.addressof(self.arguments)
        self.buffer = np.empty(0, dtype=np.int32)
        self.buffer_address = 0
        self.inv_freq: np.ndarray | None = None
        self.inv_freq_f32: np.ndarray | None = None

    def fill(self, positions: np.ndarray, inv_freq: np.ndarray, *indices: np.ndarray) -> int:
        """Points the struct at this pass's arrays; returns its address."""
        arguments = self.arguments
        if inv_freq is not self.inv_freq:
            if inv_freq.shape != (self.head_dim // 2,):
                raise ValueError(f"rotary inverse frequencies: expected {self.head_dim // 2}, got {inv_freq.shape}")
            self.inv_freq, self.inv_freq_f32 = inv_freq, native.float32_rows(inv_freq)
            arguments.inv_freq = native.address(self.inv_freq_f32)
        arrays = (positions, *indices)
        total = sum(map(len, arrays))
        if total > len(self.buffer):
            self.buffer = np.empty(2 * total, dtype=np.int32)
            self.buffer_address = self.buffer.ctypes.data
        np.concatenate(arrays, out=self.buffer[:total], casting="same_kind")
        address = self.buffer_address
        for name, array in zip(PASS_INDEX_FIELDS, arrays, strict=True):
            setattr(arguments, name, address)
            address += 4 * len(array)
        arguments.batch, arguments.tokens = len(indices[1]) - 1, len(positions)
        return self.address


@dataclass(frozen=True)
class DecoderLayer:
    """A block that is a decoder layer as the decoder graph builds it: the names it reads and writes."""

    shape: AttentionInput
    mlp_eps: float
    layer: int
    heads: int
    scale: float
    x: str
    pool: str
    weights: tuple[str | None, ...]
    """In the order of ``WEIGHTS``; None for an absent bias."""
    pass_arrays: tuple[str, ...]
    """The pass-wide arrays: positions, inverse frequencies, slots and the four attention indices."""
    output: str

    @classmethod
    def match(cls, block: RegionRequest) -> DecoderLayer | None:
        if tuple(op.kernel for op in block.ops) != DECODER_LAYER:
            return None
        shape = AttentionInput.match(block.ops[: len(ATTENTION_INPUT)])
        if shape is None:
            return None
        norm, projection, rope_q, rope_k = shape.norm, shape.projection, shape.rope_q, shape.rope_k
        append, attend, o_proj, o_add, mlp_norm, gate_up, silu, down, down_add = block.ops[len(ATTENTION_INPUT) :]
        x = norm.inputs[0]
        chained = (
            append.inputs[1:3] == (rope_k.output, shape.v_slice.output)
            and attend.inputs[:2] == (rope_q.output, append.inputs[0])
            and op_option(append, "layer") == op_option(attend, "layer")
            and o_proj.inputs[0] == attend.output
            and set(o_add.inputs) == {o_proj.output, x}
            and mlp_norm.inputs[0] == o_add.output
            and gate_up.inputs[0] == mlp_norm.output
            and gate_up.inputs[2] is None
            and silu.inputs == (gate_up.output,)
            and down.inputs[0] == silu.output
            and down.inputs[2] is None
            and set(down_add.inputs) == {down.output, o_add.output}
            and block.outputs == (down_add.output,)
        )
        if not chained or dict(attend.options).get("window") or dict(attend.options).get("softcap"):
            return None  # a sliding window or soft-capping: the layer runs kernel by kernel
        weights = (
            norm.inputs[1], projection.inputs[1], projection.inputs[2], o_proj.inputs[1], o_proj.inputs[2],
            mlp_norm.inputs[1], gate_up.inputs[1], down.inputs[1],
        )
        return cls(
            shape, float(op_option(mlp_norm, "eps")), int(op_option(attend, "layer")),
            int(op_option(attend, "num_heads")), float(op_option(attend, "scale")), x, append.inputs[0], weights,
            (rope_q.inputs[1], rope_q.inputs[2], append.inputs[3], *attend.inputs[2:6]), down_add.output,
        )


def compile_block(block: RegionRequest) -> Callable[..., Any] | None:
    """A launcher for a decoder layer block as the decoder graph builds it, else None."""
    layer = DecoderLayer.match(block)
    return None if layer is None else _DecoderLayersLauncher((layer,), block.inputs)


def compile_stack(stack: RegionRequest, blocks: tuple[RegionRequest, ...]) -> Callable[..., Any] | None:
    """A launcher for decoder layer blocks that each read the one before's output, else None."""
    layers = tuple(layer for layer in map(DecoderLayer.match, blocks) if layer is not None)
    if not layers or len(layers) != len(blocks):
        return None
    first = layers[0]
    chained = all(
        layer.x == before.output and layer.pool == first.pool and layer.pass_arrays == first.pass_arrays
        for before, layer in zip(layers, layers[1:])
    )
    read = {first.x, first.pool, *first.pass_arrays, *(n for layer in layers for n in layer.weights if n is not None)}
    if not chained or stack.outputs != (layers[-1].output,) or not read <= set(stack.inputs):
        return None
    return _DecoderLayersLauncher(layers, stack.inputs)


def _bind_layer(arguments: DecoderLayerArguments, layer: DecoderLayer, weights: tuple[Any, ...]) -> None:
    """Writes one layer's weights and shapes into its ``struct decoder_layer``, checking each weight."""
    attn_norm, qkv, qkv_bias, o, o_bias, mlp_norm, gate_up, down = weights
    shape = layer.shape
    hidden, inter = qkv.shape[1], gate_up.shape[0] // 2
    expected = (
        (hidden,), (shape.q_width + 2 * shape.kv_width, hidden), (shape.q_width + 2 * shape.kv_width,),
        (hidden, shape.q_width), (hidden,), (hidden,), (2 * inter, hidden), (hidden, inter),
    )
    for name, weight, want in zip(WEIGHTS, weights, expected, strict=True):
        if weight is None:
            continue
        stored = isinstance(weight, StoredWeight)
        if weight.shape != want or (stored and name not in MATRICES) or not (stored or weight.dtype == np.float32):
            got = repr(weight) if stored else f"{weight.dtype} {weight.shape}"
            raise ValueError(
                f"decoder layer {layer.layer} weight {name}: expected C-contiguous float32 {want} (or a stored "
                f"type, for {', '.join(MATRICES)}), got {got}"
            )
    for name, weight in zip(WEIGHTS, weights, strict=True):
        pointer, code = native.weight_address(weight)
        setattr(arguments, name, pointer)
        if name in MATRICES:
            setattr(arguments, f"{name}_type", code)
    arguments.attn_eps, arguments.mlp_eps, arguments.scale = shape.eps, layer.mlp_eps, layer.scale
    arguments.hidden, arguments.q_width, arguments.kv_width, arguments.inter = (
        hidden, shape.q_width, shape.kv_width, inter,
    )
    arguments.heads, arguments.dim = layer.heads, shape.head_dim
    arguments.kv_heads = shape.kv_width // shape.head_dim


class _DecoderLayersLauncher:
    """Binds its layers' weights and pages into an array of ``struct decoder_layer`` at the first launch
    (again only if the plan ever passes other arrays) and runs them natively, in one call, for decode
    passes."""

    def __init__(self, layers: tuple[DecoderLayer, ...], inputs: tuple[str, ...]) -> None:
        position = {name: index for index, name in enumerate(inputs)}
        first = layers[0]
        self.layers = layers
        self.decode_pass = DecodePass(first.shape.head_dim)
        self.x_at, self.pool_at = position[first.x], position[first.pool]
        self.weight_at = tuple(tuple(None if n is None else position[n] for n in layer.weights) for layer in layers)
        self.present_weights = operator.itemgetter(*(at for layer in self.weight_at for at in layer if at is not None))
        self.pass_arrays = operator.itemgetter(*(position[name] for name in first.pass_arrays))
        self.kernel, self.max_rows = native.load().decoder_layers, native.load().max_rows
        self.pool_addresses = tuple(native.LayerAddress(layer.layer) for layer in layers)
        self.pool: np.ndarray | None = None
        self.weights: tuple[Any, ...] = ()
        self.arguments = (DecoderLayerArguments * len(layers))()
        self.arguments_address = ctypes.addressof(self.arguments)

    def _bound(self, weights: tuple[Any, ...]) -> bool:
        """Whether these are the weights bound last. A call of its own, so the tuple is gone before the
        native call: dropped after it, each weight's Python object would be a cache miss."""
        return len(weights) == len(self.weights) and all(map(operator.is_, weights, self.weights))

    def __call__(self, *args: Any) -> Any:
        x = args[self.x_at]
        tokens = x.shape[0]
        if tokens > self.max_rows:
            return NotImplemented
        if not self._bound(self.present_weights(args)):
            for arguments, layer, weight_at in zip(self.arguments, self.layers, self.weight_at, strict=True):
                _bind_layer(arguments, layer, tuple(None if at is None else args[at] for at in weight_at))
            self.weights = self.present_weights(args)
        pool = args[self.pool_at]
        if pool is not self.pool:
            for arguments, pool_address in zip(self.arguments, self.pool_addresses, strict=True):
                arguments.layer_pool, arguments.page_size = pool_address(pool), pool.shape[3]
                arguments.kv_type = pool_address.kv_type
            self.pool = pool
        pass_address = self.decode_pass.fill(*self.pass_arrays(args))
        x = native.float32_rows(x)
        out = np.empty(x.shape, dtype=np.float32)
        status = self.kernel(
            self.arguments_address, len(self.layers), pass_address, native.address(x), native.address(out)
        )
        if status == -2:
            return NotImplemented
        native.checked(status)
        return (out,)
