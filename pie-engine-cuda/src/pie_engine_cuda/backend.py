"""Which GPU API serves the engine: CUDA, HIP (AMD), or one installed beside them.

``PIE_CUDA_BACKEND`` forces one: ``cuda``, ``hip``, or ``module:attribute`` naming a
:class:`Backend` object to import (the tests select their host emulator so, as
``emulator_api:EMULATOR``), which is then installed under its own name. Unset, HIP is
used when hip-python (the ``rocm`` extra) is installed and finds an AMD GPU, CUDA
otherwise; an installed backend is never chosen on its own.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pie.plugins import EngineSettingError

from pie_engine_cuda.api import DeviceFacts, GpuApi
from pie_engine_cuda.compiler import Compiler

BACKEND_ENV = "PIE_CUDA_BACKEND"


@dataclass(frozen=True)
class Backend:
    """A GPU API: how its devices are probed and opened, and the compiler of its kernels."""

    name: str
    probe: Callable[[], list[DeviceFacts]]
    open: Callable[[DeviceFacts], GpuApi]
    compiler: Callable[[], Compiler]


def _cuda() -> Backend:
    from pie_engine_cuda.compiler import Nvrtc
    from pie_engine_cuda.driver_api import CudaApi, probe_cuda

    return Backend("cuda", probe_cuda, CudaApi, Nvrtc)


def _hip() -> Backend:
    from pie_engine_cuda.compiler import Hiprtc
    from pie_engine_cuda.driver_api import HipApi, probe_hip

    return Backend("hip", probe_hip, HipApi, Hiprtc)


BUILT_IN: dict[str, Callable[[], Backend]] = {"cuda": _cuda, "hip": _hip}
"""The GPU backends, each imported when first used."""

INSTALLED: dict[str, Backend] = {}
"""Backends imported through ``PIE_CUDA_BACKEND=module:attribute``, by name (the tests' host emulator)."""


def backend(name: str) -> Backend:
    return INSTALLED[name] if name in INSTALLED else BUILT_IN[name]()


def requested_backend(env: Mapping[str, str] | None = None) -> str | None:
    value = (os.environ if env is None else env).get(BACKEND_ENV, "").strip()
    if not value:
        return None
    if ":" in value:
        module, _, attribute = value.partition(":")
        installed = getattr(importlib.import_module(module), attribute)
        INSTALLED[installed.name] = installed
        return installed.name
    value = value.lower()
    if value not in (*BUILT_IN, *INSTALLED):
        names = ", ".join(BUILT_IN)
        raise EngineSettingError(f"{BACKEND_ENV}={value!r} is not one of {names}, nor module:attribute of a backend")
    return value


def hip_python_installed() -> bool:
    return importlib.util.find_spec("hip") is not None


def probe(env: Mapping[str, str] | None = None) -> tuple[str, list[DeviceFacts]]:
    """(backend, devices); raises with a message naming what is missing when no backend can work."""
    forced = requested_backend(env)
    if forced is not None:
        return forced, backend(forced).probe()
    hip_problem = ""
    if hip_python_installed():
        try:
            devices = backend("hip").probe()
        except Exception as exc:  # noqa: BLE001 - fall back to CUDA, but keep the reason
            hip_problem = f"{type(exc).__name__}: {exc}"
        else:
            if devices:
                return "hip", devices
            hip_problem = "HIP found no AMD GPU"
    from pie_engine_cuda.driver_api import DriverUnavailable

    try:
        return "cuda", backend("cuda").probe()
    except DriverUnavailable as exc:
        if hip_problem:
            raise DriverUnavailable(f"{exc}; and for AMD GPUs: {hip_problem}", exc.what, exc.fix) from exc
        raise
