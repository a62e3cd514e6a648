"""Typed access to a GGUF file's key-value metadata, with errors that name the file and key."""

from __future__ import annotations

from typing import Any, TypeVar

import numpy as np
from gguf import GGUFValueType

from .errors import ModelLoadError
from .gguf_header import GGUFHeader, MetadataValue

T = TypeVar("T")
_MISSING: Any = object()


class GGUFMetadata:
    def __init__(self, header: GGUFHeader) -> None:
        self._fields = header.fields
        self.path = header.path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def count(self, key: str) -> int | None:
        """How many entries the array `key` holds (None if absent or not an array), without reading them."""
        field = self._fields.get(key)
        return len(field.value) if field is not None and field.type == GGUFValueType.ARRAY else None

    def error(self, key: str, problem: str) -> ModelLoadError:
        """The error naming the file and metadata ``key``: ``problem`` says what is wrong with its value."""
        return ModelLoadError(f"{self.path}: metadata key {key!r} {problem}")

    def get(self, key: str, kind: type[T], default: Any = _MISSING) -> T:
        """The value of `key` as `kind` (int, float, bool, str or list); `default` if absent."""
        field = self._fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
            return default
        value = self._python(key, field)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ModelLoadError(
                f"{self.path}: metadata key {key!r} should be {kind.__name__}, got {type(value).__name__}")
        return value

    def _python(self, key: str, field: MetadataValue) -> Any:
        if field.type == GGUFValueType.STRING:
            return self._decode(key, field.value)
        if field.type == GGUFValueType.ARRAY:
            if field.item_type == GGUFValueType.STRING:
                try:
                    return [raw.decode("utf-8") for raw in field.value]
                except UnicodeDecodeError:  # again, entry by entry, for the message naming the first bad one
                    return [self._decode(key, raw, index) for index, raw in enumerate(field.value)]
            return field.value.tolist()
        if field.type == GGUFValueType.FLOAT32:
            # The shortest decimal with this float32 value: 1e-05 rather than 9.999999747378752e-06,
            # which is what the converter was given (config.json) and the same float32.
            return float(str(np.float32(field.value)))
        return field.value

    def _decode(self, key: str, raw: bytes, index: int | None = None) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            entry = "" if index is None else f" entry {index}"
            raise ModelLoadError(f"{self.path}: metadata key {key!r}{entry} is not UTF-8 text: {exc.reason} "
                                 f"at byte {exc.start}") from None
