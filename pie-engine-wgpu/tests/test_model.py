"""Whole models on the WebGPU engine through the shared runtime, against the CPU engine."""

from __future__ import annotations

from pie.plugins import Device
from pie.testing.model_parity import ModelParitySuite, OneSubmissionPerPass
from pie_engine_wgpu.plugin import engine as wgpu_engine


class TestWgpuModels(ModelParitySuite, OneSubmissionPerPass):
    engine = "wgpu"

    def submissions(self, device: Device) -> int:
        return wgpu_engine.backend(device.info).submissions
