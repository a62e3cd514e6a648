"""`pie tune --engine vulkan` when things go wrong (lavapipe; tiny budgets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pie.testing.tune_failures import tune_losing_the_device


def test_a_device_lost_mid_tune_ends_it_saying_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tune ended with the driver's words alone: nothing said that the cells measured before the loss were kept,
    nor how to go on from them."""
    import vulkan as vk

    def lost(*args: object) -> None:
        raise vk.VkErrorDeviceLost()

    result, partial = tune_losing_the_device(
        "vulkan", lambda tuner: monkeypatch.setattr(vk, "vkQueueSubmit", lost), tmp_path, monkeypatch)
    assert result.exit_code == 1, result.output
    assert "VK_ERROR_DEVICE_LOST" in result.output and "Traceback" not in result.output
    assert f"1 measurement(s) kept in {partial}" in result.output and "run the same command to resume" in result.output
    assert len(json.loads(partial.read_text())["cells"]) == 1 and not (tmp_path / "m.toml").exists()
