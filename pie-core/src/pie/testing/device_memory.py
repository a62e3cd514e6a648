"""An engine's device running out of memory, for the engines' tests: a page pool the device has no room for is
refused with the MemoryError every engine raises for it (the kit's ``OutOfDeviceMemory``; numpy's own on the CPU),
and the device goes on (nothing of the failed pool held).

The process's address space is bounded (``RLIMIT_AS``) a little above what it holds once the device is up, so a
software device (lavapipe, XLA on the CPU) runs out as a GPU would; this runs in a process of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys

from pie.contract import PageLayout

HEADROOM = 256 << 20
"""Bytes of address space the process may take beyond what it holds once the device is up."""
TOO_BIG = PageLayout(num_layers=8, num_pages=512, page_size=16, num_kv_heads=8, head_dim=128)
"""512 MiB (64 MiB a layer: within a storage binding of 128 MiB), more than the headroom."""
FITS = PageLayout(num_layers=8, num_pages=64, page_size=16, num_kv_heads=8, head_dim=128)
"""64 MiB, within the headroom."""

_SCRIPT = f"""
import json, resource, sys
from pie.contract import PageLayout
from pie.plugins import EngineRegistry

device = EngineRegistry().engine(sys.argv[1]).open(0)
device.free_pages(device.allocate_pages({FITS!r}))  # the device up, and a pool made once, before the bound
held = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize:")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (held + {HEADROOM}, resource.RLIM_INFINITY))
found = {{}}
try:
    device.allocate_pages({TOO_BIG!r})
except BaseException as error:
    found["raised"], found["message"] = type(error).__name__, str(error)
for attempt in range(3):  # a pool that fits, again and again: the failed one holds nothing
    device.free_pages(device.allocate_pages({FITS!r}))
    device.synchronize()
found["after"] = "usable"
print(json.dumps(found))
"""


def exhaust_device_memory(engine: str, timeout: float = 300) -> dict[str, str]:
    """What allocating :data:`TOO_BIG` raised on device 0 of ``engine`` (``raised``: its type's name, ``message``),
    and ``after``: ``usable`` where pools that fit were then allocated and freed three times."""
    result = subprocess.run([sys.executable, "-c", _SCRIPT, engine], capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    found: dict[str, str] = json.loads(result.stdout.strip().splitlines()[-1])
    return found
