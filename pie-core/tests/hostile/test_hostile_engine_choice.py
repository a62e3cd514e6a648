"""`PIE_ENGINES` against `--engine`: the flag wins over the variable."""

from __future__ import annotations

from pathlib import Path

import pytest
from pie_process import assert_ok, run_pie

from pie.testing.models import make_gguf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


def test_the_engine_flag_wins_over_pie_engines(pie_env: dict[str, str], tiny_model: Path) -> None:
    args = ("run", "Hi", "--model", str(tiny_model), "--engine", "cpu", "--max-tokens", "3")
    result = run_pie(*args, env={**pie_env, "PIE_ENGINES": "wgpu"}, timeout=300)
    assert_ok(result, "[cpu:0", "engine 'cpu' was asked for, which wins over PIE_ENGINES=wgpu")
