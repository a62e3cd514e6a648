"""A model over float16 and bfloat16 KV pages on the wgpu engine (the kernels: the conformance kit)."""

from pie.testing.model_parity import NarrowKVModelParity


class TestWgpuNarrowKV(NarrowKVModelParity):
    engine = "wgpu"
