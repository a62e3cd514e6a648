"""The shared Slang kernels of the GPU engines (Vulkan through SPIR-V, WebGPU through WGSL).

``src/`` holds one Slang file per catalogue kernel (entry points in a file are its
variants, sharing one binding layout). ``python -m pie.enginekit.shaders.build`` compiles
every entry point to ``generated/<entry>.spv`` and ``generated/<entry>.wgsl`` and
writes ``generated/manifest.json`` (workgroup size, bindings, parameter block of
each entry point, read back from the generated WGSL). Those files ship as package
data, so engines need no shader compiler at run time.

Binding 0 of every shipped entry point is a uniform block of 4-byte scalars
(sizes, offsets, eps...); the others are storage buffers of float32 or int32, or of u32 words
holding a weight in its stored type (the ``__{type}`` entry points, see ``src/stored.slang``).
Entry points made at run time (eta epilogues: WGSL, or Slang for SPIR-V) carry their
source and may place the uniform block elsewhere.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Literal

SOURCE_DIR = Path(__file__).parent / "src"
GENERATED_DIR = Path(__file__).parent / "generated"
MANIFEST = "manifest.json"

BindingKind = Literal["uniform", "read", "read_write"]
_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


@dataclass(frozen=True)
class Entry:
    """One compiled entry point."""

    name: str
    source: str
    workgroup: tuple[int, int, int]
    bindings: tuple[tuple[int, BindingKind], ...]
    """(binding index, kind) of every binding the entry point uses, sorted."""
    params: tuple[tuple[str, str], ...]
    """(field name, WGSL scalar type) of the uniform block, in order."""
    code: str = field(default="", repr=False)
    """Source of an entry point made at run time, in the language its engine compiles (WGSL, Slang); empty for
    shipped ones."""
    _packer: struct.Struct = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        formats = "".join(_FORMATS[kind] for _, kind in self.params)
        padding = -len(self.params) % 4
        object.__setattr__(self, "_packer", struct.Struct("<" + formats + "x" * (4 * padding)))

    @property
    def storage_bindings(self) -> tuple[tuple[int, BindingKind], ...]:
        """Every binding but the uniform block, in order: what a dispatch binds tensors to."""
        return tuple(binding for binding in self.bindings if binding[1] != "uniform")

    @property
    def uniform_binding(self) -> int:
        return next(index for index, kind in self.bindings if kind == "uniform")

    @property
    def params_size(self) -> int:
        """Bytes of the uniform block (a multiple of 16, as std140 and WGSL round it)."""
        return self._packer.size

    def pack(self, values: Mapping[str, float]) -> bytes:
        """The uniform block for ``values`` (every field by name, nothing else)."""
        if len(values) != len(self.params):
            names = {name for name, _ in self.params}
            raise KeyError(f"{self.name}: parameters {sorted(values)} do not match {sorted(names)}")
        return self._packer.pack(*(values[name] for name, _ in self.params))

    def to_json(self) -> dict[str, object]:
        return {
            "source": self.source,
            "workgroup": list(self.workgroup),
            "bindings": [[index, kind] for index, kind in self.bindings],
            "params": [[name, kind] for name, kind in self.params],
        }

    @classmethod
    def from_json(cls, name: str, data: dict[str, Any]) -> Entry:
        x, y, z = data["workgroup"]
        return cls(
            name=name,
            source=str(data["source"]),
            workgroup=(int(x), int(y), int(z)),
            bindings=tuple((int(i), kind) for i, kind in data["bindings"]),
            params=tuple((str(n), str(k)) for n, k in data["params"]),
        )


@cache
def manifest() -> dict[str, Entry]:
    """Every shipped entry point by name."""
    data = json.loads((GENERATED_DIR / MANIFEST).read_text(encoding="utf-8"))
    return {name: Entry.from_json(name, entry) for name, entry in data["entries"].items()}


def compiler_version() -> str:
    """The Slang build that produced the shipped files."""
    return str(json.loads((GENERATED_DIR / MANIFEST).read_text(encoding="utf-8"))["compiler"])


@cache
def spirv(entry: str) -> bytes:
    return (GENERATED_DIR / f"{entry}.spv").read_bytes()


@cache
def wgsl(entry: str) -> str:
    return (GENERATED_DIR / f"{entry}.wgsl").read_text(encoding="utf-8")


def slang_source(entry: str) -> str:
    """The Slang file an entry point comes from."""
    return (SOURCE_DIR / manifest()[entry].source).read_text(encoding="utf-8")
