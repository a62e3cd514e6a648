"""`pie serve --engine xla` through the openai client, against the CPU engine (the checks: the served-engine kit)."""

from pie.testing.served_engine import ServedEngineSuite


class TestServeXla(ServedEngineSuite):
    engine = "xla"
