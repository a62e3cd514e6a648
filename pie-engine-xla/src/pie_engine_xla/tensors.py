"""Device tensors of the XLA engine: lazily placed, padded to shape buckets, sharded on a mesh.

An upload stays a host array until a launch needs it; the launch knows its role
(a weight, a batch index, an activation) and places it once: padded to the
bucket of its length, permuted and sharded the way the region wants. Launch
outputs stay padded between regions; ``rows`` remembers the real length and
:func:`download` cuts the padding off.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np
from pie.contract import PageLayout
from pie.poem.sharding import Split

if TYPE_CHECKING:
    from pie.weights import StoredWeight

SLOT_SENTINEL = np.iinfo(np.int32).max
"""Slot given to padding tokens: its page lies past any pool, so the KV write is dropped."""


class Pad(Enum):
    """How a launch argument's leading axis is padded to its bucket."""

    NONE = "none"  # weights: placed as they are
    ZEROS = "zeros"  # activations, token ids, positions, sample rows, page ids, last-page lengths
    SLOTS = "slots"  # KV slots: padding points past the pool
    INDPTR = "indptr"  # [n+1] offsets: padded by repeating the last one (empty sequences)


def bucket(length: int) -> int:
    """The power of two a length is padded to (at least 1)."""
    return 1 if length <= 1 else 1 << (length - 1).bit_length()


def pad_host(array: np.ndarray, pad: Pad) -> np.ndarray:
    """``array`` with its leading axis padded to its bucket (an indptr: its sequence count, its length less 1)."""
    length = array.shape[0] if array.ndim else 0
    target = bucket(max(length - 1, 1)) + 1 if pad is Pad.INDPTR else bucket(length)
    if pad is Pad.NONE or target == length:
        return array
    filler = {Pad.SLOTS: SLOT_SENTINEL, Pad.INDPTR: array[-1] if length else 0}.get(pad, 0)
    out = np.full((target, *array.shape[1:]), filler, dtype=array.dtype)
    out[:length] = array
    return out


ROLE_PAD = {"act": Pad.ZEROS, "index": Pad.ZEROS, "slots": Pad.SLOTS, "indptr": Pad.INDPTR}
"""How an argument of each batch role (:data:`pie.kernels.BATCH_ROLES`) is padded; the rest are not."""


@dataclass(frozen=True)
class Placement:
    """How an array lives on the mesh: its padding, and its split among the devices (:mod:`pie.poem.sharding`)."""

    pad: Pad
    split: Split


@dataclass(eq=False, slots=True)
class Tensor:
    """A device tensor: a host array not yet placed, or a (padded, sharded) jax.Array.

    A weight kept in a stored type (:mod:`pie_engine_xla.stored`) names it in ``weight_type``; a
    block-quantized one holds bytes, so ``columns`` gives its logical width.
    """

    host: np.ndarray | None = None
    array: Any = None
    rows: int | None = None
    """Real length of the leading axis when ``array`` is padded."""
    placement: Placement | None = None
    perm: np.ndarray | None = None
    weight_type: str = "f32"
    columns: int | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical shape (a block-quantized weight's elements, not its bytes)."""
        if self.columns is not None:
            return (self.real_rows(), self.columns)
        if self.host is not None:
            return tuple(self.host.shape)
        shape = tuple(self.array.shape)
        return shape if self.rows is None else (self.rows, *shape[1:])

    @property
    def dtype(self) -> np.dtype[Any]:
        """The element type of the host array or the jax.Array (a weight kept in a stored type: of its storage,
        16-bit values or block bytes; ``weight_type`` names the type)."""
        return self.host.dtype if self.host is not None else self.array.dtype

    @property
    def layout_key(self) -> tuple[tuple[int, ...], str]:
        """What a program's compiled form depends on: the logical shape and the weight type."""
        return (self.shape, self.weight_type)

    def real_rows(self) -> int:
        if self.host is not None:
            return int(self.host.shape[0])
        return int(self.rows if self.rows is not None else self.array.shape[0])

    def __repr__(self) -> str:
        where = "host" if self.host is not None else str(getattr(self.array, "sharding", "?"))
        kind = "" if self.weight_type == "f32" else f" {self.weight_type}"
        return f"<xla Tensor{kind} {self.shape} on {where}>"


@dataclass(eq=False, slots=True)
class PoolBuffer:
    """A KV page pool: a holder whose array is replaced by each donated (in-place) update."""

    array: Any
    layout: PageLayout
    sharding: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.layout.shape)

    @property
    def layout_key(self) -> tuple[tuple[int, ...], str]:
        """What a program's compiled form depends on: the shape and the element type."""
        return (tuple(self.layout.shape), self.layout.dtype)

    def __repr__(self) -> str:
        return f"<xla PoolBuffer {self.layout.shape}>"


def gathered(array: Any) -> np.ndarray:
    """A jax.Array's whole value on this host, also when the mesh spans processes.

    A replicated array is read from this process's own shard; any other array that
    lives partly on other processes is all-gathered, a collective every process runs
    (they do: each runs the same operations, see :mod:`pie.runtime.replicated`).
    """
    if array.is_fully_addressable:
        return np.asarray(array)
    if array.sharding.is_fully_replicated:
        return np.asarray(array.addressable_shards[0].data)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(array, tiled=True))


def to_host(tensor: Tensor) -> np.ndarray:
    """The contents of a tensor as a new host array (padding cut, permutation undone); a weight kept in a
    stored type comes back as stored (16-bit values, or block bytes)."""
    if tensor.host is not None:
        return np.array(tensor.host, copy=True)
    data = gathered(tensor.array)
    if tensor.perm is not None:
        data = data[np.argsort(tensor.perm)]
    if tensor.rows is not None:
        data = data[: tensor.rows]
    return np.array(data, copy=True)


def place(tensor: Tensor, placement: Placement, sharding: Any) -> Any:
    """Put ``tensor`` on the mesh as ``placement`` says (once), and return its array."""
    import jax

    host = tensor.host if tensor.host is not None else to_host(tensor)
    length = host.shape[0] if host.ndim else 0
    perm = placement.split.permutation(length) if host.ndim else None
    if perm is not None:
        host = host[perm]
    tensor.array = jax.device_put(pad_host(np.ascontiguousarray(host), placement.pad), sharding)
    tensor.host = None
    tensor.rows = length if placement.pad is not Pad.NONE else None
    tensor.placement = placement
    tensor.perm = perm
    return tensor.array


STORED_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q4_k", "q5_k", "q6_k")
"""The types the embedding and every projection read as stored (``pie_weight_types``)."""


def host_array(weight: StoredWeight) -> np.ndarray:
    """A stored weight as the host array its device tensor is placed from (a copy: ``data`` may view a file)."""
    if weight.type == "f16":
        return np.array(weight.data.view(np.float16), copy=True)
    if weight.type == "bf16":
        import ml_dtypes

        return np.array(weight.data.view(ml_dtypes.bfloat16), copy=True)
    return np.array(weight.data, copy=True)
