"""Helpers of the browser device's tests: a registry whose wgpu engine runs on the browser, or a skip.

Without Chromium or the browser extra the tests skip with the reason, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from pie.plugins import EngineRegistry
from pie_engine_wgpu.browser import BrowserUnavailable, find_browser
from pie_engine_wgpu.plugin import WgpuEngine


def browser_or_skip() -> None:
    try:
        find_browser()
    except BrowserUnavailable as exc:
        missing = f"{exc}" + (f" ({exc.fix})" if exc.fix else "")
        if os.environ.get("CI") == "true":
            pytest.fail(f"{missing}: CI must run the browser device's tests", pytrace=False)
        pytest.skip(missing)


def browser_registry() -> tuple[EngineRegistry, WgpuEngine]:
    """A registry whose wgpu engine puts the browser first, as ``PIE_WGPU_DEVICE=browser`` does (an engine
    object of its own: the native tests of this process keep theirs)."""
    browser_or_skip()
    engine = WgpuEngine(device="browser")
    registry = EngineRegistry()
    registry.register("wgpu", engine, "pie-engine-wgpu")
    return registry, engine


def registry_with_browser() -> Iterator[EngineRegistry]:
    """A fixture's body: the registry, and the browser closed after its tests."""
    registry, engine = browser_registry()
    yield registry
    engine.close(registry.engine("wgpu").open(0).info)
