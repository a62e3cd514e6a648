"""The compile cache: a miss compiles and stores, a hit does not compile, a damaged entry is
detected by its checksum, removed and compiled again."""

from __future__ import annotations

from pathlib import Path

import pytest
from pie_engine_cuda.cache import (
    CACHE_DIR_ENV,
    CompileCache,
    cache_key,
    default_cache_dir,
)
from pie_engine_cuda.compiler import Nvrtc, compile_unit

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
    cache = CompileCache(tmp_path / "cache", enabled=True)
    return cache, cache_key(**KEY_PARTS), CountingCompile({"ptx": b".version 9.0\n" * 50, "cubin": bytes(range(256)) * 4})


def test_miss_compiles_and_stores_then_hit_reads_it_back(tmp_path: Path) -> None:
    cache, key, compile_fn = _entry(tmp_path)
    first = cache.get_or_compile(key, compile_fn)
    assert compile_fn.calls == 1 and cache.stats.misses == 1
    assert cache.path(key).is_file()
    again = CompileCache(tmp_path / "cache", enabled=True)  # a new process reading the same folder
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

    fresh = CompileCache(tmp_path / "cache", enabled=True)
    artifacts = fresh.get_or_compile(key, compile_fn)
    assert fresh.stats.corrupted == 1 and fresh.stats.misses == 1
    assert compile_fn.calls == 2
    assert artifacts == compile_fn.artifacts
    assert CompileCache(tmp_path / "cache", enabled=True).load(key) == compile_fn.artifacts, "the entry was rewritten"


def test_key_changes_with_every_input() -> None:
    base = cache_key(**KEY_PARTS)
    for field, other in (("source", "kernel text 2"), ("compiler", "hip/hiprtc"), ("compiler_version", "13.1"),
                         ("arch", "sm_80"), ("options", ("-O3",))):
        assert cache_key(**{**KEY_PARTS, field: other}) != base, field


def test_directory_comes_from_the_environment(tmp_path: Path) -> None:
    assert default_cache_dir({CACHE_DIR_ENV: str(tmp_path)}) == tmp_path
    assert default_cache_dir({}).name == "cuda-kernels"


def test_a_disabled_cache_always_compiles(tmp_path: Path) -> None:
    cache = CompileCache(tmp_path, enabled=False)
    key = cache_key(**KEY_PARTS)
    compile_fn = CountingCompile({"so": b"x"})
    cache.get_or_compile(key, compile_fn)
    cache.get_or_compile(key, compile_fn)
    assert compile_fn.calls == 2
    assert not any(tmp_path.iterdir())


def test_an_unwritable_cache_still_returns_the_artifacts(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = CompileCache(blocker / "cache", enabled=True)
    compile_fn = CountingCompile({"so": b"x"})
    assert cache.get_or_compile(cache_key(**KEY_PARTS), compile_fn) == {"so": b"x"}


def test_nvrtc_units_go_through_the_cache(tmp_path: Path) -> None:
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

    cache = CompileCache(tmp_path, enabled=True)
    compiler = Counting()
    first = compile_unit(compiler, "core", "sm_90", cache)
    second = compile_unit(compiler, "core", "sm_90", CompileCache(tmp_path, enabled=True))
    assert Counting.calls == 1
    assert first == second and first["cubin"].startswith(b"\x7fELF")
    compile_unit(compiler, "core", "sm_80", cache)
    assert Counting.calls == 2, "another architecture is another entry"
