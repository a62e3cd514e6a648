"""The kernel sources (package data under ``csrc/``) assembled into compile units.

A unit is one program for NVRTC, hiprtc or the host C++ compiler: the backend's
compatibility header, the shared helpers and argument structs, the unit's ``.cu``
files, then the layout asserts of :mod:`pie_engine_cuda.args`. Three units keep
compiles few and each one small enough to rebuild quickly.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

from pie_engine_cuda.args import layout_asserts

COMPAT_HEADERS = {"cuda": "compat_cuda.cuh", "hip": "compat_hip.cuh", "emulator": "compat_host.cuh"}
UNITS: dict[str, tuple[str, ...]] = {
    "core": ("core.cu", "sampling.cu"),
    "gemm": ("gemm.cu",),
    "attention": ("attention.cu",),
}


def read_source(name: str) -> str:
    return (resources.files("pie_engine_cuda") / "csrc" / name).read_text(encoding="utf-8")


@cache
def unit_source(unit: str, backend: str) -> str:
    """The complete source of ``unit`` for ``backend``, with ``#line`` marks naming each file."""
    if backend not in COMPAT_HEADERS:
        raise ValueError(f"unknown backend {backend!r} (one of {', '.join(COMPAT_HEADERS)})")
    if unit not in UNITS:
        raise ValueError(f"unknown compile unit {unit!r} (one of {', '.join(UNITS)})")
    files = (COMPAT_HEADERS[backend], "common.cuh", "args.cuh", *UNITS[unit])
    parts = [f'#line 1 "{name}"\n{read_source(name)}' for name in files]
    parts.append(f'#line 1 "args.py"\n{layout_asserts()}')
    return "\n".join(parts)
