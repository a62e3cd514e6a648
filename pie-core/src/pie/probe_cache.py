"""A small on-disk memory of device probes, so `pie engines` need not import every backend.

Probing a device means importing the engine's backend (jax, wgpu, vulkan, cuda),
which takes seconds. The result changes only when the engine, the driver
settings or the machine change, so it is kept keyed by everything that could
change it: engine name and version, the Python interpreter, the boot, and the
environment variables that steer drivers. Running a model always probes afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from pie.contract import DeviceInfo

MAX_AGE_SECONDS = 24 * 3600
_ENV_PREFIXES = ("PIE_", "VK_", "CUDA_", "HIP_", "ROCR_", "XLA_", "JAX_", "WGPU_", "OCL_", "POCL_")


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cache_key(engine: str, version: str) -> str:
    env = sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIXES) and k != "PIE_PROBE_CACHE")
    material = json.dumps([engine, version, sys.executable, _boot_id(), env])
    return hashlib.sha256(material.encode()).hexdigest()[:24]


def _default_path() -> Path:
    explicit = os.environ.get("PIE_PROBE_CACHE")
    if explicit:
        return Path(explicit)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("pie")) / "probes.json"


class ProbeCache:
    def __init__(self, path: Path | None = None):
        self.path = path or _default_path()
        try:
            self._data: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(self._data, dict):
                self._data = {}
        except (OSError, ValueError):
            self._data = {}

    def get(self, key: str) -> tuple[list[DeviceInfo], str] | None:
        """Cached (devices, error) for ``key``, or None when absent, stale or unreadable."""
        record = self._data.get(key)
        if not isinstance(record, dict) or time.time() - record.get("time", 0) > MAX_AGE_SECONDS:
            return None
        try:
            devices = [
                DeviceInfo(**{**d, "extra": tuple(tuple(pair) for pair in d.get("extra", ()))})
                for d in record["devices"]
            ]
            return devices, str(record["error"])
        except (KeyError, TypeError, ValueError):
            return None

    def put(self, key: str, devices: list[DeviceInfo], error: str) -> None:
        self._data[key] = {"time": time.time(), "devices": [asdict(d) for d in devices], "error": error}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            temporary = self.path.with_suffix(".tmp")
            temporary.write_text(json.dumps(self._data), encoding="utf-8")
            temporary.replace(self.path)
        except OSError:
            pass  # a cache that cannot be written only costs time
