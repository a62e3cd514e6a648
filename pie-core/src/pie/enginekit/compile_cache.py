"""The on-disk cache of compiled kernels, one for every engine.

An entry is keyed by a hash of everything that decides the compiler's output:
the full source, the compiler and its version, the target architecture and the
options. Its file holds a small JSON header with a SHA-256 per artifact, so a
truncated or damaged entry is detected, deleted and compiled again. Writes go
through a temporary file and an atomic rename, so concurrent processes never see
half an entry.

Each engine has a cache of its own, named by the engine: ``CompileCache(engine)`` lives in the
user cache directory (``platformdirs``), ``pie/<engine>-kernels``, unless ``PIE_<ENGINE>_CACHE_DIR``
names another folder; ``PIE_<ENGINE>_CACHE=0`` turns it off. An artifact that its loader takes from a path
(a shared library for ``dlopen``) is handed back as a file (:meth:`CompileCache.file`), and an
external compiler works in a scratch folder of the cache (:meth:`CompileCache.scratch`). Where the cache
cannot be written (a read-only home, a full disk), the cache turns, with one warning, to a folder of the
user's own in the system's temporary folder (``pie-<engine>-kernels-<uid>``, made 0700, never one another
user made or others may open: :func:`pie.files.user_temporary_folder`), where the user's next process
finds what this one built. Where there is none, and where the cache is turned off, artifacts go to a new
temporary folder: kernels are then compiled by every process, but compiled.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pie.files import read_regular_file, user_temporary_folder, write_atomically

MAGIC = b"PIE-KERNEL-CACHE 1\n"
SCRATCH_PREFIX = ".build-"
"""Scratch folders are ``.build-<pid>-*``: one whose process is gone belongs to a build killed midway."""
STALE_SCRATCH_SECONDS = 3600
"""A scratch folder this old is stale whatever its name says (its process id may have been reused)."""

MAX_ENTRY_BYTES = 1 << 30
"""The largest entry read back; a bigger file is not one this cache wrote."""

Artifacts = dict[str, bytes]


def cache_dir_env(engine: str) -> str:
    """The variable that names ``engine``'s cache folder: ``PIE_<ENGINE>_CACHE_DIR``."""
    return f"PIE_{engine.upper()}_CACHE_DIR"


def cache_enabled_env(engine: str) -> str:
    """The variable that turns ``engine``'s cache off when ``0``: ``PIE_<ENGINE>_CACHE``."""
    return f"PIE_{engine.upper()}_CACHE"


