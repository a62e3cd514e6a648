"""Evaluate an epilogue's IR with numpy or jax.numpy.

One interpreter serves both: an `ArrayBackend` maps each IR primitive to array code
written against the numpy API; the jax backend overrides only bf16 rounding and erf. Values
are arrays broadcastable to `[rows, cols]`: full inputs are `[rows, cols]`, column vectors
`[1, cols]`, row vectors and reductions `[rows, 1]`, params and constants 0-d. Floats stay
float32 throughout (never float64); f16/bf16 values are float32 arrays holding rounded
values, exactly as the generated kernels keep them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from .ir import Const, Index, Load, Op, ParamRef, Reduce, postorder
from .types import DType, Shape

if TYPE_CHECKING:
    from .epilogue import Epilogue

# erf: a Taylor series below 0.5 (good relative accuracy near zero), Abramowitz & Stegun
# 7.1.26 above (absolute error < 1.5e-7). The WGSL and Metal renderers use the same.
ERF_TAYLOR = (
    1.1283791670955126,
    -0.37612638903183754,
    0.11283791670955126,
    -0.026866170645131252,
    0.005223977625442188,
    -0.0008548327023450852,
    0.00012055332981789664,
)
ERF_AS = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
ERF_AS_P = 0.3275911

_NP_DTYPES = {
    DType.F32: np.float32,
    DType.F16: np.float32,
    DType.BF16: np.float32,
    DType.I32: np.int32,
    DType.BOOL: np.bool_,
}
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
# IR operations by the numpy function computing them; `_UFUNCS` are those taking `out=`.
_FUNCTIONS = {
    "add": "add",
    "sub": "subtract",
    "mul": "multiply",
    "div": "divide",
    "min": "minimum",
    "max": "maximum",
    "neg": "negative",
    "abs": "abs",
    "exp": "exp",
    "exp2": "exp2",
    "log": "log",
    "log2": "log2",
    "sqrt": "sqrt",
    "tanh": "tanh",
    "sin": "sin",
    "cos": "cos",
    "floor": "floor",
    "ceil": "ceil",
    "round": "round",
    "eq": "equal",
    "ne": "not_equal",
    "lt": "less",
    "le": "less_equal",
    "gt": "greater",
    "ge": "greater_equal",
    "and": "logical_and",
    "or": "logical_or",
    "not": "logical_not",
    "select": "where",
}
_UFUNCS = frozenset(name for name, function in _FUNCTIONS.items() if isinstance(getattr(np, function), np.ufunc))


class ArrayBackend:
    """IR primitives as array operations, written against the numpy API of `xp`."""

    in_place = True  # ufuncs may write into a dead intermediate (`out=`)

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def op(self, name: str, dtype: DType, args: list[Any], out: Any = None) -> Any:
        """The value of an IR operation; `out`, if given, is a free array to write it to."""
        if name == "cast":
            return self.cast(args[0], dtype)
        if name == "rsqrt":
            return np.float32(1.0) / self.xp.sqrt(args[0])
        if name == "erf":
            return self.erf(args[0])
        function = getattr(self.xp, _FUNCTIONS[name])
        return function(*args) if out is None else function(*args, out=out)

    def cast(self, x: Any, dtype: DType) -> Any:
        xp = self.xp
        if dtype is DType.BOOL:
            return x != 0
        if dtype is DType.I32 and x.dtype in (np.bool_, np.int32):
            return x.astype(np.int32)
        if dtype is DType.I32:  # truncate, saturate, NaN -> 0 (as the kernels' eta_f2i)
            t = xp.trunc(x)
            inside = (t >= -2147483648.0) & (t < 2147483648.0)
            value = xp.where(inside, t, 0).astype(np.int32)
            value = xp.where(t >= 2147483648.0, _I32_MAX, value)
            return xp.where(t < -2147483648.0, _I32_MIN, value).astype(np.int32)
        x = x.astype(np.float32)
        if dtype is DType.F16:
            return x.astype(np.float16).astype(np.float32)
        if dtype is DType.BF16:
            return self.round_bf16(x)
        return x

    def round_bf16(self, x: Any) -> Any:
        bits = np.asarray(x).view(np.uint32)
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) & np.uint32(0xFFFF0000)).view(np.float32)
        return np.where(np.isnan(x), x, rounded)

    def erf(self, x: Any) -> Any:
        xp, f = self.xp, np.float32
        a, z = xp.abs(x), x * x
        small = f(ERF_TAYLOR[-1])
        for c in reversed(ERF_TAYLOR[:-1]):
            small = f(c) + z * small
        t = f(1.0) / (f(1.0) + f(ERF_AS_P) * a)
        poly = f(ERF_AS[-1])
        for c in reversed(ERF_AS[:-1]):
            poly = f(c) + t * poly
        y = f(1.0) - t * poly * xp.exp(-a * a)
        return xp.where(a < f(0.5), x * small, xp.where(x < 0, -y, y))

    def reduce(self, op: str, x: Any, shape: tuple[int, int]) -> Any:
        xp = self.xp
        x = xp.broadcast_to(x, shape)
        if op == "sum":
            return xp.sum(x, axis=1, keepdims=True, dtype=x.dtype)
        if x.dtype == np.int32:
            initial: float = _I32_MIN if op == "max" else _I32_MAX
        else:
            initial = -np.inf if op == "max" else np.inf
        return getattr(xp, op)(x, axis=1, keepdims=True, initial=x.dtype.type(initial))


class _JaxBackend(ArrayBackend):
    in_place = False  # jax arrays are immutable

    def round_bf16(self, x: Any) -> Any:
        return x.astype(self.xp.bfloat16).astype(np.float32)

    def erf(self, x: Any) -> Any:
        import jax

        return jax.lax.erf(x)


def evaluate(
    epilogue: Epilogue, backend: ArrayBackend, values: Mapping[str, Any], shape: tuple[int, int]
) -> dict[int, Any]:
    """The value of every IR node (by `id`), given bound inputs/params as arrays.

    With an in-place backend, an elementwise operation writes into the array of an operand
    it is the last user of (when shape and dtype fit), so a chain of operations reuses a
    few buffers instead of allocating one per step.
    """
    xp = backend.xp
    rows, cols = shape
    nodes = list(postorder(o.value for o in epilogue.outputs))
    last_use = {id(arg): k for k, node in enumerate(nodes) for arg in node.args}
    outputs = {id(o.value) for o in epilogue.outputs}
    results: dict[int, Any] = {}
    for k, node in enumerate(nodes):
        match node:
            case Const():
                value = xp.asarray(node.value, dtype=_NP_DTYPES[node.dtype])
            case Load(shape=Shape.COLS):
                value = values[node.name][None, :]
            case Load(shape=Shape.ROWS):
                value = values[node.name][:, None]
            case Load():
                value = values[node.name]
            case ParamRef():
                value = values[node.name]
            case Index(which="row"):
                value = xp.arange(rows, dtype=np.int32)[:, None]
            case Index(which="col"):
                value = xp.arange(cols, dtype=np.int32)[None, :]
            case Index():
                value = xp.asarray(cols if node.which == "cols" else rows, dtype=np.int32)
            case Op():
                args = [results[id(arg)] for arg in node.args]
                free = [
                    results[id(arg)]
                    for arg in node.args
                    if isinstance(arg, Op) and last_use[id(arg)] == k and id(arg) not in outputs
                ]
                out = (
                    next((a for a in free if _fits(a, args, node)), None)
                    if backend.in_place and node.op in _UFUNCS
                    else None
                )
                value = backend.op(node.op, node.dtype, args, out)
            case Reduce():
                value = backend.reduce(node.op, results[id(node.operand)], shape)
        results[id(node)] = value
    return results


def _fits(array: Any, args: list[Any], node: Op) -> bool:
    """Whether `array` can hold the result of `node` applied to `args`."""
    return (
        isinstance(array, np.ndarray)
        and array.dtype == _NP_DTYPES[node.dtype]
        and array.shape == np.broadcast_shapes(*(np.shape(a) for a in args))
    )


def bind(epilogue: Epilogue, kwargs: Mapping[str, Any], xp: Any) -> tuple[dict[str, Any], tuple[int, int]]:
    """Check and convert the keyword arguments of a call; returns them and `(rows, cols)`."""
    expected = [i.name for i in epilogue.inputs] + [p.name for p in epilogue.params]
    missing = [name for name in expected if name not in kwargs]
    unexpected = [name for name in kwargs if name not in expected]
    if missing or unexpected:
        raise TypeError(f"epilogue takes {', '.join(expected)}; missing {missing}, unexpected {unexpected}")
    values = {i.name: xp.asarray(kwargs[i.name], dtype=_NP_DTYPES[i.dtype]) for i in epilogue.inputs}
    shape = next(values[i.name].shape for i in epilogue.inputs if i.shape is Shape.FULL)
    if len(shape) != 2:
        raise ValueError(f"full inputs are [rows, cols] arrays, got shape {shape}")
    for i in epilogue.inputs:
        want = {Shape.FULL: shape, Shape.COLS: shape[1:], Shape.ROWS: shape[:1]}[i.shape]
        if values[i.name].shape != want:
            raise ValueError(f"input {i.name!r} has shape {values[i.name].shape}, expected {want}")
    for p in epilogue.params:
        values[p.name] = xp.asarray(kwargs[p.name], dtype=_NP_DTYPES[p.dtype])
    return values, shape


def numpy_fn(epilogue: Epilogue) -> Callable[..., dict[str, np.ndarray]]:
    backend = ArrayBackend(np)

    def run(**kwargs: Any) -> dict[str, np.ndarray]:
        values, shape = bind(epilogue, kwargs, np)
        with np.errstate(all="ignore"):
            results = evaluate(epilogue, backend, values, shape)
        outputs, returned = {}, set()
        for o in epilogue.outputs:
            value, dtype = results[id(o.value)], _NP_DTYPES[o.dtype]
            fresh = isinstance(o.value, Op) and id(o.value) not in returned  # computed here, not an input
            if fresh and isinstance(value, np.ndarray) and value.shape == shape and value.dtype == dtype:
                outputs[o.name] = value
            else:
                outputs[o.name] = np.array(np.broadcast_to(value, shape), dtype=dtype)
            returned.add(id(o.value))
        return outputs

    return run


def jax_fn(epilogue: Epilogue) -> Callable[..., dict[str, Any]]:
    import jax
    import jax.numpy as jnp

    backend = _JaxBackend(jnp)

    def run(**kwargs: Any) -> dict[str, Any]:
        values, shape = bind(epilogue, kwargs, jnp)
        results = evaluate(epilogue, backend, values, shape)
        return {
            o.name: jnp.broadcast_to(results[id(o.value)], shape).astype(_NP_DTYPES[o.dtype]) for o in epilogue.outputs
        }

    return jax.jit(run)
