"""numpy kernels of the CPU engine, float32 throughout (a KV pool may hold float16 or bfloat16: read widened).

Every kernel keeps float32: a float64 operand anywhere would silently make
the matmuls several times slower. Python float scalars are fine (numpy treats
them as weak), numpy float64 scalars are not, so eps and scales are converted
once when a kernel is compiled.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
from pie.contract import PassPlan
from pie.enginekit.catalogue import check_heads
from pie.kernels import attention_options, epilogue_launcher, rotary_tables
from pie.runtime.pass_plan import check_page_table_values, check_slot_values
from pie.weights import StoredWeight

F32 = np.float32


def embedding(ids: np.ndarray, table: np.ndarray) -> np.ndarray:
    if isinstance(table, StoredWeight):
        return table.rows(np.asarray(ids, dtype=np.int64)).dequantize()
    return table[ids]


def make_rms_norm(eps: float) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    eps32 = F32(eps)

    def rms_norm(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        mean_square = np.einsum("td,td->t", x, x)[:, None] / F32(x.shape[-1])
        return x * (weight / np.sqrt(mean_square + eps32))

    return rms_norm


def make_rms_norm_heads(eps: float, head_dim: int) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    """rms_norm over each head's values: the same kernel on the rows of ``[tokens * heads, head_dim]``."""
    rms_norm = make_rms_norm(eps)

    def rms_norm_heads(x: np.ndarray, weight: np.ndarray) -> np.ndarray:
        rows = x.shape[0] * check_heads("rms_norm_heads", x, head_dim)
        return rms_norm(x.reshape(rows, head_dim), weight).reshape(x.shape)

    return rms_norm_heads


STORED_TILE_BYTES = 1 << 19
"""Float32 bytes of a stored weight's rows that :func:`project` dequantizes at a time: about half an L2, so the
tile is still in cache while the GEMM reads it for every token (a whole float32 copy per call was tens of MB of
fresh pages a prefill pass, written once and read once)."""


