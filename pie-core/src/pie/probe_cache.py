"""A small on-disk memory of engine probes, so `pie engines` need not start every engine.

Probing an engine means importing its backend (jax, wgpu, vulkan, cuda) in a child process, which
takes seconds. What a probe finds changes only when the engine, its driver or the machine change,
so a record is keyed by what could change it: the engine's distribution and version, the Python
interpreter, the boot, the environment variables that steer drivers (not pie's own, such as
``PIE_ENGINES``), and the modification times of the import path's folders and of the dynamic
linker's cache, which a ``pip install`` or a driver's package changes. A working probe is trusted
for a day, a failing one (or one that found no device) for ten minutes, since its user is likely
fixing it; `pie engines --refresh` forgets them all. A failure of this process rather than of the
engine (``Probe.transient``: too many open files, no memory) is not remembered, nor is a setting of the
user's that the engine cannot read (``Probe.setting``). A damaged file is ignored and rewritten; a file
that is not a probe cache (``PIE_PROBE_CACHE`` naming another file by mistake) is never written over.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, get_args

from pie.contract import DeviceInfo, DeviceKind, EngineInfo
from pie.files import read_regular_file, write_atomically

MAX_AGE_SECONDS = 24 * 3600
FAILURE_MAX_AGE_SECONDS = 600
FORMAT = 2
"""Version of the file's layout; a file of another version is ignored."""
MAX_BYTES = 4 << 20
"""The largest probe cache read back (it holds a record per engine and installation); a bigger file is
ignored and rewritten."""

_ENV_PREFIXES = ("PIE_", "VK_", "CUDA_", "HIP_", "ROCR_", "XLA_", "JAX_", "WGPU_", "OCL_", "POCL_")
_NOT_PROBE_INPUTS = frozenset(
    {
        "PIE_ENGINES",
        "PIE_PROBE_CACHE",
        "PIE_DISABLE_PLUGIN_AUTOLOAD",
        "PIE_MODEL_DIR",
        "PIE_DEVICE_CLAIMS_DIR",
        "PIE_PROFILE",
        "PIE_PROFILE_PATH",
        "PIE_INFERLET_TIMEOUT",
    }
)
"""pie-core's own variables: they choose among engines or models, and change no probe."""
_LINKER_CACHE = Path("/etc/ld.so.cache")
_OPENING = b'{"format": '
"""How every file this cache writes begins: what tells one of its own, damaged or not, from another's file."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """What examining an engine found: its description, its devices and the kernels its first device
    lists, or why it cannot run."""

    info: EngineInfo | None
    devices: tuple[DeviceInfo, ...] = ()
    kernels: tuple[str, ...] = ()
    error: str = ""
    at: float = field(default_factory=time.time)
    """When the probe ran (seconds since the epoch)."""
    remembered: bool = False
    """Read back from the probe cache, not run by this process."""
    transient: bool = False
    """It failed for want of what this process had, not for anything of the engine's: the probe process
    could not be started, was killed from outside, or ran out of memory, file descriptors or processes.
    Never remembered: the next run probes again."""
    setting: bool = False
    """It failed on a setting of the user's that the engine cannot read (it raised
    :class:`pie.plugins.EngineSettingError`): not the engine's fault, and no reason to choose another engine.
    Never remembered: the user corrects the variable next, and an engine's setting need not be one
    :func:`cache_key` holds."""
    timed_out: bool = False
    """It ran past ``PIE_PROBE_TIMEOUT`` (an engine that hangs, or one whose first probe builds its kernels on a
    slow machine). Remembered, so that no command waits for a hung engine again."""

    @property
    def failed(self) -> bool:
        return bool(self.error) or not self.devices


def info_record(info: EngineInfo) -> dict[str, Any]:
    return asdict(info)


def info_from_record(record: Mapping[str, Any]) -> EngineInfo:
    """An EngineInfo from :func:`info_record`'s output; TypeError, ValueError or KeyError when malformed."""
    return EngineInfo(
        _text(record["name"]),
        _integer(record["contract_version"]),
        _integer(record["priority"]),
        tuple(_text(language) for language in _items(record["kernel_languages"])),
        _text(record.get("description", "")),
    )


def probe_record(probe: Probe) -> dict[str, Any]:
    return {
        "info": None if probe.info is None else info_record(probe.info),
        "devices": [asdict(device) for device in probe.devices],
        "kernels": list(probe.kernels),
        "error": probe.error,
        "at": probe.at,
        "transient": probe.transient,
        "setting": probe.setting,
        "timed_out": probe.timed_out,
    }


def probe_from_record(record: Any) -> Probe:
    """A Probe from :func:`probe_record`'s output; TypeError, ValueError or KeyError when malformed."""
    if not isinstance(record, Mapping):
        raise TypeError(f"a probe record is a JSON object, not {type(record).__name__}")
    info = None if record["info"] is None else info_from_record(_mapping(record["info"]))
    at = record["at"]
    if not isinstance(at, (int, float)) or isinstance(at, bool):
        raise TypeError(f"a probe's time is a number, not {at!r}")
    return Probe(
        info,
        tuple(_device(_mapping(device)) for device in _items(record["devices"])),
        tuple(_text(kernel) for kernel in _items(record["kernels"])),
        _text(record["error"]),
        float(at),
        transient=record.get("transient", False) is True,
        setting=record.get("setting", False) is True,
        timed_out=record.get("timed_out", False) is True,
    )


