from pie.testing.conformance import ConformanceSuite


class TestXlaConformance(ConformanceSuite):
    engine = "xla"
