"""Source of fake engine plugins, installed as real distributions by the tests."""

WORKING = """
import numpy as np
from pie.contract import CONTRACT_VERSION, DeviceInfo, EngineInfo
from pie.hookspecs import hookimpl

NAME = "{name}"

@hookimpl
def pie_engine_info():
    return EngineInfo(NAME, CONTRACT_VERSION, {priority}, ("numpy",), "test engine")

@hookimpl
def pie_probe_devices():
    return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]

@hookimpl
def pie_list_kernels(device):
    return {{"add": ("numpy",), "append_kv": ("numpy",), "attention": ("numpy",)}}

@hookimpl
def pie_compile_kernel(device, request):
    return lambda a, b: a + b

@hookimpl
def pie_allocate_pages(device, layout):
    return np.zeros(layout.shape, np.float32)

@hookimpl
def pie_upload(device, array):
    return np.array(array)

@hookimpl
def pie_download(device, tensor):
    return np.array(tensor)
"""

NO_POOL_KERNELS = WORKING.replace(', "append_kv": ("numpy",), "attention": ("numpy",)', "")
"""Lists no append_kv or attention: it cannot run a model, whatever the CPU engine can do."""

IMPORT_ERROR = """
raise ImportError("libacme.so.3: cannot open shared object file")
"""

PROBE_ERROR = WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]',
    'raise RuntimeError("no Acme driver loaded")',
)

SETTING_ERROR = WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]',
    "from pie.plugins import EngineSettingError\n"
    "    raise EngineSettingError(\"PIE_ACME_MODE is 'fast'; expected one of slow, steady\")",
)
"""Cannot read a setting of its own (the user's mistake, not the engine's)."""

MISSING_HOOKS = """
from pie.contract import CONTRACT_VERSION, EngineInfo
from pie.hookspecs import hookimpl

@hookimpl
def pie_engine_info():
    return EngineInfo("{name}", CONTRACT_VERSION, 1, ("numpy",))
"""

OLD_CONTRACT = WORKING.replace("EngineInfo(NAME, CONTRACT_VERSION,", "EngineInfo(NAME, CONTRACT_VERSION - 1,")

BAD_SIGNATURE = WORKING.replace(
    "def pie_compile_kernel(device, request):", "def pie_compile_kernel(device, request, stream):"
)

UNKNOWN_HOOK = (
    WORKING
    + """
@hookimpl
def pie_launch_rockets(device):
    return None
"""
)

INFO_RAISES = WORKING.replace(
    'return EngineInfo(NAME, CONTRACT_VERSION, {priority}, ("numpy",), "test engine")', 'raise ValueError("bad config")'
)

BEGINS_PASSES_ONLY = WORKING + """
@hookimpl
def pie_begin_pass(device, plan):
    pass
"""
"""Implements pie_begin_pass without pie_end_pass, which goes with it."""

PLANS_PASSES = WORKING + """
PASSES = []

@hookimpl
def pie_begin_pass(device, plan):
    PASSES.append((device.key, plan))

@hookimpl
def pie_end_pass(device):
    PASSES.append((device.key, "end"))
"""
"""Records each pass it is told of (``PASSES``)."""

SHORT_WEIGHT_GROUPS = WORKING + """
@hookimpl
def pie_upload_weights(device, arrays):
    return [np.array(arrays[0])]
"""

MEMORY_BANDWIDTH = WORKING + """
@hookimpl
def pie_memory_bandwidth(device):
    return 3.35e12
"""

SEGFAULT_ON_IMPORT = "import ctypes\nctypes.string_at(0)\n" + WORKING

SEGFAULT_IN_PROBE = WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]', "import ctypes; ctypes.string_at(0)"
)

HANG_ON_IMPORT = "import time\ntime.sleep(3600)\n" + WORKING

HANG_IN_PROBE = WORKING.replace(
    'return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]', "import time; time.sleep(3600)"
)

EXITS_ON_IMPORT = "import os, sys\nprint('libacme: fatal: no licence', file=sys.stderr)\nos._exit(3)\n" + WORKING

HEAVY_IMPORT = "import sys, types\nsys.modules['torch'] = types.ModuleType('torch')  # as `import torch` would\n" + WORKING

EVERY_PRIMITIVE = WORKING.replace(
    'return {{"add": ("numpy",), "append_kv": ("numpy",), "attention": ("numpy",)}}',
    "from pie.kernels import PRIMITIVES\n    return {{name: (\"numpy\",) for name in PRIMITIVES}}",
)
"""Lists every primitive kernel: nothing it runs can need the CPU fallback."""

CPU_WITHOUT_EPILOGUE = """
from dataclasses import replace
from pie.hookspecs import hookimpl
from pie_engine_cpu import plugin as cpu
from pie_engine_cpu.plugin import *  # noqa: F403  (its hooks, but for the three below)

NAME = "{name}"

@hookimpl
def pie_engine_info():
    return replace(cpu.pie_engine_info(), name=NAME, priority={priority})

@hookimpl
def pie_probe_devices():
    return [replace(device, engine=NAME) for device in cpu.pie_probe_devices()]

@hookimpl
def pie_list_kernels(device):
    return {{k: v for k, v in cpu.pie_list_kernels(device).items() if k not in ("epilogue", "softmax")}}
"""
"""The CPU engine under another name, without ``epilogue`` and ``softmax``: it runs a model that needs neither."""

