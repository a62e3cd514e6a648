"""The on-disk cache of compiled kernels.

An entry is keyed by a hash of everything that decides the compiler's output:
the full source, the compiler and its version, the target architecture and the
options. Its file holds a small JSON header with a SHA-256 per artifact, so a
truncated or damaged entry is detected, deleted and compiled again. Writes go
through a temporary file and an atomic rename, so concurrent processes never see
half an entry.

The cache lives in the user cache directory (``platformdirs``) unless
``PIE_CUDA_CACHE_DIR`` names another; ``PIE_CUDA_CACHE=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR_ENV = "PIE_CUDA_CACHE_DIR"
CACHE_ENABLED_ENV = "PIE_CUDA_CACHE"
MAGIC = b"PIE-KERNEL-CACHE 1\n"

log = logging.getLogger("pie.engine.cuda")

Artifacts = dict[str, bytes]


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    override = env.get(CACHE_DIR_ENV, "").strip()
    if override:
        return Path(override).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pie")) / "cuda-kernels"


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
    """Compiled artifacts (PTX, CUBIN, code objects, shared libraries) by cache key."""

    def __init__(self, root: Path | None = None, enabled: bool | None = None):
        self.root = root if root is not None else default_cache_dir()
        if enabled is None:
            enabled = os.environ.get(CACHE_ENABLED_ENV, "1").strip() not in ("0", "false", "no")
        self.enabled = enabled
        self.stats = CacheStats()

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.bin"

    def load(self, key: str) -> Artifacts | None:
        """The entry's artifacts, or None when absent or damaged (a damaged entry is removed)."""
        if not self.enabled:
            return None
        path = self.path(key)
        try:
            blob = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("kernel cache entry %s is unreadable (%s); compiling again", path, exc)
            return None
        artifacts = _decode(blob, key)
        if artifacts is None:
            self.stats.corrupted += 1
            log.warning("kernel cache entry %s is damaged; removing it and compiling again", path)
            try:
                path.unlink()
            except OSError:
                pass
        return artifacts

    def store(self, key: str, artifacts: Artifacts) -> None:
        if not self.enabled:
            return
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".bin")
            with os.fdopen(handle, "wb") as out:
                out.write(_encode(artifacts, key))
            os.replace(temporary, path)
        except OSError as exc:
            log.warning("cannot write kernel cache entry %s (%s); it will be compiled again next time", path, exc)

    def get_or_compile(self, key: str, compile_fn: Callable[[], Artifacts]) -> Artifacts:
        artifacts = self.load(key)
        if artifacts is not None:
            self.stats.hits += 1
            return artifacts
        self.stats.misses += 1
        artifacts = compile_fn()
        self.store(key, artifacts)
        return artifacts


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
