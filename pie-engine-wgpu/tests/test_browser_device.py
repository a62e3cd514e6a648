"""The browser device: listing and selection, `pie doctor`, the page's loopback server, the transport, and
what happens when the browser, the page or the WebGPU device goes away (an error naming it, never a hang).

Every wait is bounded: the page's answers by the session's timeout, the subprocesses by theirs.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from browser_device import browser_or_skip, browser_registry
from pie.plugins import Device, DeviceLost, EngineError
from pie.runtime.model_runner import ModelRunner, SequenceWork
from pie.scheduler import BatchScheduler
from pie.testing.models import random_weights, tiny_config
from pie_engine_wgpu import browser
from pie_engine_wgpu.page import BrowserLost, PageSession
from pie_engine_wgpu.plugin import WgpuEngine, browser_diagnosis
from pie_engine_wgpu.protocol import FRAME_HEADER_BYTES, Frame, Op

STATIC = Path(browser.__file__).parent / "static"
PROBE = (
    "import json, sys; from pie.plugins import EngineRegistry; s = EngineRegistry().status('wgpu');"
    "print(json.dumps([s.status, s.reason, [d.name for d in s.devices], 'playwright' in sys.modules]))"
)


def run_python(code: str, timeout: float = 120, **env: str) -> Any:
    """Run ``code`` in a fresh interpreter (device lists are per process); its last line, as JSON."""
    result = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_pie(args: list[str], env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run this environment's `pie` command as a user would."""
    pie = Path(sys.executable).with_name("pie")
    return subprocess.run(
        [str(pie), *args], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


@pytest.fixture(autouse=True)
def _needs_a_browser() -> None:
    browser_or_skip()


@pytest.fixture
def fresh() -> Iterator[tuple[Device, WgpuEngine]]:
    """A browser device of its own (these tests break it)."""
    registry, engine = browser_registry()
    device = registry.engine("wgpu").open(0)
    yield device, engine
    engine.close(device.info)


def session_of(device: Device, engine: WgpuEngine) -> PageSession:
    return engine.backend(device.info).session  # type: ignore[attr-defined]


# -- listing, selection, diagnosis ----------------------------------------------------------


def test_listed_after_the_native_adapters_without_starting_a_browser() -> None:
    code = (
        "import json, sys; from pie_engine_wgpu.plugin import engine; devices = engine.pie_probe_devices();"
        "print(json.dumps([[[d.name, dict(d.extra)['backend']] for d in devices],"
        " 'playwright' in sys.modules or 'websockets' in sys.modules]))"
    )
    devices, imported = run_python(code)
    assert devices[-1][0].startswith("browser (") and devices[-1][1] == "browser", devices
    assert all(backend != "browser" for _, backend in devices[:-1])
    assert imported is False, "listing the browser device must not start it (nor import playwright)"


def test_pie_wgpu_device_browser_selects_it_and_the_probe_starts_it() -> None:
    status, reason, names, _ = run_python(PROBE, PIE_WGPU_DEVICE="browser")
    assert status == "ok", reason
    assert names[0].startswith("browser (") and len(names) >= 2
    chosen = browser.chosen_adapter(os.environ, attached=False).name
    assert f", {chosen} adapter: " in names[0], f"the started device names the adapter its page got: {names[0]}"
    if chosen == "system":
        assert "adapter: ANGLE (" in names[0] and "(openGLES backend)" in names[0], names[0]


def test_the_adapter_is_chosen_by_its_variable() -> None:
    assert browser.find_browser({}).adapter.name == ("system" if sys.platform.startswith("linux") else "chromium")
    assert browser.find_browser({browser.ADAPTER_ENV: "SwiftShader"}).adapter.name == "swiftshader"
    attached = browser.find_browser({browser.BROWSER_URL_ENV: "http://127.0.0.1:9222"})
    assert attached.adapter.name == "chromium", "a browser attached to keeps its own switches"
    with pytest.raises(browser.BrowserUnavailable, match=r"ADAPTER='gpu' is not one of system, swiftshader, chromium"):
        browser.find_browser({browser.ADAPTER_ENV: "gpu"})
    _, _, names, _ = run_python(PROBE, PIE_WGPU_BROWSER_ADAPTER="gpu")
    assert not any(name.startswith("browser") for name in names), "a bad adapter not asked for is left out"
    status, reason, _, _ = run_python(PROBE, PIE_WGPU_DEVICE="browser", PIE_WGPU_BROWSER_ADAPTER="gpu")
    assert status == "broken" and "is not one of system, swiftshader, chromium" in reason, reason
    assert "EngineSettingError" in reason, f"the user's setting, not a reason to choose another engine: {reason}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the system adapter is the default on Linux")
