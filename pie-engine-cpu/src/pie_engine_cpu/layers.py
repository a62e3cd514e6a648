"""A whole decoder layer of a decode pass as one native call: the engine's ``pie_compile_block``.

Per layer, lowering leaves five launches (the two native regions, the output projection, the gated
MLP input, the down projection). At batch 1 the Python between them — the plan loop, the launchers,
ctypes — came to a tenth of the step, with the memory bus idle all the while. One call per layer
cuts that to one launch: SmolLM2's forward pass 12.52 -> 11.24 ms at batch 1, 18.80 -> 16.94 at 4,
33.40 -> 30.36 at 8 (medians, same process). Prefills, and passes of more rows than the native
projections take, are declined (``NotImplemented``) and run the layer's kernels one by one.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from typing import Any

import numpy as np
from pie.contract import RegionRequest

from pie_engine_cpu import native
from pie_engine_cpu.kernels import ROPE_TABLES, PassCache
from pie_engine_cpu.regions import ATTENTION, ATTENTION_INPUT, AttentionInput, op_option

MLP = ("linear", "add", "rms_norm", "linear", "silu_mul", "linear", "add")
DECODER_LAYER = ATTENTION_INPUT + ATTENTION + MLP

_P, _L, _F = ctypes.c_void_p, ctypes.c_long, ctypes.c_float


WEIGHTS = ("attn_norm", "qkv", "qkv_bias", "o", "o_bias", "mlp_norm", "gate_up", "down")
"""A decoder layer's weights in the order of ``struct decoder_layer``; qkv_bias and o_bias may be absent."""


class DecoderLayerArguments(ctypes.Structure):
    """``struct decoder_layer`` of native.c."""

    _fields_ = [
        *((name, _P) for name in WEIGHTS),
        ("layer_pool", _P),
        *((name, _F) for name in ("attn_eps", "mlp_eps", "scale")),
        *((name, _L) for name in ("hidden", "q_width", "kv_width", "inter", "heads", "kv_heads", "dim", "page_size")),
    ]


class DecodePassArguments(ctypes.Structure):
    """``struct decode_pass`` of native.c."""

    _fields_ = [
        *((name, _P) for name in ("cos", "signed_sin")),
        *((name, _P) for name in ("slots", "qo_indptr", "page_indices", "page_indptr", "last_lens")),
        *((name, _L) for name in ("batch", "tokens")),
    ]


def _decode_pass(
    positions: np.ndarray, inv_freq: np.ndarray, slots: np.ndarray, *attention_indices: np.ndarray
) -> tuple[tuple[Any, ...], int]:
    """The pass's ``struct decode_pass`` and its address, with everything it points into."""
    tables = ROPE_TABLES(positions, inv_freq)
    copies, addresses = native.PASS_INDICES(*attention_indices)
    slots = native.int32_indices(slots)
    arguments = DecodePassArguments(
        native.address(tables.cos_by_token), native.address(tables.sin_by_token), native.address(slots),
        *addresses, len(attention_indices[0]) - 1, len(positions),
    )
    return (tables, copies, slots, arguments), ctypes.addressof(arguments)


_DECODE_PASSES = PassCache(_decode_pass)
"""The ``struct decode_pass`` of the latest pass, built by its first layer and read by the others."""


