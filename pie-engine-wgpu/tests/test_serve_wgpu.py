"""`pie serve --engine wgpu` through the openai client, against the CPU engine (the checks: the served-engine kit)."""

from pie.testing.served_engine import ServedEngineSuite


class TestServeWgpu(ServedEngineSuite):
    engine = "wgpu"
