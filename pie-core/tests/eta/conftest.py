from __future__ import annotations

import pytest
from eta_harness import MetalCppRunner, OpenCLRunner, WgpuRunner


@pytest.fixture(scope="session")
def opencl() -> OpenCLRunner:
    return OpenCLRunner()


@pytest.fixture(scope="session")
def webgpu() -> WgpuRunner:
    return WgpuRunner()


@pytest.fixture(scope="session")
def metal() -> MetalCppRunner:
    return MetalCppRunner()
