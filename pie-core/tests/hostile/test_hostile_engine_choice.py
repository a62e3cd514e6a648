"""`PIE_ENGINES` against the engines pie-core itself needs, and against `--engine`: an inferlet runs when
`PIE_ENGINES` leaves out the CPU engine (the host page pool is infrastructure), nobody is warned about a
CPU fallback nothing needs, and the `--engine` flag wins over the variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pie_process import assert_ok, assert_user_error, run_pie

from pie.testing.models import make_gguf_model

EXAMPLES = Path(__file__).parents[3] / "examples"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


@pytest.mark.parametrize("engine", ["wgpu", "vulkan"])
def test_an_inferlet_runs_when_pie_engines_leaves_out_the_cpu_engine(
    pie_env: dict[str, str], tiny_model: Path, engine: str
) -> None:
    args = ("run", "--model", str(tiny_model), "--inferlet", str(EXAMPLES / "best_of_n.py"), "--", "Hi", "--n", "2")
    result = run_pie(*args, "--max-tokens", "4", env={**pie_env, "PIE_ENGINES": engine}, timeout=300)
    assert_ok(result, '"best"')
    assert "not in PIE_ENGINES" not in result.output and "no CPU fallback" not in result.output, result


def test_no_fallback_warning_when_every_kernel_runs_natively(pie_env: dict[str, str], tiny_model: Path) -> None:
    env = {**pie_env, "PIE_ENGINES": "wgpu"}
    result = run_pie("run", "Hi", "--model", str(tiny_model), "--max-tokens", "3", env=env, timeout=300)
    assert_ok(result, "[wgpu:0")
    assert "no CPU fallback" not in result.output, result


def test_the_engine_flag_wins_over_pie_engines(pie_env: dict[str, str], tiny_model: Path) -> None:
    args = ("run", "Hi", "--model", str(tiny_model), "--engine", "cpu", "--max-tokens", "3")
    result = run_pie(*args, env={**pie_env, "PIE_ENGINES": "wgpu"}, timeout=300)
    assert_ok(result, "[cpu:0", "engine 'cpu' was asked for, which wins over PIE_ENGINES=wgpu")


@pytest.fixture
def broken_cpu_env(pie_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The CPU engine's module shadowed by one that cannot be imported (a broken installation)."""
    package = tmp_path / "shadow" / "pie_engine_cpu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "plugin.py").write_text('raise ImportError("libacme-blas.so.2: cannot open shared object file")\n')
    path = os.pathsep.join(p for p in (str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")) if p)
    return {**pie_env, "PYTHONPATH": path, "PIE_ENGINES": "wgpu"}


def test_without_a_working_cpu_engine_an_inferlet_says_what_needs_it(
    broken_cpu_env: dict[str, str], tiny_model: Path
) -> None:
    args = ("run", "--model", str(tiny_model), "--inferlet", str(EXAMPLES / "best_of_n.py"), "--", "Hi", "--n", "2")
    result = run_pie(*args, env=broken_cpu_env, timeout=300)
    assert_user_error(result, "engine 'cpu' cannot start", "libacme-blas.so.2", "host page pool", "pie doctor")


def test_without_a_working_cpu_engine_a_complete_engine_runs_without_a_warning(
    broken_cpu_env: dict[str, str], tiny_model: Path
) -> None:
    result = run_pie("run", "Hi", "--model", str(tiny_model), "--max-tokens", "3", env=broken_cpu_env, timeout=300)
    assert_ok(result, "[wgpu:0")
    assert "no CPU fallback" not in result.output, result
