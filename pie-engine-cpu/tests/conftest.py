"""The native kernels as each target builds them: this machine's (``-march=native``) and, on x86-64, the
AVX2 and the baseline SSE2 builds, whose vectors are 8 and 4 floats wide instead of AVX-512's 16. A test
that takes ``compiled`` runs once per build, with ``native.load()`` returning that build."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest
from pie.enginekit.host_compiler import HostBuildError
from pie_engine_cpu import native
from pie.enginekit.host import cpu_flags

X86 = platform.machine() in ("x86_64", "AMD64")
TARGETS = ["native", "haswell", "x86-64"] if X86 else ["native"]


def pytest_configure(config: pytest.Config) -> None:
    # pie.testing.model_parity (imported for its K-quant suite) marks its real-model test slow.
    config.addinivalue_line("markers", "slow: runs a real model (still part of CI)")


@pytest.fixture(scope="module", params=TARGETS)
def compiled(request: pytest.FixtureRequest) -> Iterator[native.NativeKernels]:
    target = request.param
    if target == "haswell" and "avx2" not in cpu_flags():
        pytest.skip("the AVX2 build runs only on a CPU with AVX2")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "FLAGS", tuple(f"-march={target}" if f == "-march=native" else f for f in native.FLAGS))
        native._built.cache_clear()
        try:
            kernels = native.load()
        except HostBuildError as error:  # pragma: no cover - CI installs gcc (noxfile SYSTEM_PACKAGES)
            pytest.fail(f"the native kernels must build for {target} where the tests run: {error}")
        yield kernels
    native._built.cache_clear()
