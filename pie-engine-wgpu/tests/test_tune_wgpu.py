"""`pie tune --engine wgpu` when things go wrong (lavapipe; tiny budgets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer
from pie.profiles.cli import tune_command
from typer.testing import CliRunner

app = typer.Typer()
app.command("tune")(tune_command)
app.command("other")(lambda: None)  # two commands: the tune is named on the command line, as under `pie`


def test_a_device_lost_mid_tune_ends_it_saying_what_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The tune ended with the driver's words alone: nothing said that the cells measured before the loss were kept,
    nor how to go on from them."""
    import wgpu
    from pie.profiles.tuner import Tuner
    from pie_engine_wgpu.plugin import engine

    save = Tuner._save_partial

    def save_then_lose(self: Tuner, seconds: float) -> None:
        save(self, seconds)

        def lost(*args: object) -> None:
            raise wgpu.GPUError("Parent device is lost")

        queue = engine.backend(self.device.info).queue
        monkeypatch.setattr(type(queue), "submit", lost)  # from the first cell kept on

    monkeypatch.setattr(Tuner, "_save_partial", save_then_lose)
    monkeypatch.setenv("PIE_ENGINES", "wgpu")
    monkeypatch.setenv("PIE_PROFILE_PATH", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(app, ["tune", "--engine", "wgpu", "--budget", "120", "-o", str(tmp_path / "m.toml")])
    partial = tmp_path / "m.partial.json"
    assert result.exit_code == 1, result.output
    assert "wgpu says the device is lost" in result.output and "Traceback" not in result.output
    assert f"1 measurement(s) kept in {partial}" in result.output and "run the same command to resume" in result.output
    assert len(json.loads(partial.read_text())["cells"]) == 1 and not (tmp_path / "m.toml").exists()
