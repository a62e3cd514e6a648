"""Fixtures for the hostile-input suite (the harness is :mod:`pie_process`)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def pie_env(tmp_path: Path) -> dict[str, str]:
    """An environment that keeps `pie` away from the user's caches: its own probe cache, model store and temporary
    folder (where a compile cache that cannot be written turns: one another process left there is read first)."""
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return {
        "PIE_PROBE_CACHE": str(tmp_path / "probes.json"),
        "PIE_MODEL_DIR": str(tmp_path / "models"),
        "PIE_ENGINES": "cpu",
        "TMPDIR": str(tmp_path / "tmp"),
    }
