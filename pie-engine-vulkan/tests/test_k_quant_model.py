"""A K-quant GGUF on the Vulkan engine: its weights read as stored (Q4_K, Q5_K, Q6_K),
the text its float32 copy's."""

from __future__ import annotations

from pie.testing.model_parity import KQuantModelParity


class TestVulkanKQuantModel(KQuantModelParity):
    engine = "vulkan"
    stored_types = frozenset({"q4_k", "q5_k", "q6_k"})
