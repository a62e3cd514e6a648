"""A hostile native kernel cache: the CPU engine's compiled library truncated, corrupted, emptied, or left
half-built by a killed compile. `pie run` and `pie doctor` must rebuild it, never load it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pie_process import assert_ok, run_pie

from pie.testing.models import make_gguf_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


@pytest.fixture
def native_env(pie_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`pie` with a cache folder of its own (platformdirs follows XDG_CACHE_HOME)."""
    return {**pie_env, "XDG_CACHE_HOME": str(tmp_path / "cache")}


def _native(env: dict[str, str]) -> Path:
    return Path(env["XDG_CACHE_HOME"]) / "pie" / "native"


def _library(env: dict[str, str]) -> Path:
    (library,) = _native(env).glob("pie-native-*.so")
    return library


def _run(env: dict[str, str], model: Path) -> None:
    result = run_pie("run", "Hello", "--model", str(model), "--max-tokens", "3", "--no-chat", env=env, timeout=300)
    assert_ok(result, "[cpu:0")


def _truncate(library: Path) -> None:
    data = library.read_bytes()
    library.write_bytes(data[: len(data) // 4])


def _corrupt(library: Path) -> None:
    """Undefined instructions (ud2) over the middle half of the file, where the code is."""
    data = bytearray(library.read_bytes())
    quarter = len(data) // 4
    data[quarter : 3 * quarter] = b"\x0f\x0b" * quarter
    library.write_bytes(bytes(data))


def _empty(library: Path) -> None:
    library.write_bytes(b"")


def _forget_record(library: Path) -> None:
    library.with_name(library.name + ".json").unlink()


@pytest.mark.parametrize("damage", [_truncate, _corrupt, _empty, _forget_record], ids=lambda f: f.__name__[1:])
def test_a_damaged_library_is_built_again_not_loaded(native_env: dict[str, str], tiny_model: Path, damage) -> None:
    _run(native_env, tiny_model)
    library = _library(native_env)
    good = library.read_bytes()
    damage(library)
    _run(native_env, tiny_model)
    assert _library(native_env).stat().st_size == len(good), "the damaged library was not built again"
    record = json.loads(library.with_name(library.name + ".json").read_text())
    assert record["size"] == len(good)
    damage(library)
    assert_ok(run_pie("doctor", env=native_env, timeout=300), "[ok] native kernels: built with")


def test_scratch_folders_of_killed_builds_are_removed(native_env: dict[str, str], tiny_model: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = _native(native_env)
    killed = folder / f".build-{gone.stdout.strip()}-x1y2"  # its process has ended
    old = folder / "tmpk3v9q0"  # the scratch folder an older version left
    for scratch in (killed, old):
        scratch.mkdir(parents=True)
        (scratch / "native.c").write_text("int half_written;")
    hour_ago = time.time() - 2 * 3600
    os.utime(old, (hour_ago, hour_ago))
    _run(native_env, tiny_model)
    assert not killed.exists() and not old.exists()
    assert [p.name for p in folder.iterdir() if p.is_dir()] == []
