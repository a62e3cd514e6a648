"""Weights as their file stores them: the type a weight travels in from the loaders to the engines.

A weight is either a C-contiguous float32 ``numpy`` array (type ``f32``, what every engine takes) or a
:class:`StoredWeight`: its type, its logical shape and its bytes as stored (``[rows, row_bytes]`` uint8,
a view of the file's memory map where the loader can). Engines name the types each kernel reads as
stored (``pie_weight_types``); :func:`choose_weight_types` gives every weight of a plan the type it will
be uploaded in, and :func:`convert` makes it. ``docs/weight-types.md`` describes the whole path.

Layouts and reference dequantization are the ``gguf`` library's (``gguf.quants``); blocks run along a
row, so a row of a block-quantized matrix is ``cols / block`` whole blocks and rows can be stacked,
permuted and sliced as byte rows.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

F32 = "f32"
WEIGHT_TYPES: dict[str, tuple[str, int, int]] = {
    # name: (GGML type name, elements a block, bytes a block)
    "f32": ("F32", 1, 4),
    "f16": ("F16", 1, 2),
    "bf16": ("BF16", 1, 2),
    "q8_0": ("Q8_0", 32, 34),
    "q4_0": ("Q4_0", 32, 18),
    "q4_1": ("Q4_1", 32, 20),
    "q5_0": ("Q5_0", 32, 22),
    "q4_k": ("Q4_K", 256, 144),
    "q5_k": ("Q5_K", 256, 176),
    "q6_k": ("Q6_K", 256, 210),
}
"""The weight types pie carries, by pie's name: their GGML name and block layout (``gguf.GGML_QUANT_SIZES``).
The K-quants' blocks are super-blocks of 256; llama.cpp writes Q5_0 where a Q4_K_M file's rows are not
whole super-blocks."""

QUANTIZABLE = frozenset({"f32", "f16", "bf16", "q8_0", "q5_0", "q4_1", "q4_0"})
"""The types :func:`quantize` writes (the ``gguf`` library cannot quantize K-quants)."""

FLOAT_TYPES = frozenset({"f32", "f16", "bf16"})
"""The float types, which ``--dtype`` converts into each other."""

Dtype = Literal["auto", "float32", "float16", "bfloat16"]
"""``--dtype``'s values: ``auto`` keeps the types the model's files store, the others load every matrix in
that float type."""

DTYPES: dict[str, str | None] = {"auto": None, "float32": "f32", "float16": "f16", "bfloat16": "bf16"}
"""The type each of ``--dtype``'s values loads a model's matrices in (``auto``: as its files store them)."""

_F16_MAX = float(np.finfo(np.float16).max)


def type_of_ggml(ggml_name: str) -> str | None:
    """Pie's name of a GGML type name (``Q4_1`` -> ``q4_1``), None where pie does not carry it."""
    name = ggml_name.lower()
    return name if name in WEIGHT_TYPES else None


def row_bytes(weight_type: str, cols: int) -> int:
    """Bytes of one row of ``cols`` elements; raises ValueError when ``cols`` is not whole blocks."""
    _, block, size = WEIGHT_TYPES[weight_type]
    if cols % block:
        raise ValueError(f"a {weight_type} row holds whole blocks of {block}; {cols} columns do not")
    return cols // block * size


@dataclass(frozen=True, eq=False)
class StoredWeight:
    """A weight matrix in a type other than float32, as stored: ``data`` is uint8 ``[rows, row_bytes]``.

    ``data`` may be a read-only view of a file's memory map; an engine copies what it keeps.
    """

    type: str
    shape: tuple[int, int]
    data: np.ndarray

    def __post_init__(self) -> None:
        if self.type not in WEIGHT_TYPES or self.type == F32:
            raise ValueError(f"a stored weight's type is one of {', '.join(t for t in WEIGHT_TYPES if t != F32)}, "
                             f"not {self.type!r}")
        rows, cols = self.shape
        want = (rows, row_bytes(self.type, cols))
        if self.data.dtype != np.uint8 or self.data.shape != want:
            raise ValueError(f"{self.type} weight {list(self.shape)}: data must be uint8 {list(want)}, "
                             f"not {self.data.dtype} {list(self.data.shape)}")

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def dequantize(self) -> np.ndarray:
        """A new C-contiguous float32 array of ``shape``: the ``gguf`` library's reference dequantization."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype = GGMLQuantizationType[WEIGHT_TYPES[self.type][0]]
        return np.ascontiguousarray(dequantize(self.data, qtype).reshape(self.shape), dtype=np.float32)

    def rows(self, index: Any) -> StoredWeight:
        """Rows picked by a numpy index (a slice, a permutation): blocks never cross rows."""
        data = self.data[index]
        return StoredWeight(self.type, (data.shape[0], self.shape[1]), np.ascontiguousarray(data))

    def __repr__(self) -> str:
        return f"StoredWeight({self.type}, {list(self.shape)}, {self.nbytes} bytes)"


Weight = np.ndarray | StoredWeight
"""What a loader yields and an engine may receive: a float32 array or a weight in its stored type."""


def weight_type(weight: Any) -> str:
    """The type of a weight: a StoredWeight's own, ``f32`` for an array (which :func:`convert` casts)."""
    return weight.type if isinstance(weight, StoredWeight) else F32


