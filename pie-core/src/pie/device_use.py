"""Which `pie tune` and `pie serve` processes are using a device now, so that each can say when it shares one.

Either skews the other: a server's requests make a tune's timings noisy (its profile then picks worse variants),
and a tune's measurements slow the server's requests. Neither is refused (a user may mean it), but both say it.

A process that uses a device holds an exclusive ``flock`` on a file of its own in :func:`claims_dir`, named
``<device>.<pid>.<role>.<token>``. The kernel drops the lock however the process ends, a SIGKILL included, so a
file whose lock can be taken is stale and is removed by whoever finds it. A claim's file is made under a hidden
name and renamed once locked, so no file is seen unlocked while its process lives.

A device is named by what it shares: every CPU-kind device is the host's CPU (the CPU engine, lavapipe, PoCL and
JAX's CPU all run on its cores); any other by its engine's device key, so one GPU seen through two engines is not
matched. Only this user's processes are seen (the folder is in the user's cache, unless ``PIE_DEVICE_CLAIMS_DIR``
names another). All of this is advisory: a folder that cannot be written or read makes a claim that holds nothing
and a list that is empty, never an error.
"""

from __future__ import annotations

import fcntl
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from pie.contract import DeviceInfo

ROLES = ("serve", "tune")


@dataclass(frozen=True)
class DeviceUser:
    """A live process using a device: its process id and what it does there."""

    pid: int
    role: str

    def __str__(self) -> str:
        return f"a `pie {self.role}` (process {self.pid})"


CLAIMS_DIR_ENV = "PIE_DEVICE_CLAIMS_DIR"


def claims_dir() -> Path:
    """``$PIE_DEVICE_CLAIMS_DIR`` (a leading ``~`` the home folder), else ``<user cache dir>/pie/device-users``:
    processes see each other's claims only where they share this folder."""
    configured = os.environ.get(CLAIMS_DIR_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pie")) / "device-users"


def device_name(info: DeviceInfo) -> str:
    """The name a device's claims go by: ``cpu`` for any CPU-kind device, else its key with ':' as '-'."""
    return "cpu" if info.kind == "cpu" else re.sub(r"[^A-Za-z0-9_-]", "-", info.key)


class DeviceClaim:
    """This process's claim on a device, held until :meth:`release` (or the process ends)."""

    def __init__(self, info: DeviceInfo, role: str, folder: Path | None = None) -> None:
        if role not in ROLES:
            raise ValueError(f"a device claim's role is one of {', '.join(ROLES)}, not {role!r}")
        self._descriptor: int | None = None
        self.path: Path | None = None
        folder = claims_dir() if folder is None else folder
        name = f"{device_name(info)}.{os.getpid()}.{role}.{secrets.token_hex(4)}"
        hidden = folder / f".{name}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError:
            return
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(hidden, folder / name)
        except OSError:
            os.close(descriptor)
            hidden.unlink(missing_ok=True)
            return
        self._descriptor, self.path = descriptor, folder / name

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def release(self) -> None:
        """Remove the claim (still locked while its file goes, so nobody takes it for stale); safe to call twice."""
        if self._descriptor is None:
            return
        if self.path is not None:
            try:
                self.path.unlink()
            except OSError:
                pass
        os.close(self._descriptor)
        self._descriptor = None

    def __enter__(self) -> DeviceClaim:
        return self

    def __exit__(self, *_: object) -> None:
        self.release()


def device_users(info: DeviceInfo, folder: Path | None = None) -> list[DeviceUser]:
    """The other live processes that claim ``info``'s device, in process id order; stale claims are removed."""
    folder = claims_dir() if folder is None else folder
    prefix = device_name(info) + "."
    found = set()
    try:
        entries = [entry.name for entry in os.scandir(folder) if entry.name.startswith(prefix)]
    except OSError:
        return []
    for name in entries:
        parts = name[len(prefix):].split(".")
        if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ROLES or int(parts[0]) == os.getpid():
            continue
        if _held(folder / name):
            found.add(DeviceUser(int(parts[0]), parts[1]))
    return sorted(found, key=lambda user: (user.pid, user.role))


def _held(path: Path) -> bool:
    """Whether a live process holds the claim at ``path``; a stale one (nobody holds its lock) is removed."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        found = os.fstat(descriptor)
        if not stat.S_ISREG(found.st_mode):
            return False
        try:
            fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (found.st_dev, found.st_ino):
            path.unlink()
        return False
    except OSError:
        return False
    finally:
        os.close(descriptor)
