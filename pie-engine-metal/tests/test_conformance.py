"""The shared conformance suite on the Metal engine.

On a Mac it runs on the GPU. Everywhere it also runs on the CPU emulator, which
compiles the same .metal sources with g++ and executes them with Metal's threadgroup
and simdgroup semantics: the host code, the bindings and the MSL arithmetic are all
checked against pie.kernels' references, at the simdgroup widths of Apple (32),
AMD (64) and Intel (16) GPUs, the latter two with shuffled thread schedules.
"""

from __future__ import annotations

from functools import partial

import pytest
from conftest import NOT_MACOS_REASON, ON_MACOS
from msl_emulator.engine import MAC2, FakeMTLDevice, emulated_registry
from pie.testing.conformance import ConformanceSuite


@pytest.mark.gpu
@pytest.mark.skipif(not ON_MACOS, reason=NOT_MACOS_REASON)
class TestMetalConformance(ConformanceSuite):
    engine = "metal"


class TestEmulatedAppleConformance(ConformanceSuite):
    engine = "metal"
    registry_factory = staticmethod(emulated_registry)
    # Metal's grids hold far more than 65,535 threadgroups a dimension and its kernels take any row width, which
    # the 16 inputs of test_linear_to_262_144_outputs cover; the emulator takes up to 40 seconds a class for 15 more.
    test_linear_of_15_inputs_to_262_144_outputs = None
    # Nor is a Metal buffer argument held to 128 MiB as a Vulkan or WebGPU storage binding is, and the emulator would
    # compute 129 rows of 262,144 logits, or three projected by a 132 MiB weight.
    test_logits_of_more_rows_than_a_storage_binding_holds = None
    test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected = None


class TestEmulatedAmdConformance(ConformanceSuite):
    engine = "metal"
    test_linear_of_15_inputs_to_262_144_outputs = None  # as above
    test_logits_of_more_rows_than_a_storage_binding_holds = None  # as above
    test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected = None  # as above
    registry_factory = staticmethod(
        partial(
            emulated_registry, simd_width=64, device=FakeMTLDevice("AMD Radeon Pro 5600M", MAC2, unified=False), seed=7
        )
    )


class TestEmulatedIntelConformance(ConformanceSuite):
    engine = "metal"
    test_linear_of_15_inputs_to_262_144_outputs = None  # as above
    test_logits_of_more_rows_than_a_storage_binding_holds = None  # as above
    test_a_vocabulary_past_a_storage_binding_is_embedded_and_projected = None  # as above
    registry_factory = staticmethod(
        partial(emulated_registry, simd_width=16, device=FakeMTLDevice("Intel(R) UHD Graphics 630", MAC2), seed=11)
    )