def project(x: np.ndarray, weight: np.ndarray | StoredWeight) -> np.ndarray:
    """``x @ weight.T``, computed as ``(weight @ x.T).T``, the operand order OpenBLAS's AVX-512 kernels run
    faster (``docs/perf-notes.md``). The result is a column-major view; every kernel here takes any strides.
    A stored weight is dequantized a tile of rows at a time into one scratch buffer."""
    if not isinstance(weight, StoredWeight):
        return (weight @ x.T).T
    from pie_engine_cpu import native

    rows, cols = weight.shape
    step = max(16, STORED_TILE_BYTES // (4 * cols))
    tile = np.empty((min(step, rows), cols), dtype=F32)
    out = np.empty((rows, x.shape[0]), dtype=F32)
    xt = np.asarray(x, dtype=F32).T
    for first in range(0, rows, step):
        stop = min(rows, first + step)
        part = native.dequantized(weight, first, stop, tile[: stop - first])
        np.matmul(part, xt, out=out[first:stop])
    return out.T


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


def make_slice_columns(start: int, stop: int) -> Callable[[np.ndarray], np.ndarray]:
    def slice_columns(x: np.ndarray) -> np.ndarray:
        return x[:, start:stop]

    return slice_columns


def silu_mul(gate_up: np.ndarray) -> np.ndarray:
    half = gate_up.shape[-1] // 2
    gate = gate_up[:, :half]
    with np.errstate(over="ignore"):  # exp(-g) is inf below g = -88: g / inf is the -0 SiLU gives there
        return gate / (F32(1) + np.exp(-gate)) * gate_up[:, half:]


class RopeTables(NamedTuple):
    """cos and signed sin of one forward pass's positions, in both layouts a projection can have:
    token-major ``[T, 1, d]`` for row-major x, feature-major ``[1, d, T]`` for x left column-major
    by :func:`project`, so neither layout is copied into the other."""

    cos_by_token: np.ndarray
    sin_by_token: np.ndarray
    cos_by_feature: np.ndarray
    sin_by_feature: np.ndarray

    @classmethod
    def build(cls, positions: np.ndarray, inv_freq: np.ndarray) -> RopeTables:
        cos, signed_sin = rotary_tables(positions, inv_freq, F32)  # [T, d]
        return cls(cos[:, None], signed_sin[:, None], cos.T[None].copy(), signed_sin.T[None].copy())


class PassFacts:
    """The pass now running on the CPU engine (``pie_begin_pass`` to ``pie_end_pass``): its plan, and what
    every layer's launches make of it, made at the first launch that needs it. Launches of a pass take the
    pass's batch arrays (the ``pie_begin_pass`` contract), so they read these instead of their arguments."""

    def __init__(self, plan: PassPlan) -> None:
        self.plan = plan
        self.rope: list[tuple[np.ndarray, RopeTables]] = []
        """Each table of inverse frequencies the pass's layers rotate with (alternating sliding-window and
        global layers may have two), with its rotary tables of the plan's positions."""

    def rope_tables(self, inv_freq: np.ndarray) -> RopeTables:
        for frequencies, tables in self.rope:
            if frequencies is inv_freq:
                return tables
        tables = RopeTables.build(self.plan.positions, inv_freq)
        self.rope.append((inv_freq, tables))
        return tables

    @functools.cached_property
    def index_arrays(self) -> tuple[np.ndarray, ...]:
        """The plan's positions, slots, ``qo_indptr``, ``kv_page_indices``, ``kv_page_indptr`` and
        ``kv_last_page_lens`` as C-contiguous int32, in that order: the native decode pass's, the last four
        attention's."""
        plan = self.plan
        arrays = (plan.positions, plan.slots, plan.qo_indptr, plan.kv_page_indices, plan.kv_page_indptr,
                  plan.kv_last_page_lens)
        return tuple(np.ascontiguousarray(array, dtype=np.int32) for array in arrays)

    @functools.cached_property
    def index_addresses(self) -> tuple[int, ...]:
        """The addresses of :attr:`index_arrays`, which this object holds for the pass."""
        return tuple(array.ctypes.data for array in self.index_arrays)


_passes = threading.local()
"""Each thread's running pass: a process may run two runners' passes at once on two threads (a replicated group's
leader and follower in one process), and each launch must read its own pass's arrays."""


def running_pass() -> PassFacts | None:
    """The pass this thread runs (:func:`begin_pass`); None between passes, where launchers work from their
    arguments."""
    return getattr(_passes, "facts", None)


def begin_pass(plan: PassPlan) -> None:
    _passes.facts = PassFacts(plan)


def end_pass() -> None:
    _passes.facts = None


def rope_tables(positions: np.ndarray, inv_freq: np.ndarray) -> RopeTables:
    """The rotary tables of a RoPE launch: the running pass's, else made from the launch's own positions."""
    current = running_pass()
    return RopeTables.build(positions, inv_freq) if current is None else current.rope_tables(inv_freq)


def make_rope(head_dim: int) -> Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]:
    half = head_dim // 2

    def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
        tables = rope_tables(positions, inv_freq)
        tokens = x.shape[0]
        # rotate_half(x) = (-x2, x1): swap the halves, the sign lives in the signed sin.
        if x.flags.f_contiguous and not x.flags.c_contiguous:
            heads = x.T.reshape(-1, head_dim, tokens)  # [H, d, T]
            out = np.concatenate((heads[:, half:], heads[:, :half]), axis=1)
            out *= tables.sin_by_feature
            out += heads * tables.cos_by_feature
            return out.reshape(-1, tokens).T
        heads = x.reshape(tokens, -1, head_dim)  # [T, H, d]
        out = np.concatenate((heads[..., half:], heads[..., :half]), axis=-1)
        out *= tables.sin_by_token
        out += heads * tables.cos_by_token
        return out.reshape(tokens, -1)

    return rope