def quantize(array: np.ndarray, target: str) -> Weight:
    """A float matrix in ``target`` (``gguf.quants.quantize``; f32 is a float32 copy)."""
    array = np.asarray(array, dtype=np.float32)
    if target == F32:
        return np.array(array, order="C", copy=True)
    if target not in QUANTIZABLE:
        raise ValueError(f"weights cannot be converted to {target!r} (the gguf library does not write it); "
                         f"targets: {', '.join(sorted(QUANTIZABLE))}")
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    data = gguf_quantize(array, GGMLQuantizationType[WEIGHT_TYPES[target][0]])
    return StoredWeight(target, (array.shape[0], array.shape[1]), np.ascontiguousarray(data).view(np.uint8))


def convert(weight: Any, target: str) -> Weight:
    """``weight`` in type ``target``: as it is when it already is, else through float32."""
    if isinstance(weight, StoredWeight):
        if weight.type == target:
            return weight
        dense = weight.dequantize()
        return dense if target == F32 else quantize(dense, target)
    array = np.asarray(weight)
    if target == F32:
        return np.ascontiguousarray(array, dtype=np.float32)
    return quantize(array, target)


def dtype_target(dtype: str) -> str | None:
    """The weight type ``--dtype`` names (None for ``auto``); ValueError for any other value."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def dtype_refusal(stored: str, target: str) -> str | None:
    """Why a matrix stored as ``stored`` is not loaded as ``target`` on request, None where it is.

    Float types convert into each other (rounded where ``target`` is narrower: what was asked for), and a
    block type to f32 (its exact dequantization). A block type to a 16-bit float is refused: the dequantized
    values (a scale times a small integer) are rounded a second time, and the weight grows on top of it.
    """
    if stored == target or stored in FLOAT_TYPES or target == F32:
        return None
    return (f"it is stored as {stored}, and {target} would round its dequantized values a second time "
            f"(dtype float32 dequantizes it exactly; auto keeps it as stored)")


def to_dtype(weight: Any, target: str) -> Weight:
    """A matrix in the float type ``target`` (``--dtype``): :func:`convert`, after checking that
    :func:`dtype_refusal` allows it and that an f16 target holds every value (else ValueError)."""
    stored = weight_type(weight)
    refusal = dtype_refusal(stored, target)
    if refusal is not None:
        raise ValueError(refusal)
    if stored == target:
        return weight
    dense = weight.dequantize() if isinstance(weight, StoredWeight) else np.asarray(weight, dtype=np.float32)
    if target == "f16":
        largest = float(np.max(np.abs(dense), initial=0.0, where=np.isfinite(dense)))
        if largest > _F16_MAX:
            raise ValueError(f"it holds {largest:g}, beyond float16's range (±{_F16_MAX:g}); "
                             "dtype bfloat16 or float32 holds it")
    return convert(dense, target)


EXACT_IN_Q8_0 = frozenset({"q8_0", "q5_0", "q4_0"})
"""Block types whose every value Q8_0 holds exactly: a block's value is its float16 scale times a small integer
(q - 16 for Q5_0, q - 8 for Q4_0), which Q8_0 stores as the same scale and that integer."""


def stack_rows(weights: Sequence[Any]) -> Weight:
    """Weights of equal columns stacked row-wise (Q, K, V into QKV): byte rows where all share a stored
    type; Q8_0 where they mix types it holds exactly (a Q4_K_M file's Q5_0 Q and K beside a Q8_0 V, where
    its rows are not whole super-blocks); else float32."""
    types = {weight_type(w) for w in weights}
    if len(types) == 1 and F32 not in types:
        first = weights[0]
        data = np.concatenate([w.data for w in weights], axis=0)
        return StoredWeight(first.type, (data.shape[0], first.shape[1]), data)
    if types <= EXACT_IN_Q8_0:
        data = np.concatenate([as_q8_0(w).data for w in weights], axis=0)
        return StoredWeight("q8_0", (data.shape[0], weights[0].shape[1]), data)
    return np.concatenate([convert(w, F32) for w in weights], axis=0)


def as_q8_0(weight: StoredWeight) -> StoredWeight:
    """A Q8_0, Q5_0 or Q4_0 weight as Q8_0, value for value (see ``EXACT_IN_Q8_0``)."""
    if weight.type == "q8_0":
        return weight
    if weight.type not in EXACT_IN_Q8_0:
        raise ValueError(f"a {weight.type} weight is not held exactly by q8_0")
    rows, cols = weight.shape
    blocks = weight.data.reshape(rows * (cols // 32), -1)
    nibbles = blocks[:, -16:]
    quants = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).astype(np.int16)  # elements 0-15, then 16-31
    if weight.type == "q5_0":
        high_bits = blocks[:, 2:6].copy().view("<u4")  # bit i: the fifth bit of element i
        quants |= ((high_bits >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int16) << 4
        quants -= 16
    else:
        quants -= 8
    out = np.empty((len(blocks), 34), dtype=np.uint8)
    out[:, :2] = blocks[:, :2]  # the float16 scale, unchanged
    out[:, 2:] = quants.astype(np.int8).view(np.uint8)
    return StoredWeight("q8_0", weight.shape, out.reshape(rows, -1))


def upload_type(stored: str, taken: Iterable[str]) -> str:
    """The type a weight stored as ``stored`` is uploaded in, given the types every kernel reading it takes:
    ``stored`` itself when taken, else f32, the one type every other converts to exactly (another block
    type would quantize the weight a second time, and its error with it)."""
    return stored if stored in set(taken) else F32


@dataclass(frozen=True)
class WeightChoice:
    """What becomes of one weight: stored in ``stored``, uploaded in ``uploaded``; ``readers`` are the kernels
    (and ``cpu fallback`` for a kernel run on the CPU engine) that read it."""

    name: str
    stored: str
    uploaded: str
    readers: tuple[str, ...]

    @property
    def converted(self) -> bool:
        return self.stored != self.uploaded


def readers_of(steps: Iterable[Any]) -> dict[str, set[str]]:
    """For each weight (``w.*``) a plan's steps read, the catalogue kernels that read it.

    A step of a whole region counts the region's own ops that read the weight (its launcher takes what those
    kernels take: see ``pie_weight_types``); a step run on the CPU fallback reads float32 only.
    """
    readers: dict[str, set[str]] = {}
    for step in steps:
        ops = getattr(step.request, "ops", None)
        pairs: list[tuple[str, str]] = []
        if ops is not None:
            pairs = [(name, op.kernel) for op in ops for name in op.inputs if name and name.startswith("w.")]
        else:
            kernel = "cpu fallback" if step.fallback else step.kernel
            pairs = [(name, kernel) for name in step.inputs if name and name.startswith("w.")]
        for name, kernel in pairs:
            readers.setdefault(name, set()).add(kernel)
    return readers


def choose_weight_types(
    readers: Mapping[str, Iterable[str]], stored: Mapping[str, str], declared: Mapping[str, Sequence[str]]
) -> dict[str, WeightChoice]:
    """The type each weight is uploaded in: its stored type where every kernel reading it takes that type
    (``declared``: kernel -> types, what the engine's ``pie_weight_types`` answered), else :func:`upload_type`.
    Vectors (norms, biases) and weights no kernel reads go as float32."""
    choices = {}
    for name, stored_type in stored.items():
        kernels = tuple(sorted(readers.get(name, ())))
        taken: set[str] | None = None
        for kernel in kernels:
            types = set(declared.get(kernel, ())) | {F32}
            taken = types if taken is None else taken & types
        uploaded = upload_type(stored_type, taken or ())
        choices[name] = WeightChoice(name, stored_type, uploaded, kernels)
    return choices


def describe_choices(choices: Mapping[str, WeightChoice]) -> str:
    """``pie plan``'s weights section: how many weights go as stored per type, and each conversion,
    weights of the same conversion and readers listed together."""
    kept: dict[str, int] = {}
    converted: dict[tuple[str, str, tuple[str, ...]], list[str]] = {}
    for choice in choices.values():
        if choice.converted:
            converted.setdefault((choice.stored, choice.uploaded, choice.readers), []).append(choice.name)
        else:
            kept[choice.stored] = kept.get(choice.stored, 0) + 1
    as_stored = ", ".join(f"{count} {name}" for name, count in sorted(kept.items())) or "none"
    lines = [f"Weights: {len(choices)}; as stored: {as_stored}; converted at load: {sum(map(len, converted.values()))}"]
    for (stored, uploaded, readers), names in sorted(converted.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  {stored} -> {uploaded}: {shown} (read by {', '.join(readers) or 'no kernel'})")
    return "\n".join(lines)


def describe_dtype_conversions(dtype: str, conversions: Mapping[str, tuple[str, str]]) -> str:
    """``pie plan``'s line for ``--dtype``: the matrices it converted while loading, by conversion (the weights
    section after it then starts from the types loaded)."""
    by_pair: dict[tuple[str, str], list[str]] = {}
    for name, pair in conversions.items():
        by_pair.setdefault(pair, []).append(name)
    if not by_pair:
        return f"--dtype {dtype}: every matrix is {DTYPES[dtype]} in the model's files already; nothing converted"
    lines = [f"--dtype {dtype}: {len(conversions)} matrices converted while loading"]
    for (stored, loaded), names in sorted(by_pair.items()):
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        lines.append(f"  {stored} -> {loaded}: {shown}")
    return "\n".join(lines)
