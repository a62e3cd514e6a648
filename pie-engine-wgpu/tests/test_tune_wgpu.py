"""`pie tune --engine wgpu` when things go wrong (lavapipe; tiny budgets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pie.testing.tune_failures import tune_losing_the_device


def test_a_device_lost_mid_tune_ends_it_saying_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As on Vulkan: the tune ended with wgpu's words alone, nothing on the cells kept or how to go on."""
    import wgpu
    from pie_engine_wgpu.plugin import engine

    def lost(*args: object) -> None:
        raise wgpu.GPUError("Parent device is lost")

    def lose(tuner: object) -> None:
        queue = engine.backend(tuner.device.info).queue  # type: ignore[attr-defined]
        monkeypatch.setattr(type(queue), "submit", lost)

    result, partial = tune_losing_the_device("wgpu", lose, tmp_path, monkeypatch)
    assert result.exit_code == 1, result.output
    assert "wgpu says the device is lost" in result.output and "Traceback" not in result.output
    assert f"1 measurement(s) kept in {partial}" in result.output and "run the same command to resume" in result.output
    assert len(json.loads(partial.read_text())["cells"]) == 1 and not (tmp_path / "m.toml").exists()
