"""Launches whose row tensors exceed one storage binding, on the shared-kernel engines (Vulkan and wgpu, here on
lavapipe): the launchers run them over rows in turn, bound at offsets. The device's limit is lowered to 4 KiB here,
so tensors of a few KiB stand for the 129 MiB of logits that 129 rows of a 262,144-word vocabulary take
(``ConformanceSuite.test_logits_of_more_rows_than_a_storage_binding_holds`` runs those under the real limit)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from pie import kernels
from pie.plugins import Device, EngineRegistry
from pie.testing.conformance import TOLERANCE

LIMIT = 4096
ROWS = 50


@pytest.fixture(scope="module", params=("vulkan", "wgpu"))
def device(request: pytest.FixtureRequest) -> Device:
    pytest.importorskip(f"pie_engine_{request.param}")
    return EngineRegistry().engine(request.param).open(0)


@pytest.fixture
def launches(device: Device, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The entry points dispatched, with the device's binding limit lowered to ``LIMIT`` bytes."""
    backend = importlib.import_module(f"pie_engine_{device.name}.plugin").engine.launchers(device.info).backend
    monkeypatch.setattr(backend, "max_binding_bytes", LIMIT)
    dispatch, names = backend.dispatch, []

    def counted(entry: Any, *args: Any) -> None:
        names.append(entry.name)
        dispatch(entry, *args)

    monkeypatch.setattr(backend, "dispatch", counted)
    return names


def _f32(*shape: int) -> np.ndarray:
    return np.random.default_rng(sum(shape)).standard_normal(shape).astype(np.float32)


def _on(device: Device, launches: list[str], launcher: Callable[..., Any], *arrays: np.ndarray) -> Any:
    """What ``launcher`` gives for ``arrays``, checked to have run in more than one launch."""
    uploaded = [device.upload(array) for array in arrays]
    before = len(launches)
    got = launcher(*uploaded)
    assert len(launches) - before > 1, f"{launches[-1]} ran in one launch"
    return tuple(map(device.download, got)) if isinstance(got, tuple) else device.download(got)


def test_projections_run_over_token_rows_past_one_binding(device: Device, launches: list[str]) -> None:
    """x is 50 rows of 144 bytes (7,200 bytes): not a multiple of the offset alignment a row."""
    x, norm, residual = _f32(ROWS, 36), _f32(36) + 1, _f32(ROWS, 24)
    weight, gate_up = _f32(24, 36), _f32(24, 36) + 0.5  # within the limit: weights are bound whole
    for variant in device.kernels()["linear"]:
        got = _on(device, launches, device.compile("linear", variant), x, weight)
        np.testing.assert_allclose(got, kernels.linear(x, weight), **TOLERANCE, err_msg=f"linear[{variant}]")
    cases = {
        "linear_add": ((x, weight, residual), kernels.linear_add(x, weight, residual)),
        "rms_norm_linear": ((x, norm, weight), kernels.linear(kernels.rms_norm(x, norm, eps=1e-6), weight)),
        "rms_norm_gate_up_silu": ((x, norm, gate_up), kernels.rms_norm_gate_up_silu(x, norm, gate_up, eps=1e-6)),
    }
    for name, (arrays, expected) in cases.items():
        options = {} if name == "linear_add" else {"eps": 1e-6}
        got = _on(device, launches, device.compile(name, **options), *arrays)
        np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=name)


def test_row_kernels_run_over_rows_past_one_binding(device: Device, launches: list[str]) -> None:
    x, gate_up, weight = _f32(ROWS, 36), _f32(ROWS, 72), _f32(36) + 1
    cases: dict[str, tuple[dict[str, Any], tuple[np.ndarray, ...]]] = {
        "rms_norm": ({"eps": 1e-6}, (x, weight)),
        "add": ({}, (x, x[::-1].copy())),
        "silu_mul": ({}, (gate_up,)),
        "slice_columns": ({"start": 7, "stop": 43}, (gate_up,)),
        "softmax": ({"temperature": 0.5}, (x,)),
        "argmax": ({}, (x,)),
        "top_k": ({"k": 4}, (x,)),
    }
    for name, (options, arrays) in cases.items():
        got = _on(device, launches, device.compile(name, **options), *arrays)
        expected = kernels.REFERENCE[name](*arrays, **options)
        for part, want in zip(got if name == "top_k" else (got,), expected if name == "top_k" else (expected,)):
            np.testing.assert_allclose(part, want, **TOLERANCE, err_msg=name)


def test_epilogues_run_over_rows_past_one_binding_and_bind_a_column_input_whole(
    device: Device, launches: list[str]
) -> None:
    """A final logit softcap (Gemma 2's 256,000 words) or a user's logit epilogue runs on rows of logits."""
    if not device.supports("epilogue"):
        pytest.skip(f"{device.name} compiles no epilogue here")
    from pie.eta.stdlib import SOURCES

    x, weight = _f32(ROWS, 36), _f32(36) + 1
    cases = {"rms_norm": ((x, weight), (("eps", 1e-6),)), "bias_add": ((x, weight), ()), "softmax": ((x,), ())}
    for name, (arrays, params) in cases.items():
        got = _on(device, launches, device.compile("epilogue", source=SOURCES[name], params=params), *arrays)
        expected = kernels.epilogue(*arrays, source=SOURCES[name], params=params)
        np.testing.assert_allclose(got, expected, **TOLERANCE, err_msg=name)
