"""One `pie tune` at a time per profile: an advisory lock (``flock``) on a file beside the profile.

A tune holds it from before its first measurement until its profile is written, and a second tune of the
same profile is refused at once, naming the first: the two would overwrite each other's measurements (the
partial file, then the profile), and, sharing the device, slow each other's kernels and skew both. Waiting
instead would look like a hang (a full tune has no time limit). The kernel drops the lock however its holder
ends, a SIGKILL included, so no stale lock is ever left to clear.

The lock file is named after the profile's stem, as its partial file is (``mine.toml`` and ``mine`` share
``mine.partial.json``, so they share ``.mine.tune.lock`` too). It is removed while still held; a tune that
then locks the file it had opened finds it gone and opens the new one (:func:`tune_lock`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pie.files import NotRegularFileError, file_kind

_TRIES = 8
"""Opens of the lock file before giving up, each after finding the last one removed by a tune that ended."""


class TuneBusyError(OSError):
    """Another process holds the tune lock: ``holder`` is its process id, where it has written it yet."""

    def __init__(self, path: Path, holder: int | None) -> None:
        super().__init__(errno.EWOULDBLOCK, "another tune holds it", str(path))
        self.holder = holder


def lock_path(target: Path) -> Path:
    return target.with_name(f".{target.stem}.tune.lock")


@contextmanager
def tune_lock(target: Path) -> Iterator[None]:
    """Hold the tune lock of the profile ``target`` (its folder made where absent).

    TuneBusyError where another process holds it; the OSError of a folder or lock file that cannot be made,
    or NotRegularFileError for a lock file that is not a regular file (a link is not followed)."""
    path = lock_path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:  # a regular file where a folder should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), exc.filename) from None
    descriptor = _locked(path)
    try:
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        try:
            os.unlink(path)  # still held: no other tune can lock this file now
        except OSError:
            pass
        os.close(descriptor)


def _locked(path: Path) -> int:
    """A descriptor of the lock file at ``path``, locked, and still the file there once locked."""
    for _ in range(_TRIES):
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
        try:
            found = os.fstat(descriptor)
            if not stat.S_ISREG(found.st_mode):
                raise NotRegularFileError(errno.EINVAL, f"not a regular file ({file_kind(found.st_mode)})", str(path))
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TuneBusyError(path, _holder(descriptor)) from None
            if _same_file(found, path):
                return descriptor
        except BaseException:
            os.close(descriptor)
            raise
        os.close(descriptor)  # its holder removed it before we locked it: open the one there now
    raise TuneBusyError(path, None)


def _same_file(found: os.stat_result, path: Path) -> bool:
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (found.st_dev, found.st_ino)


def _holder(descriptor: int) -> int | None:
    text = os.pread(descriptor, 32, 0).decode("ascii", "replace").strip()
    return int(text) if text.isdigit() else None
