"""The compile cache: a miss compiles and stores, a hit does not compile, a damaged entry is
detected by its checksum, removed and compiled again; an artifact handed back as a file is never a
damaged one; scratch folders of killed builds are removed."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pie.enginekit import compile_cache
from pie.enginekit.compile_cache import (
    SCRATCH_PREFIX,
    CompileCache,
    cache_dir_env,
    cache_enabled_env,
    cache_key,
    default_cache_dir,
)

ENGINE = "demo"

pytestmark = pytest.mark.usefixtures("system_tmp")  # where an unwritable cache turns: never the machine's own

KEY_PARTS = {"source": "kernel text", "compiler": "cuda/NVRTC", "compiler_version": "13.0", "arch": "sm_90",
             "options": ("--gpu-architecture=sm_90",)}


class CountingCompile:
    def __init__(self, artifacts: dict[str, bytes]):
        self.artifacts = artifacts
        self.calls = 0

    def __call__(self) -> dict[str, bytes]:
        self.calls += 1
        return dict(self.artifacts)


def _entry(tmp_path: Path) -> tuple[CompileCache, str, CountingCompile]:
    cache = CompileCache(ENGINE, tmp_path / "cache", enabled=True)
    return cache, cache_key(**KEY_PARTS), CountingCompile({"ptx": b".version 9.0\n" * 50, "cubin": bytes(range(256)) * 4})


def test_miss_compiles_and_stores_then_hit_reads_it_back(tmp_path: Path) -> None:
    cache, key, compile_fn = _entry(tmp_path)
    first = cache.get_or_compile(key, compile_fn)
    assert compile_fn.calls == 1 and cache.stats.misses == 1
    assert cache.path(key).is_file()
    again = CompileCache(ENGINE, tmp_path / "cache", enabled=True)  # a new process reading the same folder
    second = again.get_or_compile(key, compile_fn)
    assert compile_fn.calls == 1 and again.stats.hits == 1
    assert second == first == compile_fn.artifacts


@pytest.mark.parametrize(
    "damage",
    ["flip_payload_byte", "truncate", "append", "bad_magic", "bad_header", "other_key"],
)
def test_a_damaged_entry_is_detected_and_compiled_again(tmp_path: Path, damage: str) -> None:
    cache, key, compile_fn = _entry(tmp_path)
    cache.get_or_compile(key, compile_fn)
    path = cache.path(key)
    blob = bytearray(path.read_bytes())
    if damage == "flip_payload_byte":
        blob[-100] ^= 0x01
    elif damage == "truncate":
        del blob[-10:]
    elif damage == "append":
        blob += b"junk"
    elif damage == "bad_magic":
        blob[0:3] = b"XXX"
    elif damage == "bad_header":
        start = blob.index(b"{")
        blob[start : start + 1] = b"["
    elif damage == "other_key":
        blob = bytearray(bytes(blob).replace(key.encode(), b"0" * len(key)))
    path.write_bytes(bytes(blob))

    fresh = CompileCache(ENGINE, tmp_path / "cache", enabled=True)
    artifacts = fresh.get_or_compile(key, compile_fn)
    assert fresh.stats.corrupted == 1 and fresh.stats.misses == 1
    assert compile_fn.calls == 2
    assert artifacts == compile_fn.artifacts
    assert CompileCache(ENGINE, tmp_path / "cache", enabled=True).load(key) == compile_fn.artifacts, "the entry was rewritten"


def test_key_changes_with_every_input() -> None:
    base = cache_key(**KEY_PARTS)
    for field, other in (("source", "kernel text 2"), ("compiler", "hip/hiprtc"), ("compiler_version", "13.1"),
                         ("arch", "sm_80"), ("options", ("-O3",))):
        assert cache_key(**{**KEY_PARTS, field: other}) != base, field


def test_directory_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache_dir_env("cuda") == "PIE_CUDA_CACHE_DIR" and cache_enabled_env("cuda") == "PIE_CUDA_CACHE"
    assert default_cache_dir("cuda", {"PIE_CUDA_CACHE_DIR": str(tmp_path)}) == tmp_path
    assert default_cache_dir("cuda", {}).name == "cuda-kernels"
    assert default_cache_dir("cpu", {"PIE_CUDA_CACHE_DIR": str(tmp_path)}).name == "cpu-kernels"
    monkeypatch.setenv("PIE_DEMO_CACHE_DIR", str(tmp_path / "here"))
    monkeypatch.setenv("PIE_DEMO_CACHE", "0")
    cache = CompileCache(ENGINE)
    assert cache.root == tmp_path / "here" and not cache.enabled


def test_a_disabled_cache_always_compiles(tmp_path: Path) -> None:
    cache = CompileCache(ENGINE, tmp_path / "cache", enabled=False)
    key = cache_key(**KEY_PARTS)
    compile_fn = CountingCompile({"so": b"x"})
    cache.get_or_compile(key, compile_fn)
    cache.get_or_compile(key, compile_fn)
    assert compile_fn.calls == 2
    assert not (tmp_path / "cache").exists()


def test_an_unwritable_cache_still_returns_the_artifacts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = CompileCache(ENGINE, blocker / "cache", enabled=True)
    compile_fn = CountingCompile({"so": b"x"})
    assert cache.get_or_compile(cache_key(**KEY_PARTS), compile_fn) == {"so": b"x"}


def test_an_artifact_as_a_file_is_written_once_and_restored_when_damaged(tmp_path: Path) -> None:
    cache, key, compile_fn = _entry(tmp_path)
    path = cache.file(key, "cubin", compile_fn)
    assert path.read_bytes() == compile_fn.artifacts["cubin"] and path.parent == cache.path(key).parent
    written = path.stat().st_mtime_ns
    assert CompileCache(ENGINE, tmp_path / "cache").file(key, "cubin", compile_fn) == path
    assert path.stat().st_mtime_ns == written and compile_fn.calls == 1, "an intact file is neither rewritten nor rebuilt"
    for damage in (b"", compile_fn.artifacts["cubin"][:100], b"\x0f\x0b" * 512):
        path.write_bytes(damage)
        assert CompileCache(ENGINE, tmp_path / "cache").file(key, "cubin", compile_fn) == path
        assert path.read_bytes() == compile_fn.artifacts["cubin"], "a damaged file was handed back"
    assert compile_fn.calls == 1, "the verified entry restores the file without compiling"
    cache.path(key).unlink()  # the entry (the file's record) is gone: the file cannot be trusted
    again = CompileCache(ENGINE, tmp_path / "cache")
    assert again.file(key, "cubin", compile_fn) == path and again.stats.misses == 1 and compile_fn.calls == 2


def test_a_disabled_cache_hands_back_a_temporary_file(tmp_path: Path, system_tmp: Path) -> None:
    compile_fn = CountingCompile({"so": b"library"})
    cache = CompileCache(ENGINE, tmp_path / "off", enabled=False)
    first, second = (cache.file("ab" * 32, "so", compile_fn) for _ in range(2))
    assert first.read_bytes() == second.read_bytes() == b"library" and first.parent != second.parent
    assert first.is_relative_to(system_tmp) and compile_fn.calls == 2 and not (tmp_path / "off").exists()


def test_a_scratch_folder_is_removed_afterwards_and_so_are_those_of_killed_builds(tmp_path: Path) -> None:
    cache = CompileCache(ENGINE, tmp_path)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f"{SCRATCH_PREFIX}{ended.stdout.strip()}-x1y2"  # its process has ended
    reused = tmp_path / f"{SCRATCH_PREFIX}1-old"  # a live process id, but hours old
    live = tmp_path / f"{SCRATCH_PREFIX}{os.getpid()}-other"  # a build running now beside this one
    entry = tmp_path / "ab"  # the entries' folders are not scratch, however old
    for folder in (killed, reused, live, entry):
        folder.mkdir()
        (folder / "native.c").write_text("int half_written;")
    for folder in (reused, entry):
        os.utime(folder, (time.time() - 2 * 3600,) * 2)
    with cache.scratch() as scratch:
        assert scratch.is_dir() and scratch.name.startswith(f"{SCRATCH_PREFIX}{os.getpid()}-")
        (scratch / "out.so").write_bytes(b"x")
    assert not scratch.exists() and not killed.exists() and not reused.exists()
    assert live.is_dir() and entry.is_dir()


@pytest.mark.parametrize("where", ["root is a file", "under a file", "disabled"])
def test_a_cache_that_cannot_be_written_turns_to_the_users_own_temporary_folder(
    tmp_path: Path, system_tmp: Path, where: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache that cannot be written (HOME read-only or a file, PIE_CPU_CACHE_DIR a file, a full disk) must not
    stop a build (it turned the CPU engine's native kernels off), nor make every process build again (the CPU
    engine's native kernels took 11 s a process): it turns to the user's own temporary folder. A disabled cache
    builds in a new temporary folder."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    root = {"root is a file": blocker, "under a file": blocker / "cache", "disabled": tmp_path / "off"}[where]
    cache = CompileCache(ENGINE, root, enabled=where != "disabled")
    with caplog.at_level(logging.WARNING, logger=f"pie.engine.{ENGINE}"):
        with cache.scratch() as scratch:
            assert scratch.is_dir()
            (scratch / "out.so").write_bytes(b"x")
        path = cache.file("ab" * 32, "so", CountingCompile({"so": b"library"}))
    assert not scratch.exists() and path.read_bytes() == b"library" and path.is_relative_to(system_tmp)
    assert blocker.read_text() == "not a folder" and not (tmp_path / "off").exists()
    fallback = system_tmp / f"pie-{ENGINE}-kernels-{os.getuid()}"
    if where == "disabled":
        assert not cache.problem and not caplog.records and cache.fallback is None and not fallback.exists()
    else:
        assert cache.fallback == cache.root == fallback and scratch.parent == fallback and path.is_relative_to(fallback)
        assert cache.problem.startswith(str(root))
        assert len(caplog.records) == 1, "one warning, not one per file"
        assert f"the kernel cache {root} cannot be written" in caplog.text and "PIE_DEMO_CACHE_DIR" in caplog.text
        assert f"kernels are kept in {fallback}" in caplog.text


def test_what_one_process_kept_in_the_fallback_the_next_one_uses(tmp_path: Path, system_tmp: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    compile_fn = CountingCompile({"so": b"library"})
    key = cache_key(**KEY_PARTS)
    first = CompileCache(ENGINE, blocker / "cache")
    path = first.file(key, "so", compile_fn)
    second = CompileCache(ENGINE, blocker / "cache")  # another process's, which has not tried to write yet
    assert second.file(key, "so", compile_fn) == path and path.read_bytes() == b"library"
    assert compile_fn.calls == 1 and second.stats.hits == 1
    assert path.is_relative_to(system_tmp / f"pie-{ENGINE}-kernels-{os.getuid()}")


def test_a_read_only_cache_of_prebuilt_kernels_is_still_read_after_a_write_to_it_failed(
    tmp_path: Path, system_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A baked image's kernels, or an admin-filled shared folder: once one miss turned writes to the fallback, the
    cache read only the fallback, and compiled again every prebuilt entry it was asked for after that."""
    root = tmp_path / "cache"
    prebuilt = [cache_key(**{**KEY_PARTS, "source": name}) for name in ("A", "C")]
    for key in prebuilt:
        CompileCache(ENGINE, root).store(key, {"so": b"prebuilt"})
    real_write = compile_cache.write_atomically

    def read_only(path: Path, data: bytes, *args: object, **kwargs: object) -> None:
        if Path(path).is_relative_to(root):
            raise PermissionError(13, "Permission denied", str(path))
        real_write(path, data, *args, **kwargs)

    monkeypatch.setattr(compile_cache, "write_atomically", read_only)
    cache = CompileCache(ENGINE, root)
    compile_fn = CountingCompile({"so": b"built"})
    missing = cache_key(**{**KEY_PARTS, "source": "B"})
    assert [cache.get_or_compile(key, compile_fn)["so"] for key in (prebuilt[0], missing, prebuilt[1])] == [
        b"prebuilt", b"built", b"prebuilt"]
    assert compile_fn.calls == 1 and cache.fallback is not None and cache.fallback.is_relative_to(system_tmp)


