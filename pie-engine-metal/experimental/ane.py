"""Neural Engine offload of eligible projections, through Core ML: parked outside the engine.

It offloads plain ``linear`` launches only, and no model pass on the Metal engine launches one: every
projection there is fused (``rms_norm_linear``, ``linear_add``, ``rms_norm_gate_up_silu``). So the
engine no longer carries it; the rule and the Core ML path stay here, tested on the emulated device
(``tests/test_ane.py``), until the fused projections can be offloaded too.

The Neural Engine runs fixed-shape float16 programs compiled ahead of time, and
reaching it costs a GPU synchronisation and two copies. So a projection goes there
only when all of this holds (:func:`decide`):

- offload is switched on (``PIE_METAL_ANE=1``; off by default);
- the weight is static: uploaded from the host, never written by a kernel, so one
  compiled Core ML program per weight stays valid;
- in and out features are multiples of 16 (the Neural Engine's channel granularity)
  and the weight is large enough to pay for the round trip;
- every weight fits float16 (the Neural Engine computes in float16);
- the batch is prefill-sized: at least the smallest bucket. Token counts are rounded
  up to a bucket (32, 64 ... 512) so a handful of programs per weight covers every
  batch; longer batches run in chunks of the largest bucket. Decode stays on the GPU.

A program is a single MIL ``linear`` op built with coremltools and compiled for
``CPU_AND_NE`` on first use of each (weight, bucket).
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from pie.enginekit.tensor import GpuTensor
    from pie_engine_metal.context import OpenedDevice

ENV = "PIE_METAL_ANE"
BUCKETS_ENV = "PIE_METAL_ANE_BUCKETS"
FP16_MAX = 65504.0

Program = Callable[[np.ndarray], np.ndarray]
"""A compiled projection: float32 ``[bucket, K]`` in, float32 ``[bucket, N]`` out."""


@dataclass(frozen=True)
class AnePolicy:
    enabled: bool = False
    buckets: tuple[int, ...] = (32, 64, 128, 256, 512)
    min_weight_elements: int = 1 << 20
    channel_multiple: int = 16

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> AnePolicy:
        env = os.environ if env is None else env
        enabled = env.get(ENV, "").strip().lower() in ("1", "true", "yes", "on")
        raw = env.get(BUCKETS_ENV, "").strip()
        if not raw:
            return cls(enabled=enabled)
        buckets = tuple(sorted({int(part) for part in raw.split(",") if part.strip()}))
        if not buckets or buckets[0] <= 0:
            raise ValueError(f"{BUCKETS_ENV}={raw!r}: give positive token counts, e.g. 64,256")
        return cls(enabled=enabled, buckets=buckets)


@dataclass(frozen=True)
class Decision:
    offload: bool
    reason: str
    bucket: int = 0
    chunks: int = 0


def decide(
    policy: AnePolicy,
    *,
    tokens: int,
    in_features: int,
    out_features: int,
    static_weight: bool,
    weight_absmax: Callable[[], float],
) -> Decision:
    """Whether one projection launch goes to the Neural Engine, and why (see the module doc)."""
    if not policy.enabled:
        return Decision(False, f"Neural Engine offload is off ({ENV}=1 turns it on)")
    if not static_weight:
        return Decision(False, "the weight is computed on the GPU, not a fixed model weight")
    m = policy.channel_multiple
    if in_features % m or out_features % m:
        return Decision(False, f"features {in_features} -> {out_features} are not multiples of {m}")
    if in_features * out_features < policy.min_weight_elements:
        return Decision(False, f"a {out_features}x{in_features} weight is too small to pay for the round trip")
    if tokens < policy.buckets[0]:
        return Decision(
            False, f"{tokens} tokens is a decode-sized batch (below {policy.buckets[0]}); it stays on the GPU"
        )
    absmax = weight_absmax()
    if not np.isfinite(absmax) or absmax > FP16_MAX:
        return Decision(False, f"weights reach {absmax:g}, beyond float16")
    largest = policy.buckets[-1]
    bucket = next((b for b in policy.buckets if b >= tokens), largest)
    chunks = -(-tokens // bucket)
    return Decision(True, f"{tokens} tokens in {chunks} chunk(s) of {bucket}", bucket, chunks)


def availability() -> tuple[bool, str]:
    """Whether Core ML and a Neural Engine are usable here, with the reason when not."""
    if sys.platform != "darwin":
        return False, f"Core ML needs macOS; this is {platform.system() or sys.platform}"
    if platform.machine() != "arm64":
        return False, "this Mac has no Neural Engine (it is not Apple silicon)"
    try:
        import coremltools  # noqa: F401
    except ImportError:
        return False, "coremltools is not installed: pip install 'coremltools>=8'"
    return True, "Core ML with the Neural Engine"


class Compiler(Protocol):
    def __call__(self, weight: np.ndarray, bias: np.ndarray | None, bucket: int) -> Program: ...


def coreml_compiler(weight: np.ndarray, bias: np.ndarray | None, bucket: int) -> Program:
    """Build and compile a MIL program ``y = x @ weight.T + bias`` for ``bucket`` rows (macOS)."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    weight16 = weight.astype(np.float16)
    bias16 = None if bias is None else bias.astype(np.float16)
    in_features = weight.shape[1]

    @mb.program(
        input_specs=[mb.TensorSpec(shape=(bucket, in_features), dtype=types.fp16)], opset_version=ct.target.macOS13
    )
    def projection(x: Any) -> Any:
        if bias16 is None:
            return mb.linear(x=x, weight=weight16, name="y")
        return mb.linear(x=x, weight=weight16, bias=bias16, name="y")

    model = ct.convert(
        projection,
        convert_to="mlprogram",
        compute_precision=ct.precision.FLOAT16,
        compute_units=ct.ComputeUnit.CPU_AND_NE,
        minimum_deployment_target=ct.target.macOS13,
    )

    def run(x: np.ndarray) -> np.ndarray:
        return np.asarray(model.predict({"x": x.astype(np.float16)})["y"], dtype=np.float32)

    return run


