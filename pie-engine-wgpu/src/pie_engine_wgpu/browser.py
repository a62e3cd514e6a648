"""The browser device of the WebGPU engine: finding a browser to run it in, cheaply, and describing it.

A Chromium-family browser's WebGPU (Dawn, with its own WGSL compiler, Tint) runs the same
shipped WGSL as wgpu-native. The device is listed beside the native adapters when a
browser and the ``browser`` extra (playwright, websockets) are present; nothing is started
to list it: the browser starts when the device is opened (see :mod:`pie_engine_wgpu.page`).

``PIE_WGPU_BROWSER`` names the browser (a path or a command on ``PATH``; ``off`` hides the
device); ``PIE_WGPU_BROWSER_URL`` attaches to a browser already running on this machine
instead, through its DevTools endpoint (started with ``--remote-debugging-port=9222``:
``http://127.0.0.1:9222``), where the engine opens a page of its own.
``PIE_WGPU_DEVICE=browser`` puts the device first, so ``--engine wgpu`` runs on it.

``PIE_WGPU_BROWSER_ADAPTER`` picks the browser's WebGPU adapter (:data:`ADAPTERS`). On Linux the
default is ``system``: Chromium's Dawn takes no Vulkan adapter that lacks what it requires (Debian 12's
lavapipe has no ``shaderSampledImageArrayDynamicIndexing``, and Chromium wants external semaphores),
so its own WebGPU would be the bundled SwiftShader; ANGLE, though, runs OpenGL ES on the system's
Vulkan driver, and Dawn's OpenGL ES backend (WebGPU's compatibility feature level) runs on ANGLE,
so the kernels run on the same driver as the native device. ``swiftshader`` asks for Chromium's
fallback adapter instead; ``chromium`` takes what Chromium gives unasked (its default elsewhere,
where that is the GPU's own backend: Metal, D3D12).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import util
from urllib.parse import urlsplit

from pie.contract import DeviceInfo
from pie.shaders.host import host_memory_bytes, may_have_hardware_gpu

BROWSER_ENV = "PIE_WGPU_BROWSER"
BROWSER_URL_ENV = "PIE_WGPU_BROWSER_URL"
ADAPTER_ENV = "PIE_WGPU_BROWSER_ADAPTER"
TIMEOUT_ENV = "PIE_WGPU_BROWSER_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
"""The longest any one wait on the browser may take: a launch, a page load, one message's answer."""
DEVICE_NAME = "browser"
OFF = ("off", "0", "none", "no")
COMMANDS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
"""Commands looked up on PATH, in order, when ``PIE_WGPU_BROWSER`` is unset."""
_MAC_APPS = (
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",
)
EXTRA_FIX = "pip install 'pie-engine-wgpu[browser]'"
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def browser_fix() -> str:
    if sys.platform.startswith("linux"):
        return "sudo apt-get install chromium"
    return "install Chromium or Google Chrome"


@dataclass(frozen=True)
class BrowserAdapter:
    """A way to get the browser's WebGPU adapter: switches for a browser pie launches (a browser attached
    to keeps its own) and the page's ``navigator.gpu.requestAdapter()`` options."""

    name: str
    description: str
    switches: tuple[str, ...] = ()
    options: tuple[tuple[str, str | bool], ...] = ()


ADAPTERS = {
    adapter.name: adapter
    for adapter in (
        BrowserAdapter(
            "system",
            "the system's Vulkan driver through ANGLE and Dawn's OpenGL ES backend",
            ("--use-angle=vulkan", "--use-webgpu-adapter=opengles"),
            (("featureLevel", "compatibility"),),
        ),
        BrowserAdapter("swiftshader", "Chromium's SwiftShader", (), (("forceFallbackAdapter", True),)),
        BrowserAdapter("chromium", "the adapter Chromium chooses"),
    )
}


def default_adapter(attached: bool) -> str:
    """The adapter used when ``PIE_WGPU_BROWSER_ADAPTER`` is unset: the system's driver for a Chromium pie
    launches on Linux (its only way off SwiftShader there), Chromium's own choice otherwise."""
    return "system" if sys.platform.startswith("linux") and not attached else "chromium"


def chosen_adapter(env: Mapping[str, str], attached: bool) -> BrowserAdapter:
    value = env.get(ADAPTER_ENV, "").strip().lower() or default_adapter(attached)
    if value not in ADAPTERS:
        raise BrowserUnavailable(f"{ADAPTER_ENV}={value!r} is not one of {', '.join(ADAPTERS)}")
    return ADAPTERS[value]