def default_cache_dir(engine: str, env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    override = env.get(cache_dir_env(engine), "").strip()
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pie")) / f"{engine}-kernels"


def cache_key(*, source: str, compiler: str, compiler_version: str, arch: str, options: tuple[str, ...]) -> str:
    """SHA-256 over every input of a compile."""
    digest = hashlib.sha256()
    header = json.dumps(
        {"compiler": compiler, "version": compiler_version, "arch": arch, "options": list(options)}, sort_keys=True
    )
    digest.update(header.encode())
    digest.update(b"\0")
    digest.update(source.encode())
    return digest.hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupted: int = 0


class CompileCache:
    """One engine's compiled artifacts (PTX, CUBIN, code objects, shared libraries) by cache key."""

    def __init__(self, engine: str, root: Path | None = None, enabled: bool | None = None):
        self.root = root if root is not None else default_cache_dir(engine)
        if enabled is None:
            enabled = os.environ.get(cache_enabled_env(engine), "1").strip() not in ("0", "false", "no")
        self.enabled = enabled
        self.engine = engine
        self.stats = CacheStats()
        self.problem = ""
        """Why the cache could not be written, from the first time it could not ("" while it could)."""
        self.fallback: Path | None = None
        """The user's own temporary folder the cache turned to when it could not be written (then ``root``)."""
        self.configured = self.root
        """The folder asked for: still read first once writes go to the fallback (a read-only folder of prebuilt
        kernels stays in use)."""
        self.log = logging.getLogger(f"pie.engine.{engine}")

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def load(self, key: str) -> Artifacts | None:
        """The entry's artifacts, or None when absent or damaged (a damaged entry is removed)."""
        if not self.enabled:
            return None
        relative = self.path(key).relative_to(self.root)
        # The folder asked for, then the fallback: this process's, or one another that could not write kept.
        fallback = self.fallback or user_temporary_folder(f"{self.engine}-kernels", create=False)
        for folder in (self.configured, fallback):
            if folder is None:
                continue
            path = folder / relative
            blob = self._read(path)
            if blob is not None:
                break
        else:
            return None
        artifacts = _decode(blob, key)
        if artifacts is None:
            self.stats.corrupted += 1
            self.log.warning("kernel cache entry %s is damaged; removing it and compiling again", path)
            try:
                path.unlink()
            except OSError:
                pass
        return artifacts

    def _read(self, path: Path) -> bytes | None:
        try:
            return read_regular_file(path, MAX_ENTRY_BYTES)
        except (FileNotFoundError, NotADirectoryError):  # (a cache folder that is a file: storing says so)
            return None
        except OSError as exc:
            self.log.warning("kernel cache entry %s is unreadable (%s); compiling again", path, exc.strerror or exc)
            return None

    def store(self, key: str, artifacts: Artifacts) -> None:
        if not self.enabled:
            return
        path = self.path(key)
        try:
            write_atomically(path, _encode(artifacts, key))
        except OSError as exc:
            if self._unwritable(path, exc):
                self.store(key, artifacts)

    def get_or_compile(self, key: str, compile_fn: Callable[[], Artifacts], fresh: bool = False) -> Artifacts:
        """The entry's artifacts, compiled and stored where it is absent or damaged, or where ``fresh`` asks: an
        entry whose checksums hold but whose artifact does not load (a checksum vouches for the bytes, not for
        what they are) is compiled again, replacing it."""
        artifacts = None if fresh else self.load(key)
        if artifacts is not None:
            self.stats.hits += 1
            return artifacts
        self.stats.misses += 1
        artifacts = compile_fn()
        self.store(key, artifacts)
        return artifacts

    def file(self, key: str, name: str, compile_fn: Callable[[], Artifacts], fresh: bool = False) -> Path:
        """Artifact ``name`` of the entry as a file of its own, for a loader that takes a path (``dlopen``);
        ``fresh`` as for :meth:`get_or_compile`.

        The file sits beside the entry and is rewritten, atomically, from the entry's verified bytes
        whenever it is missing or differs from them, so a damaged file is never handed back. A
        disabled cache, or one that cannot be written and has no fallback, hands back a copy in a
        temporary folder (:meth:`temporary_folder`)."""
        data = self.get_or_compile(key, compile_fn, fresh)[name]
        path = self._artifact_file(key, name, data) if self.enabled else None
        if path is None:
            folder = self.temporary_folder()
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            path = folder / self.path(key).with_suffix(f".{name}").name
            path.write_bytes(data)
        return path

    def _artifact_file(self, key: str, name: str, data: bytes) -> Path | None:
        """The file of :meth:`file` in the cache, written where it is not intact; None where it cannot be."""
        path = self.path(key).with_suffix(f".{name}")
        try:
            if read_regular_file(path, len(data)) == data:
                return path
        except OSError:
            pass
        try:
            write_atomically(path, data)
        except OSError as exc:
            return self._artifact_file(key, name, data) if self._unwritable(path, exc) else None
        return path

    @contextmanager
    def scratch(self) -> Iterator[Path]:
        """A folder for an external compiler's inputs and outputs, removed afterwards: in the cache (the
        scratch folders of builds that were killed midway are removed first), else, where the cache is
        disabled or cannot be written and has no fallback, a temporary folder (:meth:`temporary_folder`)."""
        folder = self._scratch_folder() if self.enabled else None
        if folder is None:
            folder = self.temporary_folder()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _scratch_folder(self) -> Path | None:
        self.remove_stale_scratch()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(dir=self.root, prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
        except OSError as exc:
            return self._scratch_folder() if self._unwritable(self.root, exc) else None

    def temporary_folder(self) -> Path:
        """A new folder in the system's temporary folder (``TMPDIR``), for what a disabled cache, or one that
        cannot be written and has no fallback, cannot hold; whoever asks removes it."""
        return Path(tempfile.mkdtemp(prefix=f"pie-{self.engine}-kernels-"))

    def _unwritable(self, path: Path, exc: OSError) -> bool:
        """Note that ``path`` cannot be written (a warning the first time, ``problem``; then quietly) and turn to
        the fallback, the user's own temporary folder, if the cache has not yet: True when it did, and what
        failed may be tried again there."""
        fallback = user_temporary_folder(f"{self.engine}-kernels") if self.fallback is None else None
        if self.problem:
            self.log.debug("cannot write %s either (%s)", path, exc.strerror or exc)
        else:
            reason = "not a folder" if isinstance(exc, FileExistsError) else exc.strerror or str(exc)  # (from mkdir)
            self.problem = f"{path}: {reason}"
            kept = (f"kept in {fallback}" if fallback is not None
                    else "built in a temporary folder and compiled again by every process")
            self.log.warning("the kernel cache %s cannot be written (%s); kernels are %s (set %s to a writable "
                             "folder)", self.root, self.problem, kept, cache_dir_env(self.engine))
        if fallback is None:
            return False
        self.root = self.fallback = fallback
        return True

    def remove_stale_scratch(self) -> None:
        """Remove scratch folders whose process is gone, or that are older than ``STALE_SCRATCH_SECONDS``."""
        try:
            folders = [entry for entry in os.scandir(self.root) if entry.name.startswith(SCRATCH_PREFIX)]
        except OSError:
            return
        for folder in folders:
            try:
                old = time.time() - folder.stat(follow_symlinks=False).st_mtime > STALE_SCRATCH_SECONDS
            except OSError:
                continue
            if old or not _running(folder.name):
                shutil.rmtree(folder.path, ignore_errors=True)


def _running(scratch_name: str) -> bool:
    """Whether the process that named a scratch folder ``.build-<pid>-...`` still runs."""
    try:
        pid = int(scratch_name[len(SCRATCH_PREFIX) :].split("-")[0])
        os.kill(pid, 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _encode(artifacts: Artifacts, key: str) -> bytes:
    names = sorted(artifacts)
    header = {
        "key": key,
        "artifacts": [
            {"name": name, "size": len(artifacts[name]), "sha256": hashlib.sha256(artifacts[name]).hexdigest()}
            for name in names
        ],
    }
    return MAGIC + json.dumps(header).encode() + b"\n" + b"".join(artifacts[name] for name in names)


def _decode(blob: bytes, key: str) -> Artifacts | None:
    if not blob.startswith(MAGIC):
        return None
    end = blob.find(b"\n", len(MAGIC))
    if end < 0:
        return None
    try:
        header = json.loads(blob[len(MAGIC) : end])
        entries = [(str(a["name"]), int(a["size"]), str(a["sha256"])) for a in header["artifacts"]]
        stored_key = header["key"]
    except (ValueError, KeyError, TypeError):
        return None
    if stored_key != key:
        return None
    payload = memoryview(blob)[end + 1 :]
    if sum(size for _, size, _ in entries) != len(payload):
        return None
    artifacts: Artifacts = {}
    offset = 0
    for name, size, checksum in entries:
        data = bytes(payload[offset : offset + size])
        offset += size
        if hashlib.sha256(data).hexdigest() != checksum:
            return None
        artifacts[name] = data
    return artifacts