class AneOffload:
    """Runs eligible ``linear`` launches through compiled Core ML programs, one per (weight, bucket)."""

    def __init__(self, policy: AnePolicy, compiler: Compiler = coreml_compiler):
        self.policy = policy
        self.compiler = compiler
        self.last: Decision | None = None
        self.offloaded = 0
        # Per weight: (bucket, its bias or None) -> program; the bias lives as long as its weight.
        self._programs: dict[GpuTensor, dict[tuple[int, GpuTensor | None], Program]] = {}
        self._absmax: dict[GpuTensor, float] = {}
        """Largest magnitude of each static tensor the rule has inspected, computed once."""

    def maybe_run(
        self, ctx: OpenedDevice, x: GpuTensor, weight: GpuTensor, bias: GpuTensor | None, *, static: bool
    ) -> GpuTensor | None:
        """The projection's output when it ran on the Neural Engine, else None (the GPU runs it);
        ``static``: the weight and bias are model data no kernel writes."""
        tokens, in_features = x.shape
        out_features = weight.shape[0]
        decision = decide(
            self.policy,
            tokens=tokens,
            in_features=in_features,
            out_features=out_features,
            static_weight=static,
            weight_absmax=lambda: max(self._largest(ctx, t) for t in (weight, bias) if t is not None),
        )
        self.last = decision
        if not decision.offload:
            return None
        programs = self._programs.setdefault(weight, {})
        program = programs.get((decision.bucket, bias))
        if program is None:
            program = self.compiler(ctx.view(weight), None if bias is None else ctx.view(bias), decision.bucket)
            programs[(decision.bucket, bias)] = program
        ctx.synchronize()  # x may still be in flight on the GPU
        host = ctx.view(x)
        out = np.empty((tokens, out_features), dtype=np.float32)
        padded = np.zeros((decision.bucket, in_features), dtype=np.float32)
        for start in range(0, tokens, decision.bucket):
            rows = min(decision.bucket, tokens - start)
            padded[:rows] = host[start : start + rows]
            padded[rows:] = 0.0
            out[start : start + rows] = program(padded)[:rows]
        self.offloaded += 1
        return ctx.upload(out)

    def _largest(self, ctx: OpenedDevice, tensor: GpuTensor) -> float:
        largest = self._absmax.get(tensor)
        if largest is None:
            largest = self._absmax[tensor] = float(np.abs(ctx.view(tensor)).max(initial=0.0))
        return largest
