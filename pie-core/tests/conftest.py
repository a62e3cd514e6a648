from __future__ import annotations

import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


@pytest.fixture
def system_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of the test's own in place of the system's temporary folder (``tempfile.gettempdir()``)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real default model (SmolLM2-135M, Q4_1 GGUF), pulled once into the store and reused after that."""
    from pie.model.store import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2: Path) -> Any:
    """transformers' own reading of that GGUF file (float32, eval mode), loaded once: it takes many seconds.

    Tests only read it (weights, ``generate`` under ``no_grad``), so sharing it changes no test."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # transformers needs it to read GGUF
    import torch

    return transformers.AutoModelForCausalLM.from_pretrained(
        smollm2.parent, gguf_file=smollm2.name, dtype=torch.float32
    ).eval()