def make_append_kv(layer: int) -> Callable[..., None]:
    """Writes keys and values into their slots; numpy's assignment rounds them to nearest even in a
    float16 or bfloat16 pool."""

    def append_kv(pool: np.ndarray, k: np.ndarray, v: np.ndarray, slots: np.ndarray) -> None:
        page_size, kv_heads, head_dim = pool.shape[3:]
        check_slot_values("append_kv", slots, page_size, pool.shape[1])  # a negative slot would wrap around
        pages, offsets = np.divmod(slots, page_size)
        layer_pool = pool[layer]
        layer_pool[pages, 0, offsets] = k.reshape(-1, kv_heads, head_dim)
        layer_pool[pages, 1, offsets] = v.reshape(-1, kv_heads, head_dim)

    return append_kv


def make_attention(
    layer: int, num_heads: int, scale: float, window: int = 0, softcap: float = 0.0
) -> Callable[..., np.ndarray]:
    scale32 = F32(scale)
    window, softcap = attention_options(window, softcap)

    def attention(
        q: np.ndarray,
        pool: np.ndarray,
        qo_indptr: np.ndarray,
        kv_page_indices: np.ndarray,
        kv_page_indptr: np.ndarray,
        kv_last_page_lens: np.ndarray,
    ) -> np.ndarray:
        layer_pool = pool[layer]
        page_size, kv_heads, head_dim = pool.shape[3:]
        current = running_pass()
        if current is None:  # a launch's own tables are checked (negative pages would wrap) and give its lengths
            q_lens, kv_lens = check_page_table_values(
                "attention", qo_indptr, kv_page_indices, kv_page_indptr, kv_last_page_lens, page_size,
                rows=q.shape[0], num_pages=pool.shape[1],
            )
        else:  # a pass's are the runtime's, and its plan has their lengths
            q_lens, kv_lens = current.plan.q_lens, current.plan.kv_lens
        if len(q_lens) == q.shape[0] > 1 and int(q_lens.max()) == 1:  # one new token per sequence
            return _decode_batch(q, layer_pool, kv_page_indices, kv_page_indptr, kv_lens, num_heads, scale32, window, softcap)
        group = num_heads // kv_heads
        out = np.empty((q.shape[0], num_heads * head_dim), dtype=F32)
        for b, (q_len, kv_len) in enumerate(zip(q_lens.tolist(), kv_lens.tolist(), strict=True)):
            if q_len == 0:
                continue
            start, stop = int(qo_indptr[b]), int(qo_indptr[b]) + q_len
            pages = kv_page_indices[kv_page_indptr[b] : kv_page_indptr[b + 1]]
            keys = _widened(layer_pool[pages, 0]).reshape(-1, kv_heads, head_dim)[:kv_len].transpose(1, 2, 0)  # [Hkv, d, L]
            values = _widened(layer_pool[pages, 1]).reshape(-1, kv_heads, head_dim)[:kv_len].transpose(1, 0, 2)  # [Hkv, L, d]
            queries = q[start:stop].reshape(q_len, kv_heads, group, head_dim).transpose(1, 2, 0, 3) * scale32
            for first in range(0, q_len, QUERY_BLOCK):
                last = min(first + QUERY_BLOCK, q_len)
                block = queries[:, :, first:last]
                out[start + first : start + last] = _causal_block(
                    block, keys, values, kv_len - q_len + first, window, softcap
                )
        return out

    return attention


QUERY_BLOCK = 128
"""Queries per block of a prefill's attention: the block's scores stay small enough for the caches."""