_PAGE_HOOKS = """
@hookimpl
def pie_read_pages(device, pool, page_ids):
    return pool[:, page_ids].copy()

@hookimpl
def pie_write_pages(device, pool, page_ids, data):
    pool[:, page_ids] = data
"""

PAGED = WORKING + _PAGE_HOOKS
"""Reads and writes pages, and has no hook to copy them on the device."""

DIRTY_PAGES = WORKING.replace("np.zeros(layout.shape, np.float32)", "np.ones(layout.shape, np.float32)") + _PAGE_HOOKS
"""Its page pools do not start zero-filled."""

COLUMN_MAJOR_DOWNLOAD = (
    WORKING.replace('{{"add": ("numpy",),', '{{"add": ("numpy",), "linear": ("numpy",),')
    .replace(
        "return lambda a, b: a + b",
        "return (lambda x, w, bias: x @ w.T) if request.name == 'linear' else (lambda a, b: a + b)",
    )
    .replace("return np.array(tensor)", "return np.asfortranarray(tensor)")
)
"""Downloads in column-major order (the contract says row-major)."""

HANG_IN_DIAGNOSE = (
    WORKING
    + """
@hookimpl
def pie_diagnose():
    import time
    time.sleep(3600)
"""
)

BAD_DEVICE_FIELDS = WORKING.replace('"gpu", 1 << 30)', '"gpu", None)')
"""A DeviceInfo whose memory is None: printing it would crash `pie engines`."""

CPU_PROXY = """
import dataclasses
from pie.contract import CONTRACT_VERSION, EngineInfo
from pie.hookspecs import hookimpl
from pie_engine_cpu import plugin as cpu
from pie_engine_cpu.plugin import *  # every hook of the CPU engine: it runs what this engine is asked to

NAME = "{name}"

@hookimpl
def pie_engine_info():
    return EngineInfo(NAME, CONTRACT_VERSION, {priority}, ("numpy",), "the CPU engine under another name")

@hookimpl
def pie_probe_devices():
    return [dataclasses.replace(device, engine=NAME) for device in cpu.pie_probe_devices()]

@hookimpl
def pie_device_profiles():
    return []
"""
"""The CPU engine under the name ``{name}``: it runs a model, so a test can change one of its hooks."""

UNKNOWN_MEMORY = CPU_PROXY.replace("dataclasses.replace(device, engine=NAME)",
                                   "dataclasses.replace(device, engine=NAME, memory_bytes=0)")
"""Says 0 bytes of memory, as an engine that cannot know it does (WebGPU reports none for an adapter)."""

BINDS_LITTLE = CPU_PROXY + """
@hookimpl
def pie_max_page_pool_layer_bytes(device):
    return 4 * 4096 + 100
"""
"""Binds at most four pages and some bytes of one layer of a page pool: four pages of 16 tokens of `tiny_config`'s
float32 KV (2 KV heads of 16), as a Vulkan or WebGPU device binds at most its largest storage range."""

HOLDS_LITTLE = CPU_PROXY + """
@hookimpl
def pie_max_page_pool_layer_bytes(device):
    return 4 * 4096 + 100

@hookimpl
def pie_max_page_pool_bytes(device):
    return 3 * 2 * 4096 + 100
"""
"""As BINDS_LITTLE, and holds at most three pages and some bytes of a whole page pool (three pages of 16 tokens of
`tiny_config`'s two layers), as a Vulkan or WebGPU device holds a pool in one buffer of at most its largest."""

LEAVES_A_THREAD = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n" + CPU_PROXY
"""Starts a thread (not a daemon) that runs for an hour when it is imported."""

COMPILE_FAILS = CPU_PROXY + """
@hookimpl
def pie_compile_kernel(device, request):
    raise RuntimeError("no kernel compiler for this device")
"""

BUSY_IN_PIE = WORKING.replace(
    '    return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]',
    """    import traceback
    if not any(frame.name == "_examine_child" for frame in traceback.extract_stack()):
        raise RuntimeError("device busy (held by another process)")
    return [DeviceInfo(NAME, 0, "Fake Device", "Acme", "fake1", "gpu", 1 << 30)]""",
)
"""Passes its probe in pie's probe child and fails it in pie itself: another process took the device in between."""

PRINTS_ON_IMPORT = 'import os\nprint("loud: hello")\nos.write(1, b"loud: from C\\n")\n' + CPU_PROXY
"""Prints to stdout when it is imported, as Python does and as a C library would (to file descriptor 1)."""

EXITS_IN_COMPILE = CPU_PROXY + """
@hookimpl
def pie_compile_kernel(device, request):
    import sys
    sys.exit(9)
"""

EXITS_IN_LAUNCH = CPU_PROXY + """
@hookimpl
def pie_compile_kernel(device, request):
    import sys
    return lambda *args: sys.exit(11)
"""
