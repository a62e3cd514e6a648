"""A K-quant GGUF on the Vulkan engine: its weights converted to float32 at load, the text its float32 copy's."""

from __future__ import annotations

from pie.testing.model_parity import KQuantModelParity


class TestVulkanKQuantModel(KQuantModelParity):
    engine = "vulkan"