def _device(record: Mapping[str, Any]) -> DeviceInfo:
    kind = _text(record["kind"])
    if kind not in get_args(DeviceKind):
        raise ValueError(f"unknown device kind {kind!r}")
    return DeviceInfo(
        _text(record["engine"]),
        _integer(record["index"]),
        _text(record["name"]),
        _text(record["vendor"]),
        _text(record["architecture"]),
        kind,  # type: ignore[arg-type]  # checked against DeviceKind above
        _integer(record["memory_bytes"]),
        _text(record.get("driver", "")),
        tuple((_text(key), _text(value)) for key, value in (_items(pair) for pair in _items(record.get("extra", [])))),
    )


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, not {value!r}")
    return value


def _integer(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"expected an integer, not {value!r}")
    return value


def _items(value: Any) -> list[Any] | tuple[Any, ...]:
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"expected a list, not {value!r}")
    return value


def _mapping(value: Any) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"expected an object, not {value!r}")
    return value


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _installation_stamp() -> list[tuple[str, int]]:
    """Modification times of the import path's folders that hold distributions, and of the linker's
    cache: installing or removing a distribution or a system library changes one of them. (Other
    folders on the path change with every new ``__pycache__`` and say nothing of what is installed.)"""
    stamp = []
    for place in sys.path:
        try:
            if place and any(entry.name.endswith((".dist-info", ".egg-info")) for entry in os.scandir(place)):
                stamp.append((place, os.stat(place).st_mtime_ns))
        except OSError:
            continue
    try:
        stamp.append((str(_LINKER_CACHE), os.stat(_LINKER_CACHE).st_mtime_ns))
    except OSError:
        pass
    return stamp


def cache_key(engine: str, distribution: str, version: str) -> str:
    env = sorted(
        (k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k not in _NOT_PROBE_INPUTS
    )
    material = json.dumps([engine, distribution, version, sys.executable, _boot_id(), env, _installation_stamp()])
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def _default_path() -> Path:
    explicit = os.environ.get("PIE_PROBE_CACHE")
    if explicit:
        return Path(explicit)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pie")) / "probes.json"


def _foreign(path: Path) -> str | None:
    """Why ``path`` holds something other than a probe cache (which is never to be replaced), or None: absent,
    empty, or begun as this cache begins its files (damaged past that or not) it is the cache's to write."""
    if not os.path.lexists(path):
        return None
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # a link that loops or leads nowhere, a file it may not read: not its to replace
        return f"cannot be read ({exc.strerror or exc})"
    try:
        opening = os.read(descriptor, len(_OPENING)) if os.path.isfile(path) else None
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    finally:
        os.close(descriptor)
    if opening is None:
        return None  # a folder, a device, a FIFO: write_atomically refuses them, and reading finds no cache there
    if opening and not _OPENING.startswith(opening[: len(_OPENING)]):
        return "holds something else than probes"
    return None


class ProbeCache:
    """Probes by :func:`cache_key`, in one JSON file (``PIE_PROBE_CACHE``, else the user's cache folder)."""

    def __init__(self, path: Path | None = None):
        self.path = path or _default_path()
        self._foreign = _foreign(self.path)
        """Why the file is not to be written (it is no probe cache), or None."""
        if self._foreign:
            log.warning("pie: the probe cache %s %s: it is left alone, and probes are not remembered (set "
                        "PIE_PROBE_CACHE to a file of its own)", self.path, self._foreign)
        self._records = self._read()

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(read_regular_file(self.path, MAX_BYTES))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("probes"), dict):
            return {}
        return data["probes"]

    def get(self, key: str) -> Probe | None:
        """The remembered probe for ``key``, or None when absent, too old or unreadable."""
        try:
            probe = probe_from_record(self._records[key])
        except (KeyError, TypeError, ValueError):
            return None
        age = time.time() - probe.at
        if not 0 <= age <= (FAILURE_MAX_AGE_SECONDS if probe.failed else MAX_AGE_SECONDS):
            return None
        return replace(probe, remembered=True)

    def put(self, key: str, probe: Probe) -> None:
        """Remember ``probe`` under ``key``, forgetting records too old or damaged to be used (keys change
        with every installation, so the file would otherwise only grow). A transient failure is not kept, nor
        one of a setting."""
        if probe.transient or probe.setting:
            return
        self._records = {k: r for k, r in self._records.items() if self._usable(r)}
        self._records[key] = probe_record(probe)
        self._write()

    @staticmethod
    def _usable(record: Any) -> bool:
        try:
            return 0 <= time.time() - probe_from_record(record).at <= MAX_AGE_SECONDS
        except (KeyError, TypeError, ValueError):
            return False

    def clear(self) -> None:
        """Forget every probe, whatever it was keyed by."""
        self._records = {}
        self._write()

    def _write(self) -> None:
        if self._foreign:
            return
        try:  # PIE_PROBE_CACHE=/dev/null or a FIFO is never replaced (write_atomically refuses)
            write_atomically(self.path, json.dumps({"format": FORMAT, "probes": self._records}))
        except OSError:
            pass  # a cache that cannot be written only costs time
