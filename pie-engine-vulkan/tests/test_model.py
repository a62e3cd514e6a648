"""Whole models on the Vulkan engine through the shared runtime, against the CPU engine."""

from __future__ import annotations

from pie.plugins import Device
from pie.testing.model_parity import ModelParitySuite, OneSubmissionPerPass
from pie_engine_vulkan.plugin import engine as vulkan_engine


class TestVulkanModels(ModelParitySuite, OneSubmissionPerPass):
    engine = "vulkan"

    def submissions(self, device: Device) -> int:
        return vulkan_engine.backend(device.info).submissions
