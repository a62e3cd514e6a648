"""The kernel catalogue: every kernel the runtime may launch, with its numpy reference.

Engines implement catalogue kernels by name (``pie_list_kernels``); the
conformance kit checks each against the reference here on random shapes.
The references are written for clarity and computed in float64; they are the
specification, not the fast path.

Conventions: activations are ``[tokens, features]`` float32, weights are
``[out_features, in_features]`` (``y = x @ W.T``), integer tensors are int32.
Arguments after ``*`` in a signature are compile-time options: they are fixed
when the kernel is compiled, and the launcher takes only the tensors.
A ragged batch is described FlashInfer-style: ``qo_indptr[b]:qo_indptr[b+1]``
are sequence b's new tokens, its KV pages are
``kv_page_indices[kv_page_indptr[b]:kv_page_indptr[b+1]]`` and its last page
holds ``kv_last_page_lens[b]`` tokens. New tokens are the last ones of their
sequence, and attention is causal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class KernelSpec:
    name: str
    signature: str
    doc: str
    primitive: bool
    """False for kernels an engine may leave out: fused ones (Poem then uses primitives) and ``top_k``
    (the runtime then selects on the host, see ``Device.top_tokens``)."""
    epilogues: tuple[str, ...] = ()
    """The eta stdlib epilogues (pie.eta.stdlib) this kernel applies to its result."""


def _spec(name: str, signature: str, doc: str, primitive: bool = True, epilogues: tuple[str, ...] = ()) -> KernelSpec:
    return KernelSpec(name, signature, doc, primitive, epilogues)


CATALOG: dict[str, KernelSpec] = {
    s.name: s
    for s in (
        _spec("embedding", "(ids[T]:i32, table[V,D]) -> [T,D]", "Rows of the embedding table."),
        _spec("rms_norm", "(x[T,D], weight[D], *, eps) -> [T,D]", "x / sqrt(mean(x^2) + eps) * weight."),
        _spec(
            "rms_norm_heads",
            "(x[T,H*d], weight[d], *, eps, head_dim) -> [T,H*d]",
            "rms_norm of each head's d values on their own, one weight for every head (q/k norms before rope).",
        ),
        _spec("linear", "(x[T,K], weight[N,K], bias[N]|None) -> [T,N]", "x @ weight.T (+ bias)."),
        _spec("add", "(a[T,D], b[T,D]) -> [T,D]", "Residual connection.", epilogues=("residual_add",)),
        _spec("slice_columns", "(x[T,W], *, start, stop) -> [T,stop-start]", "x[:, start:stop]."),
        _spec(
            "silu_mul",
            "(gate_up[T,2F]) -> [T,F]",
            "SiLU gating on the halves: silu(gate_up[:, :F]) * gate_up[:, F:].",
            epilogues=("silu_mul",),
        ),
        _spec(
            "rope",
            "(x[T,H*d], positions[T]:i32, inv_freq[d/2], *, head_dim) -> [T,H*d]",
            "Rotary embedding, rotate-half layout, angle = float32(position * inv_freq).",
        ),
        _spec(
            "append_kv",
            "(pool, k[T,Hkv*d], v[T,Hkv*d], slots[T]:i32, *, layer) -> None",
            "Write each token's K and V into the pool at flat slot page*page_size+offset (in place).",
        ),
        _spec(
            "attention",
            "(q[T,Hq*d], pool, qo_indptr[B+1], kv_page_indices[P], kv_page_indptr[B+1], "
            "kv_last_page_lens[B], *, layer, num_heads, scale, window=0, softcap=0) -> [T,Hq*d]",
            "Causal paged attention with grouped KV heads. A query at KV index i (its position in its "
            "sequence's KV) sees key j when j <= i and, with a sliding window, j > i - window. With softcap, "
            "each score s = scale * q.k becomes softcap * tanh(s / softcap) before masking and softmax. "
            "Both options are off when absent or 0.",
        ),
        _spec("gather_rows", "(x[T,D], rows[B]:i32) -> [B,D]", "x[rows]."),
        _spec("argmax", "(x[B,V]) -> [B]:i32", "Index of each row's maximum (first on ties)."),
        _spec(
            "epilogue",
            "(*inputs, *, source, params) -> [T,N]",
            "An eta epilogue (pie.eta): tensors in the program's declared input order, params "
            "((name, value) pairs: an int for an i32 param) fixed at compile time; returns the program's first output.",
        ),
        _spec("softmax", "(x[B,V], *, temperature) -> [B,V]", "Row softmax of x / temperature."),
        _spec(
            "top_k",
            "(x[B,V], *, k) -> (values[B,k], indices[B,k]:i32)",
            "Each row's k largest values, largest first (the lower index first on ties), and their indices; "
            "for sampling on the device. The order of a row holding NaN is not specified.",
            primitive=False,
        ),
        _spec(
            "rms_norm_linear",
            "(x[T,K], norm_weight[K], weight[N,K], bias[N]|None, *, eps) -> [T,N]",
            "rms_norm followed by linear.",
            primitive=False,
        ),
        _spec(
            "linear_add",
            "(x[T,K], weight[N,K], residual[T,N]) -> [T,N]",
            "linear followed by a residual add.",
            primitive=False,
            epilogues=("residual_add",),
        ),
        _spec(
            "rms_norm_gate_up_silu",
            "(x[T,K], norm_weight[K], gate_up[2F,K], *, eps) -> [T,F]",
            "rms_norm, the stacked gate/up projection and silu_mul in one kernel.",
            primitive=False,
            epilogues=("silu_mul",),
        ),
    )
}

PRIMITIVES = tuple(name for name, spec in CATALOG.items() if spec.primitive)
POOL_KERNELS = ("append_kv", "attention")
"""The kernels that read or write the KV page pool: they run where the pool lives, so an engine
that lacks one cannot hand it to the CPU engine and cannot run a model."""
MODEL_KERNELS = ("embedding", "rms_norm", "linear", "add", "slice_columns", "rope", *POOL_KERNELS, "gather_rows")
"""The primitives the forward pass of every model launches (:mod:`pie.models.decoder`): an engine that lacks one,
with no CPU engine to run it, cannot run a model. The other primitives run for some models only (``silu_mul``:
SiLU MLPs; ``epilogue``: GELU MLPs, scaled embeddings, soft-capped logits, ``--logit-epilogue``; ``rms_norm_heads``:
q/k norms), or outside the forward pass (``argmax``: greedy sampling, on the host where the engine lacks it), or
never in a model (``softmax``)."""
PROJECTIONS = ("linear", "rms_norm_linear", "linear_add", "rms_norm_gate_up_silu")
"""The kernels that multiply by a weight matrix (the projections, alone or fused)."""
WEIGHT_KERNELS = ("embedding", *PROJECTIONS)
"""The kernels that read a weight: those an engine may read in a stored type (``pie_weight_types``)."""
ARG_ROLES: dict[str, tuple[str, ...]] = {
    "embedding": ("index", "table"),
    "rms_norm": ("act", "weight"),
    "rms_norm_heads": ("act", "weight"),
    "linear": ("act", "weight", "weight"),
    "add": ("act", "act"),
    "slice_columns": ("act",),
    "silu_mul": ("act",),
    "rope": ("act", "index", "weight"),
    "append_kv": ("pool", "act", "act", "slots"),
    "attention": ("act", "pool", "indptr", "index", "indptr", "index"),
    "gather_rows": ("act", "index"),
    "argmax": ("act",),
    "softmax": ("act",),
}
"""What each tensor argument of a primitive (``epilogue`` aside: its inputs are the program's) is: ``act``
an activation ``[tokens or rows, ...]``, ``index`` int32 indices of the batch, ``slots`` KV slots (one per
token), ``indptr`` a ``[B+1]`` offset array, ``weight`` and ``table`` model weights (``table``: the
embedding's), ``pool`` the KV page pool. An engine that pads or places a launch's arguments by what they
are reads it here."""
BATCH_ROLES = ("act", "index", "slots", "indptr")
"""The roles whose leading axis follows the batch (its tokens, rows or sequences), not the model."""


def attention_options(window: Any = 0, softcap: Any = 0.0) -> tuple[int, float]:
    """``attention``'s window and softcap checked, as (int, float): None or 0 is off. Engines compile with these."""
    window = 0 if window is None else window
    softcap = 0.0 if softcap is None else softcap
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 0:
        raise ValueError(f"attention window must be a non-negative int (0: no window), got {window!r}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, np.floating, np.integer)) or not (
        np.isfinite(softcap) and softcap >= 0
    ):
        raise ValueError(f"attention softcap must be a finite non-negative number (0: no capping), got {softcap!r}")
    return int(window), float(softcap)


def epilogue_launcher(
    program: Any, params: tuple[tuple[str, float], ...], run: Callable[..., Any]
) -> Callable[..., Any]:
    """The catalogue's ``epilogue`` kernel over ``run``, an evaluator of the eta ``program`` (a
    ``pie.eta.Epilogue``) called with its inputs and params by name: the launcher takes the tensors in the
    program's declared input order, binds ``params`` and returns the program's first output."""
    names = [spec.name for spec in program.inputs]
    output = program.outputs[0].name
    bound = dict(params)

    def launch(*inputs: Any) -> Any:
        return run(**dict(zip(names, inputs, strict=True)), **bound)[output]

    return launch


def rotary_tables(positions: Any, inv_freq: Any, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """``rope``'s cos and signed sin of each position, ``[T, head_dim]`` each in ``dtype``: the rotate-half
    layout turns ``x`` into ``x * cos + swap_halves(x) * signed_sin``. The angle is rounded to float32 as
    transformers computes it; only then widened to ``dtype`` (the references' float64, an engine's float32)."""
    angles = (np.asarray(positions, np.float32)[:, None] * np.asarray(inv_freq, np.float32)[None, :]).astype(dtype)
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate((cos, cos), -1), np.concatenate((-sin, sin), -1)


# --------------------------------------------------------------------------
# Reference implementations (float64 inside, float32 out)
# --------------------------------------------------------------------------


def _f64(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    return np.asarray(table, dtype=np.float32)[np.asarray(ids, dtype=np.int64)]


def rms_norm(x: np.ndarray, weight: np.ndarray, *, eps: float) -> np.ndarray:
    x64 = _f64(x)
    scale = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * scale * _f64(weight)).astype(np.float32)


def rms_norm_heads(x: np.ndarray, weight: np.ndarray, *, eps: float, head_dim: int) -> np.ndarray:
    from pie.enginekit.catalogue import check_heads  # the catalogue imports this module

    tokens = x.shape[0]
    heads = check_heads("rms_norm_heads", x, head_dim)
    normed = rms_norm(np.asarray(x).reshape(tokens, heads, head_dim), weight, eps=eps)
    return normed.reshape(tokens, -1)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    y = _f64(x) @ _f64(weight).T
    if bias is not None:
        y = y + _f64(bias)
    return y.astype(np.float32)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return _stdlib_epilogue("residual_add", x=a, residual=b)


def slice_columns(x: np.ndarray, *, start: int, stop: int) -> np.ndarray:
    return np.array(x[:, start:stop], dtype=np.float32)


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    half = gate_up.shape[-1] // 2
    return _stdlib_epilogue("silu_mul", gate=gate_up[:, :half], up=gate_up[:, half:])


def _stdlib_epilogue(name: str, **inputs: np.ndarray) -> np.ndarray:
    """The model's own epilogues are eta programs (pie.eta.stdlib); their numpy rendering is the reference."""
    from pie.eta.stdlib import get

    program = get(name)
    result = program.numpy_fn()(**{key: np.asarray(value, np.float32) for key, value in inputs.items()})
    return np.asarray(result[program.outputs[0].name], dtype=np.float32)


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, *, head_dim: int) -> np.ndarray:
    tokens = x.shape[0]
    heads = _f64(x).reshape(tokens, -1, head_dim)
    cos, signed_sin = rotary_tables(positions, inv_freq, np.float64)
    half = head_dim // 2
    swapped = np.concatenate([heads[..., half:], heads[..., :half]], axis=-1)
    return (heads * cos[:, None] + swapped * signed_sin[:, None]).reshape(tokens, -1).astype(np.float32)


def append_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray, *, layer: int) -> None:
    _, _, _, page_size, kv_heads, head_dim = pool.shape
    for token, slot in enumerate(np.asarray(slots)):
        page, offset = divmod(int(slot), page_size)
        pool[layer, page, 0, offset] = k[token].reshape(kv_heads, head_dim)
        pool[layer, page, 1, offset] = v[token].reshape(kv_heads, head_dim)


def attention(
    q: np.ndarray,
    pool: np.ndarray,
    qo_indptr: np.ndarray,
    kv_page_indices: np.ndarray,
    kv_page_indptr: np.ndarray,
    kv_last_page_lens: np.ndarray,
    *,
    layer: int,
    num_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    window, softcap = attention_options(window, softcap)
    _, _, _, page_size, kv_heads, head_dim = pool.shape
    group = num_heads // kv_heads
    out = np.zeros((q.shape[0], num_heads * head_dim), dtype=np.float32)
    for b in range(len(qo_indptr) - 1):
        pages = kv_page_indices[kv_page_indptr[b] : kv_page_indptr[b + 1]]
        kv_len = (len(pages) - 1) * page_size + int(kv_last_page_lens[b])
        keys = _f64(pool[layer, pages, 0]).reshape(-1, kv_heads, head_dim)[:kv_len]
        values = _f64(pool[layer, pages, 1]).reshape(-1, kv_heads, head_dim)[:kv_len]
        start, stop = int(qo_indptr[b]), int(qo_indptr[b + 1])
        q_len = stop - start
        queries = _f64(q[start:stop]).reshape(q_len, num_heads, head_dim)
        for i in range(q_len):
            visible = kv_len - q_len + i + 1
            first = max(0, visible - window) if window else 0
            for h in range(num_heads):
                kv_h = h // group
                scores = keys[first:visible, kv_h] @ queries[i, h] * scale
                if softcap:
                    scores = softcap * np.tanh(scores / softcap)
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[start + i, h * head_dim : (h + 1) * head_dim] = weights @ values[first:visible, kv_h]
    return out


def gather_rows(x: np.ndarray, rows: np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)[np.asarray(rows, dtype=np.int64)]


def argmax(x: np.ndarray) -> np.ndarray:
    return np.argmax(x, axis=-1).astype(np.int32)


def softmax(x: np.ndarray, *, temperature: float) -> np.ndarray:
    z = _f64(x) / temperature
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return (z / z.sum(axis=-1, keepdims=True)).astype(np.float32)


def top_k(x: np.ndarray, *, k: int) -> tuple[np.ndarray, np.ndarray]:
    rows = np.asarray(x, dtype=np.float32)
    order = np.argsort(-rows, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(rows, order, axis=-1), order.astype(np.int32)


def epilogue(*inputs: np.ndarray, source: str, params: tuple[tuple[str, float], ...] = ()) -> np.ndarray:
    from pie import eta

    program = eta.compile(source)
    launch = epilogue_launcher(program, params, program.numpy_fn())
    return np.asarray(launch(*map(np.asarray, inputs)), dtype=np.float32)


def rms_norm_linear(
    x: np.ndarray, norm_weight: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None, *, eps: float
) -> np.ndarray:
    return linear(rms_norm(x, norm_weight, eps=eps), weight, bias)


def linear_add(x: np.ndarray, weight: np.ndarray, residual: np.ndarray) -> np.ndarray:
    return (_f64(x) @ _f64(weight).T + _f64(residual)).astype(np.float32)


def rms_norm_gate_up_silu(x: np.ndarray, norm_weight: np.ndarray, gate_up: np.ndarray, *, eps: float) -> np.ndarray:
    return silu_mul(linear(rms_norm(x, norm_weight, eps=eps), gate_up))


REFERENCE: dict[str, Callable[..., np.ndarray | tuple[np.ndarray, ...] | None]] = {
    name: globals()[name] for name in CATALOG
}
