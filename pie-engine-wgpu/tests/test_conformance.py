from pie.testing.conformance import ConformanceSuite


class TestWgpuConformance(ConformanceSuite):
    engine = "wgpu"