@dataclass(frozen=True)
class BrowserTarget:
    """Where the browser device runs: a browser to launch, or one to attach to, and the adapter to ask for."""

    executable: str = ""
    cdp_url: str = ""
    version: str = ""
    """What the browser says it is (``Chromium 156.0.8078.114``); empty when attached."""
    adapter: BrowserAdapter = ADAPTERS["chromium"]

    @property
    def label(self) -> str:
        where = self.version or (f"attached at {self.cdp_url}" if self.cdp_url else os.path.basename(self.executable))
        return f"{where}, {self.adapter.name} adapter"


class BrowserUnavailable(RuntimeError):
    """No browser device here; ``fix`` says how to get one."""

    def __init__(self, reason: str, fix: str = ""):
        super().__init__(reason)
        self.fix = fix


def requested(env: Mapping[str, str]) -> bool:
    """Whether the user asked for a browser by its variables (then one that cannot run is an error)."""
    value = env.get(BROWSER_ENV, "").strip()
    return bool(env.get(BROWSER_URL_ENV, "").strip()) or bool(value and value.lower() not in OFF)


def find_browser(env: Mapping[str, str] | None = None) -> BrowserTarget:
    """The browser the device would run in, or BrowserUnavailable saying why not. Starts nothing but
    ``BROWSER --version`` (bounded), which also shows that the executable runs at all."""
    env = os.environ if env is None else env
    chosen = env.get(BROWSER_ENV, "").strip()
    if chosen.lower() in OFF:
        raise BrowserUnavailable(f"{BROWSER_ENV}={chosen} turns the browser device off")
    missing = [name for name in ("playwright", "websockets") if not _installed(name)]
    if missing:
        raise BrowserUnavailable(f"{' and '.join(missing)} not installed (the browser extra)", EXTRA_FIX)
    url = env.get(BROWSER_URL_ENV, "").strip()
    if url:
        host = urlsplit(url).hostname or ""
        if urlsplit(url).scheme not in ("http", "ws") or host not in LOOPBACK:
            raise BrowserUnavailable(
                f"{BROWSER_URL_ENV}={url!r} is not a DevTools endpoint on this machine "
                "(http://127.0.0.1:PORT of a browser started with --remote-debugging-port=PORT)"
            )
        return BrowserTarget(cdp_url=url, adapter=chosen_adapter(env, attached=True))
    if chosen:
        executable = chosen if os.sep in chosen else shutil.which(chosen)
        if not executable or not os.access(executable, os.X_OK) or os.path.isdir(executable):
            raise BrowserUnavailable(f"{BROWSER_ENV}={chosen}: no such executable", browser_fix())
    else:
        found = [shutil.which(command) for command in COMMANDS]
        found += [path for path in _MAC_APPS if sys.platform == "darwin" and os.access(path, os.X_OK)]
        executable = next((path for path in found if path), "")
        if not executable:
            raise BrowserUnavailable(f"no Chromium-family browser found ({', '.join(COMMANDS)})", browser_fix())
    adapter = chosen_adapter(env, attached=False)
    return BrowserTarget(executable=executable, version=browser_version(executable), adapter=adapter)


def _installed(name: str) -> bool:
    try:
        return util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def browser_version(executable: str) -> str:
    try:
        run = subprocess.run(
            [executable, "--version"], capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise BrowserUnavailable(f"{executable} --version failed: {exc}", browser_fix()) from exc
    lines = [line.strip() for line in run.stdout.splitlines() if line.strip()]
    if run.returncode != 0 or not lines:
        last = (run.stderr.strip().splitlines() or ["no output"])[-1]
        raise BrowserUnavailable(f"{executable} --version exited with {run.returncode}: {last}", browser_fix())
    return re.sub(r"\s+built on .*$", "", lines[0])


def describe(index: int, target: BrowserTarget, adapter: str = "") -> DeviceInfo:
    """The device as far as it can be told without starting the browser, or with ``adapter``, the name of
    the adapter its page got. On a host with no GPU every adapter a browser can get is a CPU device
    (lavapipe under ANGLE for ``system``, else SwiftShader); elsewhere the adapter is known once opened."""
    software = not may_have_hardware_gpu()
    swiftshader = software and target.adapter.name != "system"
    return DeviceInfo(
        engine="wgpu",
        index=index,
        name=f"{DEVICE_NAME} ({target.label}{': ' + adapter if adapter else ''})",
        vendor="Google" if swiftshader else "browser",
        architecture="swiftshader" if swiftshader else "webgpu",
        kind="cpu" if software else "other",
        memory_bytes=host_memory_bytes() if software else 0,  # a CPU adapter allocates from the host's memory
        driver=target.version or target.cdp_url,
        extra=(
            ("backend", "browser"),
            ("browser", target.cdp_url or target.executable),
            ("adapter", target.adapter.name),
        ),
    )


def timeout(env: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{TIMEOUT_ENV}={raw!r} is not a number of seconds above 0")
    return seconds
