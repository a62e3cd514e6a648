"""Fixtures for the profile tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def profile_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty user profile folder, the only one searched (the real user config is never read)."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    monkeypatch.setenv("PIE_PROFILE_PATH", str(folder))
    monkeypatch.delenv("PIE_PROFILE", raising=False)
    yield folder
