"""`pie tune` when the device is lost midway, for an engine's own tests: the loss is the engine's to make."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import typer
from click.testing import Result
from typer.testing import CliRunner

from pie.profiles.cli import tune_command
from pie.profiles.tuner import Tuner

_APP = typer.Typer()
_APP.command("tune")(tune_command)
_APP.command("other")(lambda: None)  # two commands: the tune is named on the command line, as under `pie`


def tune_losing_the_device(engine: str, lose: Callable[[Tuner], None], folder: Path,
                           monkeypatch: pytest.MonkeyPatch) -> tuple[Result, Path]:
    """Run `pie tune --engine ENGINE -o FOLDER/m.toml`, calling ``lose(tuner)`` (which makes the engine's device
    lost for what follows) once its first measured cell is kept; the run's result and its partial file's path."""
    save = Tuner._save_partial

    def save_then_lose(self: Tuner, seconds: float) -> None:
        save(self, seconds)
        lose(self)

    monkeypatch.setattr(Tuner, "_save_partial", save_then_lose)
    monkeypatch.setenv("PIE_ENGINES", engine)
    monkeypatch.setenv("PIE_PROFILE_PATH", str(folder))
    monkeypatch.setenv("COLUMNS", "200")
    result = CliRunner().invoke(_APP, ["tune", "--engine", engine, "--budget", "120", "-o", str(folder / "m.toml")])
    return result, folder / "m.partial.json"
