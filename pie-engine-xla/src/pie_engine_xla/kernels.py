"""The catalogue kernels as jax.numpy functions: one definition each, shared by kernels and regions.

Each function is traced inside a region's jitted function, never called eagerly.
Shapes follow :mod:`pie.kernels`, with two engine-specific twists:

- ``layer`` of ``append_kv``/``attention`` is a traced int32 scalar, so the 30
  layers of a model share one compiled program instead of compiling 30.
- ``groups`` of ``slice_columns``/``silu_mul`` reads a column-permuted layout used
  for tensor parallelism (see :mod:`pie.poem.sharding`): the columns are
  ``groups`` equal blocks, each holding a proportional piece of every segment.
  With ``groups=1`` this is the plain catalogue semantics.

A weight kept in its stored type (:mod:`pie_engine_xla.stored`) reaches ``embedding`` and ``linear``
as a :class:`~pie_engine_xla.stored.Stored`, widened to float32 there; KV pages of a 16-bit pool
are rounded as ``append_kv`` writes them and widened as ``attention`` reads them.

Padding rows (see :mod:`pie_engine_xla.tensors`) stay finite and never reach a
real row: every kernel is row-wise except ``append_kv`` (padded slots point past
the pool and are dropped) and ``attention`` (padded queries see nothing and
produce zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax import lax
from pie.poem.fusions import FUSED

from pie_engine_xla.stored import Stored
from pie_engine_xla.tensors import Tensor

if TYPE_CHECKING:
    from pie_engine_xla.mesh import MeshDevice

_HIGHEST = lax.Precision.HIGHEST
"""float32 matmuls everywhere: TPUs default to bfloat16 passes, GPUs to TF32."""

_NEG = -1e30


def embedding(ids: jax.Array, table: jax.Array | Stored) -> jax.Array:
    if isinstance(table, Stored):
        return table.take(ids)
    return jnp.take(table, ids, axis=0, mode="clip")


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps)) * weight


def rms_norm_heads(x: jax.Array, weight: jax.Array, *, eps: float, head_dim: int) -> jax.Array:
    heads = x.reshape(x.shape[0], -1, head_dim)
    return rms_norm(heads, weight, eps=eps).reshape(x.shape)


def linear(x: jax.Array, weight: jax.Array | Stored, bias: jax.Array | None = None) -> jax.Array:
    if isinstance(weight, Stored):
        weight = weight.dense()
    y = lax.dot_general(x, weight, (((1,), (1,)), ((), ())), precision=_HIGHEST)
    return y if bias is None else y + bias


def add(a: jax.Array, b: jax.Array) -> jax.Array:
    return a + b


def slice_columns(x: jax.Array, *, start: int, stop: int, groups: int = 1) -> jax.Array:
    tokens, width = x.shape
    blocks = x.reshape(tokens, groups, width // groups)
    return blocks[:, :, start // groups : stop // groups].reshape(tokens, stop - start)


def silu_mul(gate_up: jax.Array, *, groups: int = 1) -> jax.Array:
    tokens, width = gate_up.shape
    blocks = gate_up.reshape(tokens, groups, width // groups)
    half = width // groups // 2
    gate, up = blocks[:, :, :half], blocks[:, :, half:]
    return (jax.nn.silu(gate) * up).reshape(tokens, width // 2)


def rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, *, head_dim: int) -> jax.Array:
    tokens = x.shape[0]
    heads = x.reshape(tokens, -1, head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, None, :]
    half = head_dim // 2
    rotated = jnp.concatenate([-heads[..., half:], heads[..., :half]], axis=-1)
    return (heads * cos + rotated * sin).reshape(x.shape)


def append_kv(pool: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, layer: jax.Array) -> jax.Array:
    """Returns the updated pool (written in place when the caller donates it)."""
    page_size, kv_heads, head_dim = pool.shape[3:]
    pages, offsets = slots // page_size, slots % page_size
    shape = (k.shape[0], kv_heads, head_dim)
    pool = pool.at[layer, pages, 0, offsets].set(k.reshape(shape).astype(pool.dtype), mode="drop")
    return pool.at[layer, pages, 1, offsets].set(v.reshape(shape).astype(pool.dtype), mode="drop")


def attention(
    q: jax.Array,
    pool: jax.Array,
    qo_indptr: jax.Array,
    kv_page_indices: jax.Array,
    kv_page_indptr: jax.Array,
    kv_last_page_lens: jax.Array,
    layer: jax.Array,
    *,
    num_heads: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> jax.Array:
    """Causal paged attention over the batch's pages laid end to end.

    Every query scores every gathered KV slot and a mask keeps its own
    sequence's slots up to its position (within its window): static shapes
    for any ragged batch.
    """
    tokens = q.shape[0]
    page_size, kv_heads, head_dim = pool.shape[3:]
    num_pages = kv_page_indices.shape[0]
    group = num_heads // kv_heads
    real_tokens, real_pages = qo_indptr[-1], kv_page_indptr[-1]

    pages = lax.dynamic_index_in_dim(pool, layer, axis=0, keepdims=False)[kv_page_indices]
    keys = pages[:, 0].reshape(num_pages * page_size, kv_heads, head_dim).astype(jnp.float32)
    values = pages[:, 1].reshape(num_pages * page_size, kv_heads, head_dim).astype(jnp.float32)

    kv_lens = (kv_page_indptr[1:] - kv_page_indptr[:-1] - 1) * page_size + kv_last_page_lens
    q_lens = qo_indptr[1:] - qo_indptr[:-1]
    page = jnp.arange(num_pages, dtype=jnp.int32)
    page_seq = jnp.sum(page[:, None] >= kv_page_indptr[None, 1:], axis=1)
    page_seq = jnp.minimum(page_seq, kv_last_page_lens.shape[0] - 1)
    slot_pos = ((page - kv_page_indptr[page_seq]) * page_size)[:, None] + jnp.arange(page_size, dtype=jnp.int32)
    slot_seq = jnp.repeat(page_seq, page_size)
    slot_ok = jnp.repeat(page < real_pages, page_size)

    token = jnp.arange(tokens, dtype=jnp.int32)
    token_seq = jnp.minimum(jnp.sum(token[:, None] >= qo_indptr[None, 1:], axis=1), q_lens.shape[0] - 1)
    token_pos = kv_lens[token_seq] - q_lens[token_seq] + token - qo_indptr[token_seq]
    visible = (
        (slot_seq[None, :] == token_seq[:, None])
        & (slot_pos.reshape(-1)[None, :] <= token_pos[:, None])
        & slot_ok[None, :]
        & (token < real_tokens)[:, None]
    )
    if window:
        visible &= slot_pos.reshape(-1)[None, :] > token_pos[:, None] - window

    queries = q.reshape(tokens, kv_heads, group, head_dim)
    scores = jnp.einsum("tkgd,skd->tkgs", queries, keys, precision=_HIGHEST) * jnp.float32(scale)
    if softcap:
        scores = jnp.float32(softcap) * jnp.tanh(scores / jnp.float32(softcap))
    mask = visible[:, None, None, :]
    scores = jnp.where(mask, scores, _NEG)
    weights = jnp.where(mask, jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True)), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    out = jnp.einsum("tkgs,skd->tkgd", weights / jnp.where(total > 0, total, 1.0), values, precision=_HIGHEST)
    return out.reshape(tokens, num_heads * head_dim)


def gather_rows(x: jax.Array, rows: jax.Array) -> jax.Array:
    return jnp.take(x, rows, axis=0, mode="clip")


def argmax(x: jax.Array) -> jax.Array:
    return jnp.argmax(x, axis=-1).astype(jnp.int32)


def softmax(x: jax.Array, *, temperature: float) -> jax.Array:
    return jax.nn.softmax(x / jnp.float32(temperature), axis=-1)


def top_k_launcher(k: int, mesh: MeshDevice) -> Callable[[Any], tuple[Any, Any]]:
    """``top_k`` as its own jitted function, outside regions (which carry one output per kernel):
    ``lax.top_k`` puts the lower index first on ties, as the catalogue asks. Row padding and the
    row permutation of the logits carry over to both outputs, which are row-wise."""
    select = jax.jit(lambda x: lax.top_k(x, k))

    def top_k(x: Tensor) -> tuple[Tensor, Tensor]:
        values, indices = mesh.last = select(jnp.asarray(x.host) if x.host is not None else x.array)
        return (
            Tensor(array=values, rows=x.rows, perm=x.perm),
            Tensor(array=indices.astype(jnp.int32), rows=x.rows, perm=x.perm),
        )

    return top_k


PRIMITIVES: dict[str, Callable[..., Any]] = {
    "embedding": embedding,
    "rms_norm": rms_norm,
    "rms_norm_heads": rms_norm_heads,
    "linear": linear,
    "add": add,
    "slice_columns": slice_columns,
    "silu_mul": silu_mul,
    "rope": rope,
    "append_kv": append_kv,
    "attention": attention,
    "gather_rows": gather_rows,
    "argmax": argmax,
    "softmax": softmax,
}

KERNELS = (*PRIMITIVES, *FUSED)
"""The primitives above, and the fused kernels as their chains of them (XLA fuses them again)."""
