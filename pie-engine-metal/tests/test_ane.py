"""The parked Neural Engine offload (``experimental/ane.py``): the eligibility rule, and the offload path on
the emulated device with a stand-in for Core ML."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from pie import kernels

sys.path.insert(0, str(Path(__file__).parents[1] / "experimental"))
import ane  # noqa: E402
from ane import AneOffload, AnePolicy, decide  # noqa: E402

ON = AnePolicy(enabled=True)


def _decide(
    policy: AnePolicy = ON, tokens: int = 128, k: int = 1024, n: int = 1024, static: bool = True, absmax: float = 1.0
) -> ane.Decision:
    return decide(
        policy, tokens=tokens, in_features=k, out_features=n, static_weight=static, weight_absmax=lambda: absmax
    )


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"policy": AnePolicy()}, "offload is off (PIE_METAL_ANE=1 turns it on)"),
        ({"static": False}, "computed on the GPU"),
        ({"k": 1000}, "not multiples of 16"),
        ({"k": 512, "n": 512}, "too small"),
        ({"tokens": 1}, "decode-sized batch"),
        ({"tokens": 31}, "below 32"),
        ({"absmax": 70000.0}, "beyond float16"),
        ({"absmax": float("inf")}, "beyond float16"),
    ],
)
def test_what_stays_on_the_gpu(kwargs: dict, reason: str) -> None:
    decision = _decide(**kwargs)
    assert not decision.offload and reason in decision.reason


@pytest.mark.parametrize(
    ("tokens", "bucket", "chunks"),
    [(32, 32, 1), (33, 64, 1), (200, 256, 1), (512, 512, 1), (513, 512, 2), (1300, 512, 3)],
)
def test_eligible_batches_round_up_to_a_bucket(tokens: int, bucket: int, chunks: int) -> None:
    decision = _decide(tokens=tokens)
    assert decision.offload and (decision.bucket, decision.chunks) == (bucket, chunks)


def test_the_weight_is_only_inspected_once_everything_cheap_has_passed() -> None:
    def fail() -> float:
        raise AssertionError("absmax computed for an ineligible launch")

    assert not decide(ON, tokens=1, in_features=1024, out_features=1024, static_weight=True, weight_absmax=fail).offload


def test_policy_from_the_environment() -> None:
    assert AnePolicy.from_env({}) == AnePolicy()
    assert AnePolicy.from_env({"PIE_METAL_ANE": "1"}).enabled
    assert AnePolicy.from_env({"PIE_METAL_ANE": "1", "PIE_METAL_ANE_BUCKETS": "256, 64"}).buckets == (64, 256)
    with pytest.raises(ValueError, match="PIE_METAL_ANE_BUCKETS"):
        AnePolicy.from_env({"PIE_METAL_ANE_BUCKETS": "0,8"})


@pytest.mark.skipif(sys.platform == "darwin", reason="checks the report off macOS")
def test_core_ml_is_reported_unavailable_off_macos() -> None:
    assert ane.availability() == (
        False,
        f"Core ML needs macOS; this is {'Linux' if sys.platform == 'linux' else ane.platform.system()}",
    )


class Float16Projection:
    """Stands in for the Core ML compiler: a float16 ``x @ W.T + b`` for a fixed bucket."""

    def __init__(self) -> None:
        self.compiled: list[tuple[tuple[int, int], int]] = []
        self.calls = 0

    def __call__(self, weight: np.ndarray, bias: np.ndarray | None, bucket: int) -> ane.Program:
        self.compiled.append((weight.shape, bucket))
        w16 = weight.astype(np.float16).astype(np.float32)
        b16 = None if bias is None else bias.astype(np.float16).astype(np.float32)

        def run(x: np.ndarray) -> np.ndarray:
            assert x.shape == (bucket, weight.shape[1]) and x.dtype == np.float32
            self.calls += 1
            y = x.astype(np.float16).astype(np.float32) @ w16.T
            return y if b16 is None else y + b16

        return run


def test_eligible_projections_run_through_the_compiled_program(open_emulated, rng) -> None:
    compiler = Float16Projection()
    offload = AneOffload(AnePolicy(enabled=True, buckets=(4, 8), min_weight_elements=0), compiler)
    emu = open_emulated()
    device, driver, ctx = emu.device, emu.driver, emu.context
    x_host = rng.standard_normal((10, 32)).astype(np.float32)
    w_host = rng.standard_normal((48, 32)).astype(np.float32)
    b_host = rng.standard_normal(48).astype(np.float32)
    w, b = device.upload(w_host), device.upload(b_host)
    # x comes out of a queued kernel: the offload must wait for it.
    x = device.compile("add")(device.upload(x_host), device.upload(np.zeros_like(x_host)))
    dispatched = len(driver.log)
    y = offload.maybe_run(ctx, x, w, b, static=True)
    assert y is not None and offload.last is not None and offload.last.offload
    assert (offload.last.bucket, offload.last.chunks) == (8, 2)
    assert len(driver.log) == dispatched, "an offloaded projection dispatches nothing on the GPU"
    np.testing.assert_allclose(device.download(y), kernels.linear(x_host, w_host, b_host), rtol=2e-2, atol=2e-2)
    assert compiler.compiled == [((48, 32), 8)] and compiler.calls == 2

    offload.maybe_run(ctx, x, w, b, static=True)  # same weight and bucket: the compiled program is reused
    assert compiler.compiled == [((48, 32), 8)]
    y = offload.maybe_run(ctx, device.compile("slice_columns", start=0, stop=32)(x), w, None, static=True)
    assert compiler.compiled == [((48, 32), 8)] * 2  # the same bucket without the bias is another program
    np.testing.assert_allclose(device.download(y), kernels.linear(x_host, w_host), rtol=2e-2, atol=2e-2)

    assert offload.maybe_run(ctx, device.upload(x_host[:3]), w, b, static=True) is None  # decode-sized: the GPU's
    assert offload.maybe_run(ctx, x, device.compile("add")(w, w), None, static=False) is None
    assert "computed on the GPU" in offload.last.reason and offload.offloaded == 3


@pytest.mark.skipif(
    sys.platform != "darwin" or not ane.availability()[0], reason="needs Core ML on an Apple-silicon Mac"
)
def test_core_ml_program_matches_the_reference() -> None:
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((64, 128)).astype(np.float32) * 0.1
    bias = rng.standard_normal(64).astype(np.float32)
    program = ane.coreml_compiler(weight, bias, 32)
    x = rng.standard_normal((32, 128)).astype(np.float32)
    np.testing.assert_allclose(program(x), kernels.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
