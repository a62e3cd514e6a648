"""The engine's browser device (Chromium's WebGPU through playwright): the conformance kit and whole models
against the CPU engine, as on the native device; SmolLM2's greedy tokens for 16 tokens; Tint's verdict on the
shipped WGSL. One browser serves the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from browser_device import registry_with_browser
from pie.plugins import Device, EngineRegistry
from pie.testing.conformance import ConformanceSuite
from pie.testing.model_parity import ModelParitySuite, OneSubmissionPerPass


@pytest.fixture(scope="module")
def browser_registry() -> Iterator[EngineRegistry]:
    """One browser for the module's tests (starting one and compiling its pipelines takes seconds)."""
    yield from registry_with_browser()


class TestBrowserConformance(ConformanceSuite):
    engine = "wgpu"

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls, browser_registry: EngineRegistry) -> EngineRegistry:
        return browser_registry

    def test_the_device_is_the_browser(self, device: Device) -> None:
        assert device.info.name.startswith("browser (") and dict(device.info.extra)["backend"] == "browser"


class TestBrowserModels(ModelParitySuite, OneSubmissionPerPass):
    engine = "wgpu"
    greedy_tokens = 16

    @pytest.fixture(scope="class")
    @classmethod
    def registry(cls, browser_registry: EngineRegistry) -> EngineRegistry:
        return browser_registry

    def submissions(self, device: Device) -> int:
        plugin = device.engine._manager.get_plugin("wgpu")
        return plugin.backend(device.info).submissions


def test_tint_compiles_every_shipped_module_without_a_message(browser_registry: EngineRegistry) -> None:
    """Chromium's WGSL compiler (Tint) takes the shipped WGSL as naga does: no error, no warning."""
    import pie.enginekit.shaders

    device = browser_registry.engine("wgpu").open(0)
    session = device.engine._manager.get_plugin("wgpu").backend(device.info).session
    sources = {path.stem: path.read_text() for path in (Path(pie.enginekit.shaders.__file__).parent / "generated").glob("*.wgsl")}
    assert sources
    found = session.run(session.page.evaluate(COMPILATION_MESSAGES, sources), timeout=120)
    assert set(found) == set(sources)
    assert not any(found.values()), {name: messages for name, messages in found.items() if messages}


COMPILATION_MESSAGES = """async (sources) => {
  const found = {};
  for (const [name, code] of Object.entries(sources)) {
    const info = await device.createShaderModule({ label: name, code }).getCompilationInfo();
    found[name] = info.messages.map((m) => `${m.type} at ${m.lineNum}:${m.linePos}: ${m.message}`);
  }
  return found;
}"""
