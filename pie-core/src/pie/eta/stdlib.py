"""The model's own epilogues, written in eta: what the Poem compiler fuses.

Each entry is eta source; `get(name)` compiles it once. Inputs named `x` are the kernel
output the epilogue is applied to; the result is always the output `y`.
"""

from __future__ import annotations

from functools import cache

from . import compile as _compile
from .epilogue import Epilogue

SOURCES: dict[str, str] = {
    "silu_mul": """\
# SwiGLU: the gate projection through SiLU, times the up projection.
in gate: f32
in up: f32
out y = silu(gate) * up
""",
    "residual_add": """\
in x: f32
in residual: f32
out y = x + residual
""",
    "bias_add": """\
in x: f32
in bias: f32[cols]
out y = x + bias
""",
    "logit_temperature": """\
in x: f32
param temperature: f32
out y = x / temperature
""",
    "logit_softcap": """\
# Gemma-style soft capping: smoothly bounds logits to (-cap, cap).
in x: f32
param cap: f32
out y = cap * tanh(x / cap)
""",
    "softmax": """\
in x: f32
let e = exp(x - row_max(x))
out y = e / row_sum(e)
""",
    "rms_norm": """\
in x: f32
in weight: f32[cols]
param eps: f32
out y = x * rsqrt(row_mean(x * x) + eps) * weight
""",
}


@cache
def get(name: str) -> Epilogue:
    """The compiled stdlib epilogue `name` (a key of `SOURCES`)."""
    return _compile(SOURCES[name])
