"""A hostile native kernel cache: the CPU engine's compiled library truncated, corrupted, emptied, its cache
entry damaged or gone, or a build killed midway. `pie run` and `pie doctor` must rebuild it, never load it.

The damage cases build a tiny C library through the same path as the real one
(``pie_engine_cpu.native.build_library`` into the engine's compile cache), each in a process of its own
that loads it and calls it; one case damages the real library under `pie run` and `pie doctor`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from pie_process import assert_ok, run_pie

from pie.testing.models import make_gguf_model

TINY_SOURCE = "int pie_answer(void) { return 42; }\n"
BUILD_AND_CALL = """
import ctypes, json, sys
from pathlib import Path
from pie.enginekit.compile_cache import CompileCache
from pie_engine_cpu import native
cache = CompileCache("cpu", Path(sys.argv[1]))
path = native.build_library(sys.argv[2], cache=cache)
answer = ctypes.CDLL(str(path)).pie_answer()
print(json.dumps({"path": str(path), "answer": answer, "misses": cache.stats.misses,
                  "corrupted": cache.stats.corrupted}))
"""


def _build_and_call(folder: Path, env: dict[str, str]) -> dict:
    """Build (or find) the tiny library in ``folder`` in a new process, load it and call it."""
    run = subprocess.run(
        [sys.executable, "-c", BUILD_AND_CALL, str(folder), TINY_SOURCE],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )
    assert run.returncode == 0, f"the build-and-load process failed ({run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(run.stdout)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 4])


def _corrupt(path: Path) -> None:
    """Undefined instructions (ud2) over the middle half of the file, where the code is."""
    data = bytearray(path.read_bytes())
    quarter = len(data) // 4
    data[quarter : 3 * quarter] = b"\x0f\x0b" * quarter
    path.write_bytes(bytes(data))


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _entry(library: Path) -> Path:
    """The checksummed cache entry the library file is written from."""
    return library.with_suffix(".bin")


DAMAGES: list[Callable[[Path], None]] = [_truncate, _corrupt, _empty]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_gguf_model(tmp_path_factory.mktemp("model") / "tiny.gguf", "F32")


@pytest.fixture
def native_env(pie_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """`pie` with a compile cache of its own."""
    return {**pie_env, "PIE_CPU_CACHE_DIR": str(tmp_path / "cpu-kernels")}


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__[1:])
@pytest.mark.parametrize("target", ["library", "entry", "both"])
def test_a_damaged_library_is_built_again_not_loaded(
    native_env: dict[str, str], tmp_path: Path, damage: Callable[[Path], None], target: str
) -> None:
    folder = tmp_path / "cache"
    first = _build_and_call(folder, native_env)
    library = Path(first["path"])
    good = library.read_bytes()
    assert first["answer"] == 42 and first["misses"] == 1
    if target in ("library", "both"):
        damage(library)
    if target in ("entry", "both"):
        damage(_entry(library))
    again = _build_and_call(folder, native_env)
    assert again["answer"] == 42 and Path(again["path"]) == library
    assert library.read_bytes() == good, "the damaged library was loaded, not built again"
    rebuilt = target != "library"
    assert again["misses"] == int(rebuilt), "a damaged entry is compiled again; an intact one restores the file"
    assert again["corrupted"] == int(rebuilt)
    assert _build_and_call(folder, native_env)["misses"] == 0, "the rebuilt entry is whole"


def test_a_library_whose_entry_is_gone_is_built_again(native_env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    library = Path(_build_and_call(folder, native_env)["path"])
    _entry(library).unlink()
    _corrupt(library)  # without its entry nothing vouches for the file
    again = _build_and_call(folder, native_env)
    assert again["misses"] == 1 and again["answer"] == 42 and _entry(library).is_file()


def test_scratch_folders_of_killed_builds_are_removed(native_env: dict[str, str], tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    folder = tmp_path / "cache"
    killed = folder / f".build-{gone.stdout.strip()}-x1y2"  # its process has ended
    old = folder / ".build-1-k3v9q0"  # a live process id (reused), but the folder is hours old
    for scratch in (killed, old):
        scratch.mkdir(parents=True)
        (scratch / "native.c").write_text("int half_written;")
    hour_ago = time.time() - 2 * 3600
    os.utime(old, (hour_ago, hour_ago))
    assert _build_and_call(folder, native_env)["answer"] == 42
    assert not killed.exists() and not old.exists()
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []


def test_concurrent_builds_do_not_corrupt_each_other(native_env: dict[str, str], tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    builds = [
        subprocess.Popen(
            [sys.executable, "-c", BUILD_AND_CALL, str(folder), TINY_SOURCE],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **native_env},
        )
        for _ in range(4)
    ]
    results = []
    for build in builds:
        out, err = build.communicate(timeout=120)
        assert build.returncode == 0, err[-3000:]
        results.append(json.loads(out))
    assert {r["answer"] for r in results} == {42} and len({r["path"] for r in results}) == 1
    assert _build_and_call(folder, native_env)["misses"] == 0, "the entry left behind is whole"
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [], "no scratch or temporary file is left"


def test_the_real_library_is_built_again_under_pie_run_and_doctor(native_env: dict[str, str], tiny_model: Path) -> None:
    native_env = {**native_env, "PIE_PROBE_TIMEOUT": "600"}  # a full build inside the probe, on a loaded machine

    def run() -> None:
        result = run_pie("run", "Hello", "--model", str(tiny_model), "--max-tokens", "3", "--no-chat",
                         env=native_env, timeout=300)
        assert_ok(result, "[cpu:0")

    run()
    (library,) = Path(native_env["PIE_CPU_CACHE_DIR"]).glob("*/*.so")
    good = library.read_bytes()
    _corrupt(library)
    _truncate(_entry(library))
    run()
    assert library.read_bytes() == good, "the damaged library was loaded, not built again"
    _empty(library)
    assert_ok(run_pie("doctor", env=native_env, timeout=300), "[ok] native kernels: built with")
    assert library.read_bytes() == good


@pytest.mark.parametrize("forged", ["another library", "no library"])
def test_an_intact_entry_whose_library_is_wrong_is_built_again_under_pie_run(
    native_env: dict[str, str], tiny_model: Path, tmp_path: Path, forged: str
) -> None:
    """An entry whose checksums hold but whose library lacks the kernels made every `pie run` an internal error
    (AttributeError: undefined symbol) until the cache was deleted by hand; one whose library does not load
    gave up the native kernels, with advice about a noexec mount, and was never built again."""
    from pie.enginekit.compile_cache import CompileCache, _encode

    native_env = {**native_env, "PIE_PROBE_TIMEOUT": "600"}  # a full build inside the probe, on a loaded machine
    args = ("run", "Hello", "--model", str(tiny_model), "--max-tokens", "3", "--no-chat", "--engine", "cpu")
    assert_ok(run_pie(*args, env=native_env, timeout=300), "[cpu:0")
    (library,) = Path(native_env["PIE_CPU_CACHE_DIR"]).glob("*/*.so")
    good = library.read_bytes()
    if forged == "another library":
        other = _build_and_call(tmp_path / "other", native_env)["path"]  # a library with pie_answer only
        wrong = Path(other).read_bytes()
    else:
        wrong = b"\x7fELF, but no library"
    key = library.stem
    _entry(library).write_bytes(_encode({"so": wrong}, key))
    library.write_bytes(wrong)
    assert CompileCache("cpu", library.parent.parent).load(key) == {"so": wrong}, "the forged entry is intact"
    result = run_pie(*args, env=native_env, timeout=300)
    assert_ok(result, "[cpu:0", "cannot be loaded", "building them again")
    assert "noexec" not in result.output
    assert library.read_bytes() == good, "the library was built again"
    assert "building them again" not in run_pie(*args, env=native_env, timeout=300).output