def test_the_page_runs_on_the_system_driver_and_swiftshader_stays_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default the browser's kernels run on the native device's Vulkan driver (through ANGLE); SwiftShader
    is one variable away. Both compute the same thing."""
    from pie_engine_wgpu.adapters import native_adapters

    native = native_adapters()[0].info["device"] if native_adapters() else ""
    config = tiny_config()
    weights = random_weights(config, seed=5)
    logits = {}
    for choice in ("system", "swiftshader"):
        monkeypatch.setenv(browser.ADAPTER_ENV, choice)
        registry, engine = browser_registry()
        device = registry.engine("wgpu").open(0)
        try:
            hello = engine.backend(device.info).adapter  # type: ignore[attr-defined]
            if choice == "system":
                assert hello["backend"] == "openGLES" and hello["description"].startswith("ANGLE ("), hello
                if native.startswith("llvmpipe"):
                    assert "llvmpipe" in hello["description"], "ANGLE runs on the native device's lavapipe"
            else:
                assert hello["architecture"] == "swiftshader" and hello["fallback"] is True, hello
            runner = ModelRunner(config, weights.items(), device, page_size=4, max_cached_tokens=64)
            logits[choice] = runner.step([SequenceWork(runner.new_sequence(), [1, 2, 3])])
            runner.close()
        finally:
            engine.close(device.info)
    np.testing.assert_allclose(logits["system"], logits["swiftshader"], rtol=1e-4, atol=1e-4)


def test_naming_a_browser_selects_it() -> None:
    found = browser.find_browser()
    status, reason, names, _ = run_python(PROBE, PIE_WGPU_BROWSER=found.executable)
    assert status == "ok" and names[0].startswith("browser ("), reason


def test_off_hides_the_browser_device() -> None:
    _, _, names, _ = run_python(PROBE, PIE_WGPU_BROWSER="off")
    assert not any(name.startswith("browser") for name in names)


def test_a_missing_browser_asked_for_is_reported_with_the_fix() -> None:
    status, reason, _, _ = run_python(PROBE, PIE_WGPU_BROWSER="/nonexistent/chromium")
    assert status == "broken"
    assert "PIE_WGPU_BROWSER=/nonexistent/chromium: no such executable" in reason
    if sys.platform.startswith("linux"):
        assert "apt-get install chromium" in reason


def test_a_browser_that_cannot_start_is_reported_by_pie_engines(tmp_path: Path) -> None:
    fake = tmp_path / "chromium"
    fake.write_text('#!/bin/sh\n[ "$1" = --version ] && echo "Chromium 1.0" && exit 0\necho no display >&2\nexit 1\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    env = {"PIE_WGPU_BROWSER": str(fake), "PIE_WGPU_BROWSER_TIMEOUT": "20", "PIE_PROBE_CACHE": str(tmp_path / "p")}
    status, reason, _, _ = run_python(PROBE, **env)
    assert status == "broken" and "the browser device cannot start" in reason, reason
    assert f"{fake} did not start" in reason and "it said: no display" in reason, reason
    assert "Call log" not in reason, "the reason is one line, not playwright's whole log"
    shown = run_pie(["engines"], env)
    assert shown.returncode == 0, shown.stderr
    (row,) = [line for line in shown.stdout.splitlines() if line.startswith("wgpu ")]
    assert " broken " in row and "the browser device cannot start" in shown.stdout, shown.stdout
    assert "it said: no display" in shown.stdout, shown.stdout


def test_attaching_needs_a_devtools_endpoint_on_this_machine() -> None:
    with pytest.raises(browser.BrowserUnavailable, match="not a DevTools endpoint on this machine"):
        browser.find_browser({browser.BROWSER_URL_ENV: "http://example.com:9222"})


def test_doctor_starts_the_browser_and_names_its_adapter() -> None:
    found = browser_diagnosis()
    assert found.ok and found.what == "browser", found
    assert "WebGPU adapter" in found.detail and "PIE_WGPU_DEVICE=browser" in found.detail
    chosen = browser.chosen_adapter(os.environ, attached=False)
    assert f"{chosen.name} adapter ({chosen.description})" in found.detail, found.detail
    assert "PIE_WGPU_BROWSER_ADAPTER=" in found.detail, "doctor says how to ask for the other adapters"


def test_doctor_says_how_to_get_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(browser, "installed", lambda name: name != "playwright")
    found = browser_diagnosis()
    assert not found.ok and "playwright not installed" in found.detail
    assert found.fix == "pip install 'pie-engine-wgpu[browser]'"
    monkeypatch.undo()
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    found = browser_diagnosis()
    assert not found.ok and "no Chromium-family browser found" in found.detail
    if sys.platform.startswith("linux"):
        assert found.fix == "sudo apt-get install chromium"


def test_the_page_and_the_wire_format_agree() -> None:
    script = (STATIC / "host.js").read_text(encoding="utf-8")
    for op in Op:
        assert f"  {op.name}: {op.value}," in script, op
    for kind in Frame:
        assert f"{kind.name}: {kind.value}" in script, kind
    assert f"const FRAME_HEADER_BYTES = {FRAME_HEADER_BYTES};" in script


def test_attaching_to_a_running_browser_opens_and_closes_only_its_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    executable = browser.find_browser().executable
    args = [executable, "--headless=new", "--no-sandbox", "--enable-unsafe-webgpu", "--remote-debugging-port=0",
            f"--user-data-dir={tmp_path}", "--no-first-run", "about:blank"]  # fmt: skip
    theirs = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        port_file = tmp_path / "DevToolsActivePort"
        deadline = time.monotonic() + 30
        while not port_file.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        port = port_file.read_text().split()[0]
        monkeypatch.setenv(browser.BROWSER_URL_ENV, f"http://127.0.0.1:{port}")
        registry, engine = browser_registry()
        device = registry.engine("wgpu").open(0)
        assert device.info.name.startswith(f"browser (attached at http://127.0.0.1:{port}, chromium adapter: ")
        np.testing.assert_array_equal(_add(device), np.full((4, 8), 2, np.float32))
        engine.close(device.info)
        assert theirs.poll() is None, "closing the device closed the user's browser"
    finally:
        os.killpg(theirs.pid, signal.SIGKILL)
        theirs.wait(30)


@pytest.mark.slow
def test_pie_run_on_the_browser_device_answers_the_question(tmp_path: Path) -> None:
    env = {"PIE_WGPU_DEVICE": "browser", "PIE_PROBE_CACHE": str(tmp_path / "probes.json")}
    result = run_pie(["run", "--engine", "wgpu", "What is the capital of France?"], env)
    assert result.returncode == 0, result.stderr
    assert "wgpu:0 browser (" in result.stderr, result.stderr
    assert "Paris" in result.stdout, result.stdout


# -- the page's server and the transport -----------------------------------------------------


def test_the_server_answers_only_its_own_page(fresh: tuple[Device, WgpuEngine]) -> None:
    session = session_of(*fresh)
    host, port = session._server.sockets[0].getsockname()[:2]
    assert host == "127.0.0.1"
    with urllib.request.urlopen(session.url, timeout=10) as page:
        policy = page.headers["Content-Security-Policy"]
        assert "host.js" in page.read().decode()
    assert f"connect-src ws://127.0.0.1:{port}" in policy and "script-src 'self'" in policy
    for path in ("/", "/host.js", f"/{'x' * 32}/host.js", session.url.rsplit("/", 2)[1] + "/../host.js"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{port}{path if path.startswith('/') else '/' + path}", timeout=10)
        refused.value.close()
        assert refused.value.code == 404, path

    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    for origin in (f"http://127.0.0.1:{port}", "http://evil.example"):
        with pytest.raises(InvalidStatus) as rejected:
            connect(session.url.replace("http:", "ws:") + "socket", origin=origin, open_timeout=10)  # type: ignore[arg-type]
        assert rejected.value.response.status_code == 403


def test_a_decode_step_sends_indices_and_gets_logits_back(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    config = tiny_config()
    weights = random_weights(config, seed=2)
    runner = ModelRunner(config, weights.items(), device, page_size=4, max_cached_tokens=64)
    weight_bytes = sum(a.nbytes for a in weights.values())
    sequence = runner.new_sequence()
    runner.step([SequenceWork(sequence, [1, 2, 3])])
    before = session.exchanges, session.bytes_sent, session.bytes_received
    runner.step([SequenceWork(sequence, [4])])
    after = session.exchanges, session.bytes_sent, session.bytes_received
    exchanges, sent, received = (now - then for now, then in zip(after, before, strict=True))
    assert exchanges == 1, "a decode step is one message and one answer"
    assert received == 4 * config.vocab_size, "the answer is the logits"
    assert sent < weight_bytes / 4, f"a step sent {sent} bytes; the weights are {weight_bytes}"
    runner.close()


# -- failures --------------------------------------------------------------------------------


def _add(device: Device) -> np.ndarray:
    a = device.upload(np.ones((4, 8), np.float32))
    return device.download(device.compile("add")(a, a))


def _fails_fast(device: Device, match: str) -> None:
    start = time.monotonic()
    with pytest.raises(BrowserLost, match=match) as lost:
        _add(device)
    assert isinstance(lost.value, DeviceLost), "gone for good: pie serve stops serving rather than fail every request"
    with pytest.raises(BrowserLost, match=match):  # and stays failed, at once
        _add(device)
    assert time.monotonic() - start < 60


def _until_broken(session: PageSession) -> None:
    deadline = time.monotonic() + 30
    while not session.broken and time.monotonic() < deadline:
        time.sleep(0.05)


def test_the_page_crashing_is_an_error_naming_it(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    np.testing.assert_array_equal(_add(device), np.full((4, 8), 2, np.float32))

    async def crash() -> None:
        cdp = await session.page.context.new_cdp_session(session.page)
        await cdp.send("Page.crash")  # never answered: the page is gone

    asyncio.run_coroutine_threadsafe(crash(), session._loop)
    _until_broken(session)
    _fails_fast(device, "page crashed")


def test_the_page_being_closed_is_an_error_naming_it(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    session.run(session.page.close(), timeout=20)
    _fails_fast(device, "page was closed")


def test_the_browser_crashing_is_an_error_naming_it(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)

    async def crash() -> None:
        cdp = await session.browser.new_browser_cdp_session()
        try:
            await cdp.send("Browser.crash")
        except Exception:
            pass

    session.run(crash(), timeout=20)
    _until_broken(session)
    _fails_fast(device, "browser exited|connection to pie closed|page was closed")


def test_the_adapter_lost_mid_run_is_an_error_naming_it(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)

    async def crash_gpu() -> None:
        cdp = await session.browser.new_browser_cdp_session()
        await cdp.send("Browser.crashGpuProcess")

    session.run(crash_gpu(), timeout=20)
    _until_broken(session)
    _fails_fast(device, "WebGPU device was lost")


def test_a_page_that_stops_answering_is_an_error_after_the_timeout(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    session.timeout = 3.0
    # The next message the page takes keeps it busy for 20 s (busy from now on would race that message).
    session.run(session.page.evaluate(HANG_ON_THE_NEXT_MESSAGE), timeout=20)
    _fails_fast(device, "did not answer within 3 s .*PIE_WGPU_BROWSER_TIMEOUT")


def test_a_call_on_a_socket_just_closed_is_an_error_naming_it(
    fresh: tuple[Device, WgpuEngine], caplog: pytest.LogCaptureFixture
) -> None:
    """The socket closes a moment before the session learns why (the browser's event, or SETTLE_S): a call in that
    moment got websockets' ConnectionClosedOK, and asyncio logged the answer it had waited for as "Future exception
    was never retrieved"."""
    device, engine = fresh
    session = session_of(device, engine)
    session.run(session._socket.close(), timeout=20)
    _fails_fast(device, "the page's connection to pie closed")
    session.run(asyncio.sleep(0))  # the loop has run what the failure left for it
    gc.collect()
    assert "never retrieved" not in caplog.text


def test_a_reload_is_an_error_naming_it(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    session.run(session.page.reload(), timeout=30)
    _fails_fast(device, "page was reloaded")


def test_a_buffer_larger_than_the_adapter_takes_is_refused_and_the_device_goes_on(
    fresh: tuple[Device, WgpuEngine],
) -> None:
    """Asked for it, the page's device reported an error and was lost for good; past 4 GiB the wire format failed
    with a bare struct.error."""
    device, engine = fresh
    backend = engine.backend(device.info)
    limit = int(session_of(device, engine).hello["limits"]["max_buffer_size"])
    for nbytes in (limit + 4, 5 << 30):
        with pytest.raises(EngineError, match=rf"a buffer of \d+ bytes .*max buffer size {min(limit, 2**32 - 1)} "):
            backend.zeros((nbytes // 4,), np.dtype(np.float32))
    np.testing.assert_array_equal(_add(device), np.full((4, 8), 2, np.float32))


HANG_ON_THE_NEXT_MESSAGE = """() => {
  const real = handle;
  handle = (data) => {
    const end = Date.now() + 20000;
    while (Date.now() < end) {}
    return real(data);
  };
}"""


def test_the_scheduler_fails_the_passes_in_flight_and_goes_on(fresh: tuple[Device, WgpuEngine]) -> None:
    device, engine = fresh
    session = session_of(device, engine)
    config = tiny_config()
    runner = ModelRunner(config, random_weights(config, seed=4).items(), device, page_size=4, max_cached_tokens=64)
    core = BatchScheduler(runner)
    outcomes: list[list[Any]] = [[], []]
    sequences = [core.new_sequence() for _ in outcomes]
    for seq, outcome in zip(sequences, outcomes, strict=True):
        core.submit(seq, [1, 2, 3], lambda logits, error, out=outcome: out.append(error or logits))
    assert core.step() and all(isinstance(o[0], np.ndarray) for o in outcomes)
    session.run(session.page.close(), timeout=20)
    for seq, outcome in zip(sequences, outcomes, strict=True):
        core.submit(seq, [4], lambda logits, error, out=outcome: out.append(error or logits))
    assert core.step()
    for seq, outcome in zip(sequences, outcomes, strict=True):
        assert isinstance(outcome[1], BrowserLost) and "page was closed" in str(outcome[1])
        assert seq.history == [1, 2, 3], "the failed pass is rolled back"
    assert not core.has_work()


KILLED = """
import os, sys, time
from pie.plugins import EngineRegistry

EngineRegistry().engine("wgpu").open(0).synchronize()
children = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        parent = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1]
    except OSError:
        continue
    children.setdefault(parent, []).append(pid)
todo, found = [str(os.getpid())], []
while todo:
    below = children.get(todo.pop(), [])
    found += below
    todo += below
print(" ".join(found), flush=True)
time.sleep(120)
"""


def test_a_killed_pie_leaves_no_browser_behind() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc")
    env = {**os.environ, "PIE_WGPU_DEVICE": "browser"}
    child = subprocess.Popen([sys.executable, "-c", KILLED], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        descendants = [int(p) for p in line.split()]
        assert len(descendants) >= 2, f"the browser's processes were not found: {line!r}"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(30)
    deadline = time.monotonic() + 30
    alive = descendants
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    assert not alive, f"processes left running after pie was killed: {alive}"


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as found:
            return found.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
