from pie.testing.conformance import ConformanceSuite


class TestVulkanConformance(ConformanceSuite):
    engine = "vulkan"
