"""Reading and writing pie's own files: its state (profiles, the probe cache, compile cache entries, the
model store's records, a tune's measurements) and the profile a tune writes.

A state file is read only when it is a regular file, and only up to a bound (:func:`read_regular_file`):
a FIFO would block the read forever, and a device such as ``/dev/zero`` never ends. A file is written
through a temporary file of a name of its own beside it, then renamed over it (:func:`write_atomically`):
a reader sees the old file or the new one, two writers never share a temporary file, and one that
cannot be written whole (a full disk, a file size limit) is removed. The new file's bytes reach the disk
before the rename, and the folder's record of the rename after it (where the system can sync a folder):
after a power loss the file is the old one or the new one, never an empty or torn one. A path that is
something other than a regular file (a folder, a device, a FIFO) is never replaced.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import tempfile
from pathlib import Path

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegularFileError(OSError):
    """The path is something other than a regular file: ``strerror`` says what."""


class FileTooLargeError(OSError):
    """The file holds more bytes than its reader takes: ``size`` (at least, where it grew while read) and
    ``limit``."""

    def __init__(self, path: str | os.PathLike[str], size: int, limit: int) -> None:
        super().__init__(errno.EFBIG, f"{size} bytes, more than the {limit} it may have", str(path))
        self.size, self.limit = size, limit


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words: "a regular file", "a folder", "a FIFO"..."""
    if stat.S_ISREG(mode):
        return "a regular file"
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def non_regular_kind(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is ("a folder", "a FIFO", "a character device"...) when it exists and, links followed,
    is not a regular file; None when it is one, or is absent."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else file_kind(mode)


def read_regular_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path`` (links followed), of at most ``limit`` bytes.

    NotRegularFileError for anything else, FileTooLargeError past ``limit``, and the OSError of an
    unreadable or absent file. Opening never blocks (a FIFO is refused once open, not waited on), and no
    more than ``limit + 1`` bytes are read whatever the file claims."""
    descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        status = os.fstat(descriptor)
        if not stat.S_ISREG(status.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"not a regular file ({file_kind(status.st_mode)})", str(path))
        if status.st_size > limit:
            raise FileTooLargeError(path, status.st_size, limit)
    except BaseException:
        os.close(descriptor)
        raise
    with os.fdopen(descriptor, "rb") as file:
        # A read is given room for what it asks: sized by the file, not by the bound (a GiB for a compile cache
        # entry, a MemoryError under `ulimit -v`).
        data = file.read(status.st_size + 1)
        if len(data) > status.st_size:  # it grew since: read on, up to the bound
            data += file.read(limit + 1 - len(data))
    if len(data) > limit:
        raise FileTooLargeError(path, len(data), limit)
    return data


def write_atomically(path: str | os.PathLike[str], data: bytes | str, mode: int = 0o666) -> None:
    """Replace ``path`` with ``data`` (str: as UTF-8) through a new temporary file beside it and a rename.

    The temporary file's name is its own (``.<name>.<random>.tmp``), made with ``mode`` less the umask,
    and removed when anything fails; it is synced to the disk before the rename, and the folder after it
    (see :func:`_sync_folder`). The folder is made if need be. NotRegularFileError, before anything
    is written, when ``path`` is a folder, a device or a FIFO (links followed): never replaced. Any other
    failure is the OSError naming the file it concerns (``filename``: the temporary one when that failed)."""
    path = Path(path)
    kind = non_regular_kind(path)
    if kind is not None:
        raise NotRegularFileError(errno.EEXIST, f"{kind}, not a regular file: it is never replaced", str(path))
    payload = data.encode("utf-8") if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary, descriptor = _new_file(path, mode)
    try:
        with os.fdopen(descriptor, "wb") as out:
            out.write(payload)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException as exc:
        if isinstance(exc, OSError) and exc.filename is None:  # a failed write names no file: say which
            exc.filename = str(temporary)
        try:
            os.unlink(temporary)
        except OSError:
            pass
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """Flush ``folder``'s entries to the disk, so that a rename in it lasts a power loss. Skipped where the
    folder cannot be synced: on Windows (a folder does not open as a file), a folder this user may write but
    not read, a file system that does not sync folders (EINVAL, ENOTSUP). The OSError naming the folder when
    the sync itself fails (EIO)."""
    if os.name == "nt":
        return
    try:
        descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            return
        exc.filename = str(folder)
        raise
    finally:
        os.close(descriptor)


def user_temporary_folder(name: str, create: bool = True) -> Path | None:
    """``pie-<name>-<uid>`` in the system's temporary folder (``TMPDIR``), a folder of this user's alone, the
    same for each of the user's processes: made (mode 0700) where absent and ``create``.

    None where it is absent, or is not a folder (a link), or is another user's, or gives others any access:
    anyone may make a name in a shared temporary folder first, and what such a folder holds is not this
    user's to trust. None too where the system has no user ids (not POSIX)."""
    if not hasattr(os, "getuid"):
        return None
    uid = os.getuid()
    folder = Path(tempfile.gettempdir()) / f"pie-{name}-{uid}"
    try:
        if create:
            folder.mkdir(mode=0o700, exist_ok=True)
        found = os.lstat(folder)
    except OSError:
        return None
    private = stat.S_ISDIR(found.st_mode) and found.st_uid == uid and not found.st_mode & 0o077
    return folder if private else None


def _new_file(path: Path, mode: int) -> tuple[Path, int]:
    """A temporary file beside ``path`` made for this writer alone (O_EXCL), open for writing."""
    for _ in range(100):
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            return temporary, os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, "no free temporary file name", str(path))
