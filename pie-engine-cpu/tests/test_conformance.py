from pie.testing.conformance import ConformanceSuite


class TestCpuConformance(ConformanceSuite):
    engine = "cpu"
