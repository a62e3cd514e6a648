"""Reading the header of a GGUF file: its metadata and its tensor index, every length checked.

gguf's own `GGUFReader` trusts the counts a file claims (an array that claims more entries than
the file holds loops on past its end) and keeps about a kilobyte of numpy objects per array
entry. This reader refuses any length that runs past the end of the file, keeps strings as bytes
until they are asked for, and numeric arrays and tensor data as views of the memory-mapped file,
so what it builds is bounded by the size of the file.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelLoadError
from .mapped_pages import check_unchanged, identity, release_pages

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ENTRIES = 1 << 16
"""At most this many metadata keys, and as many tensors: real files have tens of keys and a few
thousand tensors; more is a damaged count."""
_DEFAULT_ALIGNMENT = 32

_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: _U32, GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.UINT64: _U64, GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.FLOAT64: struct.Struct("<d"),
    GGUFValueType.BOOL: struct.Struct("<?"),
}
_DTYPES: dict[GGUFValueType, np.dtype] = {kind: np.dtype(layout.format) for kind, layout in _SCALARS.items()}


@dataclass(frozen=True)
class MetadataValue:
    """One metadata value as stored: a number or bool, `bytes` for a string, and for an array a
    list of `bytes` (strings) or a read-only numpy view of the file (numbers)."""

    type: GGUFValueType
    value: Any
    item_type: GGUFValueType | None = None  # for arrays


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: GGMLQuantizationType
    dims: tuple[int, ...]
    """GGUF order: the contiguous (innermost) dimension first."""
    offset: int
    """Where its data starts, in bytes from the start of the file."""
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy, Hugging Face) order."""
        return tuple(reversed(self.dims))


