from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def install_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Install a fake engine as a real distribution (dist-info with an entry point) on sys.path."""
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))

    def install(name: str, source: str, priority: int = 10) -> None:
        module = f"fake_pie_engine_{name}"
        (site / f"{module}.py").write_text(textwrap.dedent(source.format(name=name, priority=priority)))
        info = site / f"pie_engine_{name}-9.9.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: pie-engine-{name}\nVersion: 9.9\n")
        (info / "entry_points.txt").write_text(f"[pie.engines]\n{name} = {module}\n")

    return install
