"""Typed access to a GGUF file's key-value metadata, with errors that name the file and key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from gguf import GGUFReader, GGUFValueType

from .errors import ModelLoadError

T = TypeVar("T")
_MISSING: Any = object()


class GGUFMetadata:
    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self.path = path

    def __contains__(self, key: str) -> bool:
        return key in self._reader.fields

    def get(self, key: str, kind: type[T], default: Any = _MISSING) -> T:
        """The value of `key` as `kind` (int, float, bool, str or list); `default` if absent."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.path}: missing metadata key {key!r}")
            return default
        try:
            value = field.contents()
        except Exception as exc:  # a damaged field can fail in many ways inside gguf
            raise ModelLoadError(f"{self.path}: metadata key {key!r} cannot be read: {exc}") from exc
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is float and field.types == [GGUFValueType.FLOAT32]:
            # The shortest decimal with this float32 value: 1e-05 rather than 9.999999747378752e-06,
            # which is what the converter was given (config.json) and the same float32.
            value = float(str(np.float32(value)))
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ModelLoadError(
                f"{self.path}: metadata key {key!r} should be {kind.__name__}, got {type(value).__name__}")
        return value

    def require_positive(self, key: str, default: Any = _MISSING) -> int:
        value = self.get(key, int, default)
        if value <= 0:
            raise ModelLoadError(f"{self.path}: metadata key {key!r} must be positive, got {value}")
        return value
