"""A model over float16 and bfloat16 KV pages on the CPU engine (the kernels: ``test_native.py`` and the
conformance kit)."""

from pie.testing.model_parity import NarrowKVModelParity


class TestCpuNarrowKV(NarrowKVModelParity):
    engine = "cpu"
