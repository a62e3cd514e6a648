"""An engine's device running out of memory, for the engines' tests: a page pool, or a page read, the device has no
room for is refused with the MemoryError every engine raises for it (the kit's ``OutOfDeviceMemory``; numpy's own on
the CPU), and the device goes on (nothing of the failed operation held).

The process's address space is bounded (``RLIMIT_AS``) a little above what it holds once the device is up, so a
software device (lavapipe, XLA on the CPU) runs out as a GPU would; each check runs in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pie.contract import PageLayout

TOO_BIG = PageLayout(num_layers=8, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)
"""512 MiB (64 MiB a layer: within a storage binding of 128 MiB), more than the headroom of 256 MiB."""
FITS = PageLayout(num_layers=8, num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
"""64 MiB: within a headroom of 256 MiB, more than one of 32 MiB."""

_BOUNDED = """
import json, resource, sys
import numpy as np
from pie.contract import PageLayout
from pie.plugins import EngineRegistry

def bound(headroom):
    held = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
    resource.setrlimit(resource.RLIMIT_AS, (held + headroom, resource.RLIM_INFINITY))

def attempt(found, operation):
    try:
        operation()
    except BaseException as error:
        found["raised"], found["message"] = type(error).__name__, str(error)

device = EngineRegistry().engine(sys.argv[1]).open(0)
found = {}
"""

_POOL = _BOUNDED + f"""
device.free_pages(device.allocate_pages({FITS!r}))  # the device up, and a pool made once, before the bound
bound(256 << 20)
attempt(found, lambda: device.allocate_pages({TOO_BIG!r}))
for _ in range(3):  # a pool that fits, again and again: the failed one holds nothing
    device.free_pages(device.allocate_pages({FITS!r}))
    device.synchronize()
found["after"] = "usable"
print(json.dumps(found))
"""

_READ = _BOUNDED + f"""
pool = device.allocate_pages({FITS!r})
device.read_pages(pool, np.arange(2, dtype=np.int32))  # the device up, and pages read once, before the bound
bound(32 << 20)
attempt(found, lambda: device.read_pages(pool, np.arange({FITS.num_pages}, dtype=np.int32)))
for _ in range(3):  # a few pages, again and again: what the failed read made is not held, nor freed twice
    device.read_pages(pool, np.arange(4, dtype=np.int32))
found["after"] = "usable"
print(json.dumps(found))
"""


def _run(script: str, engine: str, timeout: float) -> dict[str, str]:
    result = subprocess.run([sys.executable, "-c", script, engine], capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def exhaust_device_memory(engine: str, timeout: float = 300) -> dict[str, str]:
    """What allocating :data:`TOO_BIG` raised on device 0 of ``engine`` (``raised``: its type's name, ``message``),
    and ``after``: ``usable`` where pools that fit were then allocated and freed three times."""
    return _run(_POOL, engine, timeout)


def read_beyond_device_memory(engine: str, timeout: float = 300) -> dict[str, str]:
    """What reading every page of a :data:`FITS` pool raised with 32 MiB of headroom (as :func:`exhaust_device_memory`
    says it), and ``after``: ``usable`` where a few pages were then read three times."""
    return _run(_READ, engine, timeout)
