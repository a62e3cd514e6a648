"""`pie serve --engine vulkan` through the openai client, against the CPU engine (the checks: the served-engine kit)."""

from pie.testing.served_engine import ServedEngineSuite


class TestServeVulkan(ServedEngineSuite):
    engine = "vulkan"
