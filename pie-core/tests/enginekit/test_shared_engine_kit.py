"""The engine-independent parts of the shader kit: device ordering and selection, the hooks' shared answers,
the pooled backend (over an in-memory device), and finding a Chromium-family browser."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pie.contract import DeviceInfo, KernelRequest, PageLayout, RegionRequest
from pie.enginekit.devices import KIND_RANK, put_first
from pie.enginekit.engine import DeviceEngine, ShaderEngine
from pie.enginekit.shaders import chromium, hooks
from pie.enginekit.shaders.chromium import BrowserUnavailable
from pie.enginekit.shaders.pooled import PLACEHOLDER_BYTES, PooledBackend
from pie.plugins import EngineError, EngineSettingError, env_seconds
from pie.weights import StoredWeight
from test_described_layers import block, layer

# -- device ordering and selection ------------------------------------------------------------


def test_devices_sort_discrete_first_and_cpu_last() -> None:
    kinds = ["cpu", "other", "virtual-gpu", "gpu", "integrated-gpu"]
    assert sorted(kinds, key=KIND_RANK.__getitem__) == ["gpu", "integrated-gpu", "virtual-gpu", "cpu", "other"]


def test_put_first_takes_an_index_or_a_name_in_any_case() -> None:
    names = ["NVIDIA RTX", "llvmpipe (LLVM 15)", "browser"]
    assert put_first(names, "2", str, "PIE_X_DEVICE", "device") == ["browser", "NVIDIA RTX", "llvmpipe (LLVM 15)"]
    assert put_first(names, "LLVMPIPE", str, "PIE_X_DEVICE", "device")[0] == "llvmpipe (LLVM 15)"
    assert put_first(names, "0", str, "PIE_X_DEVICE", "device") == names


def test_put_first_names_the_variable_when_nothing_matches() -> None:
    # The user's setting, theirs to correct: not a reason to choose another engine.
    with pytest.raises(EngineSettingError, match=r"^PIE_X_DEVICE=3: only 2 Vulkan device\(s\) found$"):
        put_first(["a", "b"], "3", str, "PIE_X_DEVICE", "Vulkan device")
    with pytest.raises(EngineSettingError, match=r"PIE_X_DEVICE='gpu' matches no adapter \(found: a, b\)"):
        put_first(["a", "b"], "gpu", str, "PIE_X_DEVICE", "adapter")
    with pytest.raises(EngineSettingError, match=r"\(found: none\)"):
        put_first([], "gpu", str, "PIE_X_DEVICE", "adapter")


# -- the hooks' shared answers ------------------------------------------------------------------


def test_engine_info_ranks_a_host_without_gpu_drivers_below_the_cpu_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    for hardware, expected in ((True, 50), (False, -20)):
        monkeypatch.setattr(hooks, "may_have_hardware_gpu", lambda hardware=hardware: hardware)
        info = hooks.shader_engine_info("wgpu", "wgsl", "what it is", 50, -20)
        assert (info.name, info.priority, info.kernel_languages, info.description) == (
            "wgpu",
            expected,
            ("wgsl",),
            "what it is",
        )


def test_shipped_entry_names_only_for_catalogue_kernels() -> None:
    names = hooks.shipped_entry_names(KernelRequest("rms_norm_linear"))
    assert "rms_norm_linear__rows" in names and all(n.startswith("rms_norm_linear__") for n in names)
    assert hooks.shipped_entry_names(KernelRequest("no_such_kernel")) == []
    assert hooks.shipped_entry_names(KernelRequest("epilogue")) == []
    assert hooks.shipped_entry_names(RegionRequest("L0.attn", (), (), ())) == []


# -- the pooled backend -------------------------------------------------------------------------


class MemoryBackend(PooledBackend):
    """Buffers are bytearrays; a submission is the list of what was recorded and the uniform blocks."""

    def __init__(self, uniform_alignment: int = 64, params_capacity: int = 160):
        self.recorded: list[tuple[Any, ...]] = []
        self.submissions: list[tuple[list[tuple[Any, ...]], bytes]] = []
        self.created: list[int] = []
        super().__init__(16, 1 << 20, uniform_alignment, params_capacity, 4 << 20)

    def _create_buffer(self, capacity: int) -> bytearray:
        self.created.append(capacity)
        return bytearray(capacity)

    def _destroy_buffer(self, buffer: Any) -> None:
        pass

    def _clear(self, buffer: bytearray, size: int) -> None:
        self.recorded.append(("clear", size))
        buffer[:size] = bytes(size)

    def _write(self, buffer: bytearray, offset: int, data: np.ndarray) -> None:
        self.recorded.append(("write", offset, data.nbytes))
        buffer[offset : offset + data.nbytes] = data.tobytes()

    def _read(self, ranges: list[tuple[Any, int, int]]) -> np.ndarray:
        return np.frombuffer(b"".join(bytes(b[o : o + n]) for b, o, n in ranges), np.uint8).copy()

    def flush(self) -> None:
        self.submissions.append((self.recorded, bytes(self._take_params())))
        self.recorded = []

    def dispatch(self, *args: Any) -> None:
        raise AssertionError("not used here")


def test_uniform_blocks_lie_at_the_alignment_and_a_full_buffer_is_sent_first() -> None:
    backend = MemoryBackend(uniform_alignment=64, params_capacity=160)
    blocks = [bytes([n]) * 16 for n in range(1, 5)]
    assert [backend._place_params(block) for block in blocks[:3]] == [0, 64, 128]
    assert backend.submissions == []
    assert backend._place_params(blocks[3]) == 0, "the fourth (at 192) does not fit: it starts the next submission"
    ((_, sent),) = backend.submissions
    assert sent == blocks[0] + bytes(48) + blocks[1] + bytes(48) + blocks[2]
    backend.flush()
    assert backend.submissions[-1][1] == blocks[3]


def test_the_placeholder_and_tensors_come_from_the_pool() -> None:
    backend = MemoryBackend()
    buffer, offset, size = backend.placeholder
    assert (len(buffer), offset, size) == (PLACEHOLDER_BYTES, 0, PLACEHOLDER_BYTES)
    tensor = backend.zeros((3, 5), np.dtype(np.float32))
    assert backend.recorded == [("clear", tensor.capacity)] and tensor.capacity % 256 == 0
    del tensor
    again = backend.empty((2, 7), np.dtype(np.float32))
    assert backend.created == [PLACEHOLDER_BYTES, 256], "the dropped tensor's buffer is reused"
    assert again.shape == (2, 7)


def test_uploads_are_whole_words_and_read_back_exactly() -> None:
    backend = MemoryBackend()
    data = np.arange(7, dtype=np.uint8)
    tensor = backend.upload(data)
    assert backend.recorded == [("write", 0, 8)]
    np.testing.assert_array_equal(backend.download(tensor), data)
    assert backend.upload(np.zeros((0, 4), np.float32)).shape == (0, 4) and len(backend.recorded) == 1


def test_page_writes_land_region_by_region() -> None:
    backend = MemoryBackend()
    pool = backend.zeros((2, 4, 2, 1, 1, 2), np.dtype(np.float32))  # 2 layers, 4 pages of 16 bytes
    pages = np.arange(2 * 2 * 2 * 2, dtype=np.float32).reshape(2, 2, 2, 1, 1, 2) + 1
    backend.write_pages(pool, np.array([3, 1]), pages)
    assert backend.recorded[1:] == [("write", 48, 16), ("write", 16, 16), ("write", 112, 16), ("write", 80, 16)]
    np.testing.assert_array_equal(backend.read_pages(pool, np.array([3, 1])), pages)
    assert not backend.read_pages(pool, np.array([0, 2])).any()


# -- what a shader engine bounds ----------------------------------------------------------------


class MemoryEngine(ShaderEngine):
    """The shared hooks over one :class:`MemoryBackend` (largest storage binding 1 MiB, offsets aligned to 16, largest
    buffer 4 MiB)."""

    name = "memory"

    def open_backend(self, device: DeviceInfo) -> MemoryBackend:  # type: ignore[override]
        return MemoryBackend()


MEMORY_DEVICE = DeviceInfo("memory", 0, "bytearrays", "test", "none", "cpu", 0)


def test_one_layer_of_a_page_pool_may_take_a_binding_less_its_offset_alignment() -> None:
    """``append_kv`` and ``attention`` bind a layer's pages as one range, which may start up to 16 bytes early."""
    engine = MemoryEngine()
    limit = engine.pie_max_page_pool_layer_bytes(MEMORY_DEVICE)
    assert limit == (1 << 20) - 16
    layout = PageLayout(num_layers=2, num_pages=1, page_size=16, num_kv_heads=2, head_dim=64)  # 16 KiB a layer a page
    fits = replace(layout, num_pages=limit // layout.layer_bytes)
    engine.pie_free_pages(MEMORY_DEVICE, engine.pie_allocate_pages(MEMORY_DEVICE, fits))
    with pytest.raises(EngineError, match=r"^the memory engine binds at most 1048560 bytes of one layer's KV pages on "
                                          r"memory:0: 64 pages of 16 tokens take 1048576 bytes a layer \(at most 63 "
                                          r"pages fit\)$"):
        engine.pie_allocate_pages(MEMORY_DEVICE, replace(layout, num_pages=64))


def test_a_page_pool_is_one_buffer_of_at_most_the_devices_largest() -> None:
    """wgpu's device, asked for a larger buffer, reported a validation error (`pie run`: an internal error)."""
    engine = MemoryEngine()
    assert engine.pie_max_page_pool_bytes(MEMORY_DEVICE) == 4 << 20
    layout = PageLayout(num_layers=8, num_pages=32, page_size=16, num_kv_heads=2, head_dim=64)  # 512 KiB a layer
    engine.pie_free_pages(MEMORY_DEVICE, engine.pie_allocate_pages(MEMORY_DEVICE, layout))
    backend = engine.backend(MEMORY_DEVICE)
    created = len(backend.created)  # type: ignore[attr-defined]
    with pytest.raises(EngineError, match=r"^a buffer of 4325376 bytes is more than the device takes \(max buffer "
                                          r"size 4194304 bytes\); it was refused before reaching the device"):
        engine.pie_allocate_pages(MEMORY_DEVICE, replace(layout, num_pages=33))
    assert len(backend.created) == created, "nothing asked of the device"  # type: ignore[attr-defined]


def test_a_weight_no_launch_binds_is_refused_before_any_is_uploaded() -> None:
    """Projections and embeddings bind a weight larger than one binding in chunks of its rows; a weight whose row is
    larger than a binding, or which is larger than a buffer, no kernel runs: it loaded, and every step failed (`pie
    serve` answered each request with a 500)."""
    engine = MemoryEngine()
    past_a_binding = np.zeros((257, 1024), np.float32)  # 1 MiB and a row: chunks of 256 rows
    stored = StoredWeight("q8_0", (31, 32768), np.zeros((31, 32768 // 32 * 34), np.uint8))  # 34 bytes a block of 32
    assert len(engine.pie_upload_weights(MEMORY_DEVICE, [past_a_binding, stored])) == 2
    created = len(engine.backend(MEMORY_DEVICE).created)  # type: ignore[attr-defined]
    with pytest.raises(EngineError, match=r"^the memory engine binds at most 1048576 bytes of one weight on memory:0: "
                                          r"a 2x262145 weight of float32 takes 2097160 bytes \(use --dtype float16, "
                                          r"or --engine cpu or xla\)$"):
        engine.pie_upload_weights(MEMORY_DEVICE, [past_a_binding[:1], np.zeros((2, 262145), np.float32)])
    wide = StoredWeight("q8_0", (2, 1 << 20), np.zeros((2, (1 << 20) // 32 * 34), np.uint8))  # 1,114,112 bytes a row
    with pytest.raises(EngineError, match=r"a 2x1048576 weight of q8_0 takes 2228228 bytes \(use --engine cpu or "):
        engine.pie_upload_weights(MEMORY_DEVICE, [wide])
    with pytest.raises(EngineError, match=r"^the memory engine holds at most 4194304 bytes of one weight on memory:0: "
                                          r"a 1025x1024 weight of float32 takes 4198400 bytes"):
        engine.pie_upload_weights(MEMORY_DEVICE, [np.zeros((1025, 1024), np.float32)])  # past one buffer
    assert len(engine.backend(MEMORY_DEVICE).created) == created, "nothing uploaded"  # type: ignore[attr-defined]


def test_an_engine_of_the_kit_with_its_own_kernels_states_no_bound() -> None:
    assert DeviceEngine().page_pool_layer_bound(MEMORY_DEVICE) is None
    assert not hasattr(DeviceEngine, "pie_max_page_pool_layer_bytes"), "not implemented: no bound (Metal, CUDA)"
    assert not hasattr(DeviceEngine, "pie_max_page_pool_bytes")


def test_a_layer_whose_head_dim_the_attention_cannot_take_is_refused_when_its_block_compiles() -> None:
    """Before the weights load: the model loaded whole, and failed at its first step."""
    engine, wide = MemoryEngine(), replace(layer(0), head_dim=512)
    with pytest.raises(EngineError, match=r"^engine 'memory' runs attention with head_dim up to 256; this model's is "
                                          r"512 \(use --engine cpu or xla\)$"):
        engine.pie_compile_block(MEMORY_DEVICE, block(wide))
    assert engine.pie_compile_block(MEMORY_DEVICE, block(replace(wide, head_dim=256))) is None, "left to the regions"
    assert DeviceEngine().pie_compile_block(MEMORY_DEVICE, block(wide)) is None, "no bound stated"


# -- finding a browser ---------------------------------------------------------------------------


def _script(folder: Path, name: str, body: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


needs_posix_sh = pytest.mark.skipif(sys.platform == "win32", reason="runs /bin/sh scripts")


@needs_posix_sh
def test_a_named_browser_must_be_an_executable_file(tmp_path: Path) -> None:
    browser = _script(tmp_path, "my-chromium", "exit 0\n")
    assert chromium.find_executable(str(browser), "PIE_X_BROWSER") == str(browser)
    for wrong in (tmp_path / "missing", tmp_path):
        with pytest.raises(BrowserUnavailable, match=f"PIE_X_BROWSER={wrong}: no such executable") as raised:
            chromium.find_executable(str(wrong), "PIE_X_BROWSER")
        assert raised.value.fix == chromium.browser_fix() and raised.value.setting  # the user's to correct


@needs_posix_sh
def test_without_a_name_the_first_command_on_path_is_taken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(chromium, "MAC_APPS", ())
    with pytest.raises(BrowserUnavailable, match="no Chromium-family browser found") as raised:
        chromium.find_executable("", "PIE_X_BROWSER")
    assert not raised.value.setting, "no browser installed is no setting of the user's"
    _script(tmp_path, "google-chrome", "exit 0\n")
    second = _script(tmp_path, "chromium-browser", "exit 0\n")
    assert chromium.find_executable("", "PIE_X_BROWSER") == str(second)


@needs_posix_sh
def test_the_version_is_what_the_browser_says_or_why_it_did_not_run(tmp_path: Path) -> None:
    good = _script(tmp_path, "good", 'echo "Chromium 156.0.8078.114 built on Debian GNU/Linux 12"\n')
    assert chromium.browser_version(str(good)) == "Chromium 156.0.8078.114"
    bad = _script(tmp_path, "bad", "echo starting >&2\necho missing libnss3.so >&2\nexit 127\n")
    with pytest.raises(BrowserUnavailable, match="--version exited with 127: missing libnss3.so"):
        chromium.browser_version(str(bad))
    with pytest.raises(BrowserUnavailable, match="--version failed"):
        chromium.browser_version(str(tmp_path / "absent"))


def test_a_devtools_endpoint_must_be_on_this_machine() -> None:
    for url in ("http://127.0.0.1:9222", "ws://localhost:9222/devtools/browser/x", "http://[::1]:9222"):
        chromium.check_devtools_endpoint(url, "PIE_X_URL")
    for url in ("http://example.com:9222", "file:///tmp/x", "https://127.0.0.1:9222"):
        with pytest.raises(BrowserUnavailable, match="is not a DevTools endpoint on this machine") as raised:
            chromium.check_devtools_endpoint(url, "PIE_X_URL")
        assert raised.value.setting


def test_a_failed_launch_is_one_line_with_what_the_browser_said() -> None:
    message = (
        "BrowserType.launch: Target page, context or browser has been closed\n"
        "Browser logs:\n<launching> /usr/bin/chromium --headless=new\n"
        "  - [pid=12][err] first\n  - [pid=12][err] missing X server\n  - [pid=12][err] missing X server\n"
    )
    line = chromium.launch_failure(RuntimeError(message), "/usr/bin/chromium", lines=4)
    assert line == (
        "/usr/bin/chromium did not start (BrowserType.launch: Target page, context or browser has been closed);"
        " it said: first | missing X server"
    )
    attached = chromium.launch_failure(ValueError(""), "", "http://127.0.0.1:9222")
    assert attached == "attaching to http://127.0.0.1:9222 (ValueError)"


def test_timeouts_are_seconds_above_zero() -> None:
    assert env_seconds({}, "PIE_X_TIMEOUT", 120.0) == 120.0
    assert env_seconds({"PIE_X_TIMEOUT": " 2.5 "}, "PIE_X_TIMEOUT", 120.0) == 2.5
    for raw in ("0", "-1", "nan", "inf", "soon"):
        with pytest.raises(ValueError, match=f"PIE_X_TIMEOUT='{raw}' is not a number of seconds above 0"):
            env_seconds({"PIE_X_TIMEOUT": raw}, "PIE_X_TIMEOUT", 120.0)


def test_installed_finds_modules_without_importing_them() -> None:
    assert chromium.installed("json")
    assert not chromium.installed("no_such_module_here") and not chromium.installed("no_such_package.module")
    assert "no_such_package" not in sys.modules