class GGUFHeader:
    """A GGUF file's metadata and tensor index; tensor data stays in the file until it is read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as file:
            size = file.seek(0, 2)
            if size < len(MAGIC) + _U32.size:
                raise self._error(f"the file is {size} bytes, too short for a GGUF header")
            self._buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
            self._identity = identity(os.fstat(file.fileno()))
        self.size = size
        self._offset = 0
        magic = self._take(len(MAGIC), "the magic number")
        if self._buffer[magic:magic + len(MAGIC)] != MAGIC:
            raise self._error(f"it starts with {self._buffer[:4]!r}, not {MAGIC!r}")
        self.version = self._scalar(_U32, "the version")
        if self.version not in VERSIONS:
            if int.from_bytes(self.version.to_bytes(4, "little"), "big") in VERSIONS:
                raise self._error("it is a big-endian GGUF file; Pie reads little-endian ones")
            raise self._error(f"version {self.version}; Pie reads GGUF versions {', '.join(map(str, VERSIONS))}")
        tensor_count = self._count("the tensor count")
        kv_count = self._count("the metadata key count")
        self.fields: dict[str, MetadataValue] = {}
        for _ in range(kv_count):
            key = self._text(self._string("a metadata key"), "a metadata key")
            if key in self.fields:
                raise self._error(f"metadata key {key!r} appears twice")
            self.fields[key] = self._value(key)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self._alignment()
        start = -(-self._offset // alignment) * alignment
        self.tensors: dict[str, TensorInfo] = {}
        end = 0  # of the tensors' data so far, from the data section's start
        for name, kind, dims, relative in infos:
            if name in self.tensors:
                raise ModelLoadError(f"{path}: tensor {name!r} appears twice")
            tensor = self.tensors[name] = self._tensor(name, kind, dims, start + relative)
            if relative != end:  # as llama.cpp refuses: misaligned, overlapping, or a count that lies
                raise ModelLoadError(f"{path}: tensor {name!r} cannot be read: its data offset {relative} is not "
                                     f"where the tensors before it end ({end}, aligned to {alignment} bytes)")
            end = -(-(relative + tensor.nbytes) // alignment) * alignment
        # A tensor count lower than the index holds leaves index entries where the data should start: every tensor
        # would be read from the wrong place. The padding before the data, and anything past it, is zeros.
        if self._nonzero(self._offset, start) or self._nonzero(start + end, len(self._buffer)):
            raise self._error(f"bytes before the tensors' data or after it are not padding: the tensor count "
                              f"({tensor_count}) does not match the tensors the file holds, or the file is damaged")

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """The tensor's bytes: a flat read-only uint8 view of the file, what `gguf.quants.dequantize` takes."""
        check_unchanged(self.path, self._identity)
        return np.frombuffer(self._buffer, np.uint8, tensor.nbytes, tensor.offset)

    def release(self, tensors: Iterable[TensorInfo]) -> None:
        """Drop the tensors' pages from this process's memory (see `release_pages`)."""
        for tensor in tensors:
            release_pages(self._buffer, tensor.offset, tensor.nbytes)

    def _nonzero(self, begin: int, end: int) -> bool:
        return begin < end and bool(np.frombuffer(self._buffer, np.uint8, end - begin, begin).any())

    def _error(self, problem: str) -> ModelLoadError:
        return ModelLoadError(f"{self.path}: not a readable GGUF file: {problem}")

    def _take(self, nbytes: int, what: str) -> int:
        """Claim the next `nbytes` of the header; returns where they start."""
        start = self._offset
        if nbytes > self.size - start:
            raise self._error(f"{what} runs past the end of the file (it needs {nbytes} bytes at offset {start}, "
                              f"the file has {self.size}; truncated?)")
        self._offset = start + nbytes
        return start

    def _scalar(self, layout: struct.Struct, what: str) -> Any:
        return layout.unpack_from(self._buffer, self._take(layout.size, what))[0]

    def _count(self, what: str) -> int:
        count: int = self._scalar(_U64, what)
        if count > MAX_ENTRIES:
            raise self._error(f"{what} is {count}; more than {MAX_ENTRIES} is not a real model")
        return count

    def _string(self, what: str) -> bytes:
        length = self._scalar(_U64, what)
        start = self._take(length, what)
        return self._buffer[start:start + length]

    def _strings(self, count: int, what: str) -> list[bytes]:
        """``count`` strings in a row, as :meth:`_string` reads one, in one loop with its lookups bound: a
        vocabulary and its merges are 10^5 strings, and a call per string was most of the header's time."""
        buffer, unpack, size = self._buffer, _U64.unpack_from, self.size
        strings: list[bytes] = []
        append, offset = strings.append, self._offset
        for _ in range(count):
            if size - offset < _U64.size:
                break
            (length,) = unpack(buffer, offset)
            if length > size - offset - _U64.size:
                break
            offset += _U64.size
            append(buffer[offset : offset + length])
            offset += length
        self._offset = offset
        if len(strings) < count:  # the entry that runs past the end: read it the slow way, for its message
            self._string(f"{what} entry {len(strings)}")
        return strings

    def _text(self, raw: bytes, what: str) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self._error(f"{what} at offset {self._offset - len(raw)} is not UTF-8: {exc.reason}") from None

    def _type(self, what: str) -> GGUFValueType:
        raw = self._scalar(_U32, what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise self._error(f"{what} has unknown value type {raw}") from None

    def _value(self, key: str) -> MetadataValue:
        what = f"metadata key {key!r}"
        kind = self._type(what)
        if kind == GGUFValueType.STRING:
            return MetadataValue(kind, self._string(what))
        if kind != GGUFValueType.ARRAY:
            return MetadataValue(kind, self._scalar(_SCALARS[kind], what))
        item_type = self._type(what)
        count = self._scalar(_U64, what)
        if item_type == GGUFValueType.STRING:
            if count * _U64.size > self.size - self._offset:
                raise self._error(f"{what} claims {count} strings, more than the rest of the file can hold "
                                  "(truncated?)")
            return MetadataValue(kind, self._strings(count, what), item_type)
        if item_type == GGUFValueType.ARRAY:
            raise self._error(f"{what} is an array of arrays, which GGUF models do not use")
        dtype = _DTYPES[item_type]
        start = self._take(count * dtype.itemsize, f"{what} ({count} entries)")
        return MetadataValue(kind, np.frombuffer(self._buffer, dtype, count, start), item_type)

    def _tensor_info(self) -> tuple[str, int, tuple[int, ...], int]:
        name = self._text(self._string("a tensor name"), "a tensor name")
        what = f"tensor {name!r}"
        n_dims = self._scalar(_U32, what)
        if not 1 <= n_dims <= MAX_DIMS:
            raise ModelLoadError(f"{self.path}: {what} has {n_dims} dimensions; GGUF allows 1 to {MAX_DIMS}")
        start = self._take(n_dims * _U64.size, what)
        dims = struct.unpack_from(f"<{n_dims}Q", self._buffer, start)
        kind = self._scalar(_U32, what)
        return name, kind, dims, self._scalar(_U64, what)

    def _alignment(self) -> int:
        field = self.fields.get("general.alignment")
        if field is None:
            return _DEFAULT_ALIGNMENT
        alignment = field.value
        if field.type != GGUFValueType.UINT32:
            raise self._error(f"metadata key 'general.alignment' should be uint32, got {field.type.name.lower()}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise self._error(f"metadata key 'general.alignment' is {alignment!r}, not a power of two")
        return int(alignment)

    def _tensor(self, name: str, raw_type: int, dims: tuple[int, ...], offset: int) -> TensorInfo:
        what = f"{self.path}: tensor {name!r} cannot be read"
        try:
            kind = GGMLQuantizationType(raw_type)
        except ValueError:
            raise ModelLoadError(f"{what}: unknown type id {raw_type}") from None
        block_size, type_size = GGML_QUANT_SIZES[kind]
        if 0 in dims:  # no data, so any other dimension fits in the file
            raise ModelLoadError(f"{what}: it has a dimension of 0 (dimensions {list(dims)})")
        if dims[0] % block_size:
            raise ModelLoadError(f"{what}: its rows of {dims[0]} are not whole {kind.name} blocks of {block_size}")
        nbytes = int(np.prod(dims, dtype=object)) // block_size * type_size
        if offset + nbytes > self.size:
            raise ModelLoadError(f"{what}: its data ends at byte {offset + nbytes} but the file has {self.size} "
                                 "(truncated?)")
        return TensorInfo(name, kind, tuple(int(d) for d in dims), offset, nbytes)
