"""Whole models on the Vulkan engine through the shared runtime, against the CPU engine."""

from __future__ import annotations

from pie.plugins import EngineRegistry
from pie.runtime.model_runner import SequenceWork
from pie.testing.model_parity import ModelParitySuite, small_runner
from pie.testing.models import random_weights, tiny_config
from pie_engine_vulkan.plugin import engine as vulkan_engine


class TestVulkanModels(ModelParitySuite):
    engine = "vulkan"

    def test_a_forward_pass_is_one_submission(self, registry: EngineRegistry) -> None:
        config = tiny_config()
        device = registry.engine(self.engine).open(0)
        gpu = small_runner(device, config, list(random_weights(config).items()))
        backend = vulkan_engine.backend(device.info)
        sequence = gpu.new_sequence()
        gpu.step([SequenceWork(sequence, [1, 2, 3])])
        before = backend.submissions
        gpu.step([SequenceWork(sequence, [4])])
        assert backend.submissions - before == 1, f"{len(gpu.plan.steps)} launches should share one submission"
        gpu.close()
