"""Value types and tensor shapes of the eta language."""

from __future__ import annotations

from enum import Enum


class DType(Enum):
    """A value type.

    f16 and bf16 values travel in f32 registers ("carriers") and are rounded to their
    precision after every operation that produces one, so every target computes the same
    bits as it would with native half types (for + - * / the single f32 rounding followed
    by the half rounding is exact, since f32 has more than twice the precision).
    """

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I32 = "i32"
    BOOL = "bool"

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16)

    @property
    def largest(self) -> float:
        """The largest finite value of a float type; a value past it rounds to it or to infinity."""
        return _LARGEST[self]

    def __str__(self) -> str:
        return self.value


_LARGEST = {DType.F32: 3.4028234663852886e38, DType.F16: 65504.0, DType.BF16: 3.3895313892515355e38}

# Buffers hold f32 or i32 elements; the narrower float types are reached with casts.
STORAGE_TYPES = (DType.F32, DType.I32)


class Shape(Enum):
    """How a buffer is indexed inside the `rows x cols` epilogue."""

    FULL = "rows,cols"  # one element per (row, col)
    COLS = "cols"  # one element per column, shared by all rows (a bias)
    ROWS = "rows"  # one element per row, shared by its columns

    def __str__(self) -> str:
        return self.value
