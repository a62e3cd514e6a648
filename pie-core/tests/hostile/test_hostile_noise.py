"""What `pie` prints must be its own: no driver noise that reads like a failure of pie (while a real
driver error still shows), and no help text eaten by the markup renderer."""

from __future__ import annotations

from pathlib import Path

import pytest
from pie_process import assert_ok, assert_user_error, run_pie

from pie.testing.models import make_gguf_model

MESA_NOISE = "XDG_RUNTIME_DIR"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


@pytest.fixture
def quiet_env(pie_env: dict[str, str]) -> dict[str, str]:
    """Every engine probed afresh, with no XDG_RUNTIME_DIR (as under a service manager or in a container)."""
    return {**pie_env, "PIE_ENGINES": "", "XDG_RUNTIME_DIR": ""}


@pytest.mark.parametrize("args", [("engines",), ("doctor",), ("profile", "list")], ids=" ".join)
def test_probing_vulkan_and_wgpu_prints_no_mesa_noise(quiet_env: dict[str, str], args: tuple[str, ...]) -> None:
    result = run_pie(*args, env=quiet_env, timeout=300)
    assert_ok(result)
    assert MESA_NOISE not in result.stderr, result


def test_running_on_wgpu_prints_no_mesa_noise(quiet_env: dict[str, str], tiny_model: Path) -> None:
    env = {**quiet_env, "PIE_ENGINES": "wgpu"}
    result = run_pie("run", "Hi", "--model", str(tiny_model), "--max-tokens", "3", env=env, timeout=300)
    assert_ok(result, "[wgpu:0")
    assert MESA_NOISE not in result.stderr, result


def test_a_real_driver_error_is_still_shown(quiet_env: dict[str, str], tiny_model: Path) -> None:
    env = {**quiet_env, "PIE_ENGINES": "wgpu", "PIE_WGPU_DEVICE": "no-such-adapter"}
    result = run_pie("run", "Hi", "--model", str(tiny_model), env=env, timeout=300)
    assert_user_error(result, "engine 'wgpu' cannot start", "PIE_WGPU_DEVICE='no-such-adapter' matches no adapter")


def test_brackets_in_help_are_shown(pie_env: dict[str, str]) -> None:
    assert_ok(run_pie("profile", "plot", "--help", env=pie_env), "pie-core[plot]")
