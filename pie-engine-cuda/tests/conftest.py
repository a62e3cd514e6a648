from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import emulator_api
import pytest
from pie.plugins import Device, EngineRegistry

HAS_CXX = bool(shutil.which("g++") or shutil.which("clang++"))
NO_CXX = "the CUDA emulator needs a C++ compiler (apt-get install g++)"


@pytest.fixture(scope="session", autouse=True)
def kernel_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test session compiles into a fresh kernel cache, never the user's."""
    path = tmp_path_factory.mktemp("kernel-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIE_CUDA_CACHE_DIR", str(path))
        patch.delenv("PIE_CUDA_WEIGHT_DTYPE", raising=False)
        yield path


@pytest.fixture(scope="class")
def emulator(request: pytest.FixtureRequest) -> Iterator[int]:
    """Selects the host emulator (warp size from the class's ``emulator_warp``, default 32)."""
    if not HAS_CXX:
        pytest.skip(NO_CXX)
    warp = getattr(request.cls, "emulator_warp", 32)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIE_CUDA_BACKEND", emulator_api.SELECTED)
        patch.setenv("PIE_CUDA_EMULATOR_WARP", str(warp))
        yield warp


@pytest.fixture(scope="module")
def emulated_device() -> Iterator[Device]:
    """The CUDA engine on the host emulator (warp 32), for tests beyond the conformance kit."""
    if not HAS_CXX:
        pytest.skip(NO_CXX)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIE_CUDA_BACKEND", emulator_api.SELECTED)
        patch.setenv("PIE_CUDA_EMULATOR_WARP", "32")
        yield EngineRegistry().engine("cuda").open(0)