def test_a_fallback_folder_another_user_could_have_made_is_never_used(tmp_path: Path, system_tmp: Path) -> None:
    """One that others may write, holding a planted entry: the cache neither loads from it nor writes into it."""
    key = cache_key(**KEY_PARTS)
    CompileCache(ENGINE, tmp_path / "planted").store(key, {"so": b"planted code"})
    planted = system_tmp / f"pie-{ENGINE}-kernels-{os.getuid()}"
    shutil.copytree(tmp_path / "planted", planted)
    planted.chmod(0o777)
    before = sorted((p.relative_to(planted), p.read_bytes()) for p in planted.rglob("*") if p.is_file())
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    compile_fn = CountingCompile({"so": b"library"})
    cache = CompileCache(ENGINE, blocker / "cache")
    path = cache.file(key, "so", compile_fn)
    assert path.read_bytes() == b"library" and compile_fn.calls == 1 and not path.is_relative_to(planted)
    assert cache.fallback is None and cache.problem.startswith(str(blocker))
    assert sorted((p.relative_to(planted), p.read_bytes()) for p in planted.rglob("*") if p.is_file()) == before


def test_nvrtc_units_go_through_the_cache(tmp_path: Path) -> None:
    compiler_module = pytest.importorskip("pie_engine_cuda.compiler")
    Nvrtc, compile_source = compiler_module.Nvrtc, compiler_module.compile_source
    core = pytest.importorskip("pie_engine_cuda.sources").unit_source("core", "cuda")
    try:
        nvrtc = Nvrtc()
        nvrtc.version  # noqa: B018
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"NVRTC is not available: {exc}")

    class Counting(Nvrtc):
        calls = 0

        def compile(self, source: str, unit: str, arch: str) -> dict[str, bytes]:
            Counting.calls += 1
            return super().compile(source, unit, arch)

    cache = CompileCache(ENGINE, tmp_path, enabled=True)
    compiler = Counting()
    first = compile_source(compiler, "core", core, "sm_90", cache)
    second = compile_source(compiler, "core", core, "sm_90", CompileCache(ENGINE, tmp_path, enabled=True))
    assert Counting.calls == 1
    assert first == second and first["cubin"].startswith(b"\x7fELF")
    compile_source(compiler, "core", core, "sm_80", cache)
    assert Counting.calls == 2, "another architecture is another entry"
