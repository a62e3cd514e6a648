"""Shared libraries built by the host's compiler: cached by everything in the key, a rejected source and a
missing compiler said in words, the library loadable."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest

from pie.enginekit.compile_cache import CompileCache
from pie.enginekit.host_compiler import HostBuildError, build_shared_library, find_compiler

FLAGS = ("-O1", "-shared", "-fPIC")
ANSWER = "int pie_answer(void) { return 42; }\n"


@pytest.fixture
def cache(tmp_path: Path) -> CompileCache:
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine (CI installs gcc)")
    return CompileCache("demo", tmp_path)


def test_a_build_is_cached_by_source_flags_and_arch(cache: CompileCache) -> None:
    first = build_shared_library(ANSWER, "answer.c", FLAGS, "x86_64 avx2", cache)
    assert ctypes.CDLL(str(first)).pie_answer() == 42
    modified = first.stat().st_mtime_ns
    assert build_shared_library(ANSWER, "answer.c", FLAGS, "x86_64 avx2", cache) == first
    assert first.stat().st_mtime_ns == modified, "the cached library was built again"
    others = {
        build_shared_library(ANSWER.replace("42", "43"), "answer.c", FLAGS, "x86_64 avx2", cache),
        build_shared_library(ANSWER, "answer.c", (*FLAGS, "-O2"), "x86_64 avx2", cache),
        build_shared_library(ANSWER, "answer.c", FLAGS, "x86_64 sse2", cache),
        build_shared_library(ANSWER, "answer.c", FLAGS, "x86_64 avx2", cache, libraries=("-lm",)),
    }
    assert first not in others and len(others) == 4


def test_a_rejected_source_names_the_compiler_error(cache: CompileCache) -> None:
    with pytest.raises(HostBuildError, match=r"rejected broken\.c(.|\n)*undeclared_name"):
        build_shared_library("int broken(void) { return undeclared_name; }\n", "broken.c", FLAGS, "", cache)


def test_no_compiler_is_a_clear_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_compiler() is None
    with pytest.raises(HostBuildError, match="no C compiler"):
        build_shared_library("int x;\n", "x.c", FLAGS, "", CompileCache("demo", tmp_path))


def test_the_named_compiler_is_used_and_one_that_cannot_run_is_said(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert find_compiler("CXX", ("g++",)) == "no-such-compiler", "not found on PATH: still the one named"
    with pytest.raises(HostBuildError, match="no-such-compiler.*cannot run"):
        build_shared_library("int x;\n", "x.c", FLAGS, "", CompileCache("demo", tmp_path), "no-such-compiler")


def test_a_cache_that_cannot_be_written_builds_in_the_users_own_temporary_folder(
    tmp_path: Path, system_tmp: Path
) -> None:
    """The compiler used to run in a scratch folder made in the cache, whatever the cache could hold: a cache
    folder that was a file (or under a read-only home, or on a full disk) left no library at all."""
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine (CI installs gcc)")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    cache = CompileCache("demo", blocker)
    library = build_shared_library(ANSWER, "answer.c", FLAGS, "x86_64 avx2", cache)
    assert ctypes.CDLL(str(library)).pie_answer() == 42
    assert library.is_relative_to(system_tmp / f"pie-demo-kernels-{os.getuid()}")
    assert cache.problem.startswith(str(blocker)) and blocker.read_text() == "not a folder"


def test_each_reason_a_build_fails_comes_with_its_own_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`pie doctor` prints the fix: "install a C compiler" only where none was found."""
    failing = tmp_path / "cc"
    failing.write_text("#!/bin/sh\necho 'cc: cannot execute the assembler' >&2\nexit 1\n")
    failing.chmod(0o755)
    said = r"does not work: `.*cc --version` exited with 1: cc: cannot execute"
    with pytest.raises(HostBuildError, match=said) as info:
        build_shared_library("int x;\n", "x.c", FLAGS, "", CompileCache("demo", tmp_path / "cache"), str(failing))
    assert "$CC" in info.value.fix and "unset it" in info.value.fix
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(HostBuildError, match="no C compiler") as info:
        build_shared_library("int x;\n", "x.c", FLAGS, "", CompileCache("demo", tmp_path / "cache"))
    assert info.value.fix.startswith("install a C compiler")
