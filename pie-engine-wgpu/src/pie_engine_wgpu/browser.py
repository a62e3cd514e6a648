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

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from pie.contract import DeviceInfo
from pie.enginekit.host import host_memory_bytes, may_have_hardware_gpu
from pie.enginekit.shaders.chromium import (
    BrowserUnavailable,
    browser_version,
    check_devtools_endpoint,
    find_executable,
    installed,
)
from pie.plugins import env_seconds

BROWSER_ENV = "PIE_WGPU_BROWSER"
BROWSER_URL_ENV = "PIE_WGPU_BROWSER_URL"
ADAPTER_ENV = "PIE_WGPU_BROWSER_ADAPTER"
TIMEOUT_ENV = "PIE_WGPU_BROWSER_TIMEOUT"
DEFAULT_TIMEOUT_S = 120.0
"""The longest any one wait on the browser may take: a launch, a page load, one message's answer."""
DEVICE_NAME = "browser"
OFF = ("off", "0", "none", "no")
EXTRA_FIX = "pip install 'pie-engine-wgpu[browser]'"


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
        raise BrowserUnavailable(f"{ADAPTER_ENV}={value!r} is not one of {', '.join(ADAPTERS)}", setting=True)
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
    missing = [name for name in ("playwright", "websockets") if not installed(name)]
    if missing:
        raise BrowserUnavailable(f"{' and '.join(missing)} not installed (the browser extra)", EXTRA_FIX)
    url = env.get(BROWSER_URL_ENV, "").strip()
    if url:
        check_devtools_endpoint(url, BROWSER_URL_ENV)
        return BrowserTarget(cdp_url=url, adapter=chosen_adapter(env, attached=True))
    executable = find_executable(chosen, BROWSER_ENV)
    adapter = chosen_adapter(env, attached=False)
    return BrowserTarget(executable=executable, version=browser_version(executable), adapter=adapter)


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
    return env_seconds(os.environ if env is None else env, TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