def compile_block(block: RegionRequest) -> Callable[..., Any] | None:
    """A launcher for a decoder layer block as the decoder graph builds it, else None."""
    if tuple(op.kernel for op in block.ops) != DECODER_LAYER:
        return None
    attention_input = AttentionInput.match(block.ops[: len(ATTENTION_INPUT)])
    if attention_input is None:
        return None
    norm, projection, rope_q, rope_k = (
        attention_input.norm, attention_input.projection, attention_input.rope_q, attention_input.rope_k,
    )
    append, attend, o_proj, o_add, mlp_norm, gate_up, silu, down, down_add = block.ops[len(ATTENTION_INPUT) :]
    x = norm.inputs[0]
    chained = (
        append.inputs[1:3] == (rope_k.output, attention_input.v_slice.output)
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
    if not chained:
        return None
    position: dict[str | None, int] = {name: index for index, name in enumerate(block.inputs)}
    weight_names = (
        norm.inputs[1], projection.inputs[1], projection.inputs[2], o_proj.inputs[1], o_proj.inputs[2],
        mlp_norm.inputs[1], gate_up.inputs[1], down.inputs[1],
    )
    pass_names = (rope_q.inputs[1], rope_q.inputs[2], append.inputs[3], *attend.inputs[2:6])
    return _DecoderLayerLauncher(
        attention_input, float(op_option(mlp_norm, "eps")), int(op_option(attend, "layer")),
        int(op_option(attend, "num_heads")), float(op_option(attend, "scale")),
        position[x], position[append.inputs[0]],
        tuple(None if name is None else position[name] for name in weight_names),
        operator.itemgetter(*(position[name] for name in pass_names)),
    )


class _DecoderLayerLauncher:
    """Binds one layer's weights and pages into its ``struct decoder_layer`` at the first launch (again
    only if the plan ever passes other arrays) and runs the layer natively for decode passes."""

    def __init__(
        self, attention_input: AttentionInput, mlp_eps: float, layer: int, heads: int, scale: float,
        x_at: int, pool_at: int, weight_at: tuple[int | None, ...], pass_arrays: Callable[[tuple[Any, ...]], Any],
    ) -> None:
        self.shape = attention_input
        self.mlp_eps, self.heads, self.scale = mlp_eps, heads, scale
        self.x_at, self.pool_at, self.weight_at, self.pass_arrays = x_at, pool_at, weight_at, pass_arrays
        present = [at for at in weight_at if at is not None]
        self.present_weights = operator.itemgetter(*present)
        self.kernel = native.load().decoder_layer
        self.pool_address = native.LayerAddress(layer)
        self.pool: np.ndarray | None = None
        self.weights: tuple[Any, ...] = ()
        self.arguments = DecoderLayerArguments()
        self.arguments_address = ctypes.addressof(self.arguments)

    def _bind(self, weights: tuple[Any, ...]) -> None:
        attn_norm, qkv, qkv_bias, o, o_bias, mlp_norm, gate_up, down = weights
        shape = self.shape
        hidden, inter = qkv.shape[1], gate_up.shape[0] // 2
        expected = (
            (hidden,), (shape.q_width + 2 * shape.kv_width, hidden), (shape.q_width + 2 * shape.kv_width,),
            (hidden, shape.q_width), (hidden,), (hidden,), (2 * inter, hidden), (hidden, inter),
        )
        for name, weight, want in zip(WEIGHTS, weights, expected, strict=True):
            if weight is None:
                continue
            if weight.shape != want or weight.dtype != np.float32 or not weight.flags.c_contiguous:
                raise ValueError(
                    f"decoder layer weight {name}: expected C-contiguous float32 {want}, "
                    f"got {weight.dtype} {weight.shape}"
                )
        arguments = self.arguments
        for name, weight in zip(WEIGHTS, weights, strict=True):
            setattr(arguments, name, native.address(weight))
        arguments.attn_eps, arguments.mlp_eps, arguments.scale = shape.eps, self.mlp_eps, self.scale
        arguments.hidden, arguments.q_width, arguments.kv_width, arguments.inter = (
            hidden, shape.q_width, shape.kv_width, inter,
        )
        arguments.heads, arguments.dim = self.heads, shape.head_dim
        arguments.kv_heads = shape.kv_width // shape.head_dim

    def __call__(self, *args: Any) -> Any:
        x = args[self.x_at]
        tokens = x.shape[0]
        if tokens > native.MAX_ROWS:
            return NotImplemented
        weights = self.present_weights(args)
        if len(weights) != len(self.weights) or not all(map(operator.is_, weights, self.weights)):
            self._bind(tuple(None if at is None else args[at] for at in self.weight_at))
            self.weights = weights
        pool = args[self.pool_at]
        if pool is not self.pool:
            self.arguments.layer_pool, self.arguments.page_size = self.pool_address(pool), pool.shape[3]
            self.pool = pool
        _, pass_address = _DECODE_PASSES(*self.pass_arrays(args))
        x = native.float32_rows(x)
        out = np.empty(x.shape, dtype=np.float32)
        status = self.kernel(self.arguments_address, pass_address, native.address(x), native.address(out))
        if status == -2:
            return NotImplemented
        native.checked(status)
        return (out,)