def _causal_block(
    queries: np.ndarray, keys: np.ndarray, values: np.ndarray, position: int, window: int, softcap: float
) -> np.ndarray:
    """Attention of query rows at absolute positions ``position, position + 1, ...`` (``[Hkv, group, n, d]``,
    already scaled) over keys ``[Hkv, d, L]`` and values ``[Hkv, L, d]``: each row sees the keys up to its
    own position (and, with a window, after its position less the window), so keys past the block's last
    row, or before its first row's window, are never read."""
    rows = queries.shape[2]
    visible = position + rows
    first = max(0, position + 1 - window) if window else 0
    scores = queries @ keys[:, None, :, first:visible]  # [Hkv, group, n, visible - first]
    if softcap:
        _softcap_in_place(scores, softcap)
    if rows > 1:
        # Row i sees keys <= position + i: only the last ``rows`` keys hold a triangle to mask.
        scores[..., scores.shape[-1] - rows :][..., np.triu(np.ones((rows, rows), dtype=bool), 1)] = -np.inf
    if window and position + rows - window > first:
        # Row i sees keys > position + i - window: the keys before the last row's window hold the other triangle.
        before = np.arange(first, visible)[None, :] <= (position + np.arange(rows))[:, None] - window
        scores[..., before] = -np.inf
    _softmax_in_place(scores)
    context = scores @ values[:, None, first:visible]  # [Hkv, group, n, d]
    return context.transpose(2, 0, 1, 3).reshape(rows, -1)


def _softcap_in_place(scores: np.ndarray, softcap: float) -> None:
    """scores = softcap * tanh(scores / softcap), in float32."""
    scores *= F32(1.0 / softcap)
    np.tanh(scores, out=scores)
    scores *= F32(softcap)


def _widened(pages: np.ndarray) -> np.ndarray:
    """Gathered pages as float32 (a float16 or bfloat16 pool's widened), so attention accumulates in float32."""
    return pages if pages.dtype == F32 else pages.astype(F32)


def _softmax_in_place(scores: np.ndarray) -> None:
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)


def _decode_batch(
    q: np.ndarray,
    layer_pool: np.ndarray,
    kv_page_indices: np.ndarray,
    kv_page_indptr: np.ndarray,
    kv_lens: np.ndarray,
    num_heads: int,
    scale: np.float32,
    window: int,
    softcap: float,
) -> np.ndarray:
    """One new token per sequence: pad every page table to the longest and attend in one batched matmul."""
    _, _, page_size, kv_heads, head_dim = layer_pool.shape
    batch = q.shape[0]
    group = num_heads // kv_heads
    counts = np.diff(kv_page_indptr)
    max_pages = int(counts.max())
    table = np.zeros((batch, max_pages), dtype=np.intp)
    used = np.arange(max_pages)[None, :] < counts[:, None]
    table[used] = kv_page_indices[: int(kv_page_indptr[-1])]
    length = max_pages * page_size
    # One gather each for K and V, already contiguous: the matmuls read them through transposed views.
    keys = _widened(layer_pool[table, 0]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 3, 1)  # [B, Hkv, d, L]
    values = _widened(layer_pool[table, 1]).reshape(batch, length, kv_heads, head_dim).transpose(0, 2, 1, 3)  # [B, Hkv, L, d]
    queries = q.reshape(batch, kv_heads, group, head_dim) * scale
    scores = queries @ keys  # [B, Hkv, group, L]
    if softcap:
        _softcap_in_place(scores, softcap)
    if int(kv_lens.min()) < length or (window and int(kv_lens.max()) > window):
        keys_at = np.arange(length)[None, :]
        invalid = keys_at >= kv_lens[:, None]
        if window:
            invalid |= keys_at < kv_lens[:, None] - window
        scores += np.where(invalid, F32(-np.inf), F32(0))[:, None, None, :]
    _softmax_in_place(scores)
    return (scores @ values).reshape(batch, num_heads * head_dim)


def make_top_k(k: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Each row's ``k`` largest logits, largest first, lower index first on ties.

    Partitioned, not sorted: only the candidates at or above the k-th value are ordered (a stable sort
    keeps ties in index order), since a full sort of a vocabulary row costs milliseconds.
    """

    def top_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        count = min(k, x.shape[-1])
        indices = np.empty((x.shape[0], count), np.int32)
        for row, logits in enumerate(x):
            negated = -logits
            kth = np.partition(negated, count - 1)[count - 1]  # NaN sorts last here: kth is NaN only
            # when fewer than ``count`` values are not NaN
            candidates = np.flatnonzero(negated <= kth) if kth == kth else np.arange(negated.size)
            order = candidates[np.argsort(negated[candidates], kind="stable")]
            indices[row] = order[:count]
        return np.take_along_axis(x, indices, axis=-1), indices

    return top_k


def make_softmax(temperature: float) -> Callable[[np.ndarray], np.ndarray]:
    inverse = F32(1.0 / temperature)

    def softmax(x: np.ndarray) -> np.ndarray:
        z = x * inverse
        _softmax_in_place(z)
        return z

    return softmax


def make_epilogue(source: str, params: tuple[tuple[str, float], ...], variant: str = "numpy") -> Callable[..., np.ndarray]:
    """An eta epilogue run by its numpy rendering, or (``opencl``) fused into one OpenCL kernel on PoCL (the
    `opencl` extra)."""
    from pie import eta

    program = eta.compile(source)
    if variant == "opencl":
        from pie_engine_cpu.opencl import OpenCLEpilogues

        run = functools.partial(OpenCLEpilogues().run, program)
    else:
        run = program.numpy_fn()
    return epilogue_launcher(program, params, run)


def gemv_rows(x: np.ndarray, weight: np.ndarray | StoredWeight) -> np.ndarray:
    """``x @ weight.T`` as one GEMV per token row: for a handful of rows it skips GEMM's packing and
    threading cost; `pie tune` measures where that stops paying off. A stored weight is dequantized whole."""
    if isinstance(weight, StoredWeight):
        from pie_engine_cpu import native

        weight = native.dequantized(weight)
    y = np.empty((x.shape[0], weight.shape[0]), dtype=F32)
    for row in range(x.shape[0]):
        np.dot(weight, x[row], out=y[row])
    return y


Product = Callable[[np.ndarray, Any], np.ndarray]


class Projections(NamedTuple):
    """The projection kernels (plain and fused) over one product ``x @ weight.T``."""

    linear: Callable[..., np.ndarray]
    linear_add: Callable[..., np.ndarray]
    make_rms_norm_linear: Callable[[float], Callable[..., np.ndarray]]
    make_rms_norm_gate_up_silu: Callable[[float], Callable[..., np.ndarray]]


def projections(product: Product) -> Projections:
    def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        y = product(x, weight)
        if bias is not None:
            y += bias
        return y

    def linear_add(x: np.ndarray, weight: np.ndarray, residual: np.ndarray) -> np.ndarray:
        y = product(x, weight)
        y += residual
        return y

    def make_rms_norm_linear(eps: float) -> Callable[..., np.ndarray]:
        rms_norm = make_rms_norm(eps)

        def rms_norm_linear(
            x: np.ndarray, norm_weight: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None
        ) -> np.ndarray:
            return linear(rms_norm(x, norm_weight), weight, bias)

        return rms_norm_linear

    def make_rms_norm_gate_up_silu(eps: float) -> Callable[..., np.ndarray]:
        rms_norm = make_rms_norm(eps)

        def rms_norm_gate_up_silu(x: np.ndarray, norm_weight: np.ndarray, gate_up: np.ndarray) -> np.ndarray:
            return silu_mul(product(rms_norm(x, norm_weight), gate_up))

        return rms_norm_gate_up_silu

    return Projections(linear, linear_add, make_rms_norm_linear, make_rms_norm_gate_up_silu)


BLAS = projections(project)
"""The projections through BLAS (:func:`project`): the ``blas``/``numpy`` variants, and what the native ones
hand rows past ``NativeKernels.max_rows`` to."""
ROWS = projections(gemv_rows)
"""The ``rows`` variants: one GEMV per token row."""
linear, linear_add, make_rms_norm_linear, make_rms_norm_gate_up_silu = BLAS
